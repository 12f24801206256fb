"""Fixtures of the integration tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.integration._fork_server import ForkServer


@pytest.fixture(scope="session")
def megatron_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """``run_code(code, argv, timeout_s)``: a ``python -c`` child that uses megatron-core,
    forked from one process that imported torch, megatron-core and fastckpt's Megatron
    integration once for the session (``_fork_server.py``), not a fresh interpreter that spends
    about 4 s of CPU importing them."""
    pytest.importorskip("megatron.core")
    log = str(tmp_path_factory.mktemp("megatron-python") / "server.err")
    server = ForkServer(["megatron.core.dist_checkpointing", "fastckpt.integrations.megatron"], dict(os.environ), log,
                        300.0)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def torch_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """``run_code(code, argv, timeout_s)``: a ``python -c`` child forked from one process that
    imported torch once for the session, not a fresh interpreter that spends about 1.5 s of CPU
    importing it before the script's first line. Only torch: the child imports fastckpt itself,
    which registers its exit and fork hooks there, as in a fresh interpreter."""
    log = str(tmp_path_factory.mktemp("torch-python") / "server.err")
    server = ForkServer(["torch"], dict(os.environ), log, 120.0)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def lightning_python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """``torch_python`` with Lightning imported too (about 4 s of CPU more per fresh interpreter).
    Lightning reads its environment (SLURM's, the cluster's) when a Trainer is made, in the child."""
    pytest.importorskip("lightning")
    log = str(tmp_path_factory.mktemp("lightning-python") / "server.err")
    server = ForkServer(["torch", "lightning.pytorch"], dict(os.environ), log, 120.0)
    try:
        yield server
    finally:
        server.close()
