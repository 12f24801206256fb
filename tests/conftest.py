"""Shared fixtures. The SeaweedFS S3 fixture lives in tests/conftest_s3.py.

The processes the tests start get one OpenMP thread each, unless the caller set
``OMP_NUM_THREADS``: the suite runs on 2-core machines, where a docs block, an example, the
drill's job and probe, or a Megatron rank would otherwise start a torch thread per core and
spin on the cores that pytest, the other rank or the S3 server need (one docs block took
7-8 s of CPU with the default, 3.2 s with one thread). torchrun sets the same default for its
ranks, and the tests that start ranks themselves set it already; this covers the rest. This
process keeps torch's default: torch is imported first, and libgomp reads the variable once,
when it is loaded, so in-process tests run as before. No test depends on torch's thread count
(fastckpt's parallelism is its own thread pools).
"""

import importlib.util
import os
from collections.abc import Iterator

import pytest
import torch  # noqa: F401  (before the line below: this process keeps torch's default thread count)

from tests.cli_child import CliChild

os.environ.setdefault("OMP_NUM_THREADS", "1")

if importlib.util.find_spec("tests.conftest_s3") is not None:
    pytest_plugins = ["tests.conftest_s3"]


@pytest.fixture(scope="module")
def cli_child() -> Iterator[CliChild]:
    """One child process for a test module's ``fastckpt`` command lines (see tests/cli_child.py)."""
    child = CliChild()
    try:
        yield child
    finally:
        child.close()
