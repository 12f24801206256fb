"""Every code block of README.md, docs/*.md and examples/*/README.md runs as written, or is
marked ``<!-- skip: reason -->`` (the rules: tests/docs/blocks.py).

One test per block, named ``FILE:LINE``: ``pytest tests/docs -k burst-buffer`` runs one page.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.blocks import Block, all_blocks, run, shims
from tests.integration._fork_server import ForkServer

BLOCKS = all_blocks()
_EMPTIED: set[tuple[str, str]] = set()  # (page, bucket): emptied before the page's first block naming it


def _empty_bucket(s3_server, name: str) -> None:  # s3_server: tests.s3server.S3Server
    client = s3_server.client()
    if name not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
        client.create_bucket(Bucket=name)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=name, Key=obj["Key"])


def _env(request: pytest.FixtureRequest, block: Block, tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{shims(tmp / '.bin')}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    for key in [k for k in env if k.startswith("AWS_")]:  # a block sees the test server's or none
        del env[key]
    if block.buckets:
        s3 = request.getfixturevalue("s3_server")
        if not s3.running:
            s3.start()
        for name in block.buckets:  # a page's later blocks see its earlier ones' objects (a restore after a save)
            if (block.doc, name) not in _EMPTIED:
                _empty_bucket(s3, name)
                _EMPTIED.add((block.doc, name))
        env.update(AWS_ENDPOINT_URL=s3.endpoint_url, AWS_ACCESS_KEY_ID=s3.access_key,
                   AWS_SECRET_ACCESS_KEY=s3.secret_key, AWS_DEFAULT_REGION=s3.region)
    return env


@pytest.fixture(scope="module")
def python(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """The process Python blocks are forked from (``blocks.run``); each child gets its block's environment."""
    log = str(tmp_path_factory.mktemp("blocks-python") / "server.err")
    server = ForkServer(["torch", "fastckpt"], dict(os.environ), log, 120.0)
    yield server
    server.close()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs(block: Block, request: pytest.FixtureRequest, tmp_path: Path, python: ForkServer) -> None:
    if block.skip is not None:
        pytest.skip(f"{block.id}: {block.skip}")
    if block.runner is None:
        pytest.fail(f"{block.id}: a ```{block.language or '(untagged)'} block neither runs nor says why not: tag "
                    "it ```python or ```bash, or put `<!-- skip: reason -->` on the line before it (sample "
                    "output, a GPU, several nodes...)", pytrace=False)
    env = _env(request, block, tmp_path)
    done = run(block, tmp_path, env, python)
    if done.returncode != 0:
        pytest.fail(f"{block.id} exited {done.returncode}:\n{done.stdout[-6000:]}", pytrace=False)


def test_blocks_found() -> None:
    """The lexer sees the blocks (a parser change that found none would pass every page)."""
    docs = {b.doc for b in BLOCKS}
    assert "README.md" in docs and "docs/core.md" in docs
    assert sum(b.runner is not None and b.skip is None for b in BLOCKS) >= 20
