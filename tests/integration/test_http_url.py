"""Checkpoints read from an http(s):// URL (a directory published on a web server, through
fsspec's HTTPFileSystem, whose paths keep the scheme): ``latest`` names them as given, and a
server that is not there is told apart from S3 (no AWS_ENDPOINT_URL advice)."""

from __future__ import annotations

import functools
import http.server
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.storage.types import TargetUnreachableError
from fastckpt.urls import root_url


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """``tmp_path`` served over HTTP on loopback (listening before it is returned), and its URL."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield tmp_path, f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        th.join()


def test_root_url_takes_off_a_scheme_the_backend_kept() -> None:
    assert root_url("http", "http://h:1/run/", "http://h:1/run") == "http://h:1/run"
    assert root_url("memory", "memory://b", "/b") == "memory://b"


def test_latest_at_an_http_url_names_a_checkpoint_that_loads(served: tuple[Path, str]) -> None:
    """fsspec's http path keeps its scheme: ``latest`` named ``http://http://host/run/x.pt``."""
    root, base = served
    with fastckpt.Checkpointer() as ck:
        ck.save({"w": torch.arange(5)}, str(root / "run" / "x.pt")).wait()
    got = fastckpt.latest(f"{base}/run")
    assert got == f"{base}/run/x.pt"
    assert torch.equal(fastckpt.load(got)["w"], torch.arange(5))


def test_an_http_server_that_is_not_there_is_not_called_an_s3_endpoint() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TargetUnreachableError, match=rf"connection refused.*Check the host and port in "
                                                      rf"http://127\.0\.0\.1:{port}") as info:
        fastckpt.load(f"http://127.0.0.1:{port}/run/x.pt")
    assert "S3" not in str(info.value) and "AWS_ENDPOINT_URL" not in str(info.value)
