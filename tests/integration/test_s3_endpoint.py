"""A wrong or missing S3 endpoint fails in seconds, naming the endpoint and how to set one; an
endpoint that answered once and then goes away is an outage, retried (tests/integration/
test_burst_buffer.py: the outage tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

import fastckpt
from fastckpt.storage.types import TargetUnavailableError, TargetUnreachableError
from tests.s3server import free_ports

KEYS = {"key": "k", "secret": "s", "client_kwargs": {"region_name": "us-east-1"}}


def _refusing_endpoint() -> str:
    return f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there: connection refused


def test_refused_first_request_is_a_config_error_in_seconds() -> None:
    endpoint = _refusing_endpoint()
    t0 = time.monotonic()
    with pytest.raises(TargetUnreachableError) as info:
        fastckpt.latest("s3://bucket/run7", storage_options={"endpoint_url": endpoint, **KEYS})
    assert time.monotonic() - t0 < 30  # the default retry deadline is 300 s
    msg = str(info.value)
    assert endpoint in msg and "connection refused" in msg and "AWS_ENDPOINT_URL" in msg and "storage_options" in msg
    assert isinstance(info.value, fastckpt.ConfigError) and isinstance(info.value, TargetUnavailableError)


def test_unknown_host_is_a_config_error() -> None:
    t0 = time.monotonic()
    with pytest.raises(TargetUnreachableError, match=r"no-such-host\.invalid.*no such host.*AWS_ENDPOINT_URL"):
        fastckpt.load("s3://bucket/run7/step-1.pt",
                      storage_options={"endpoint_url": "http://no-such-host.invalid:9000", **KEYS})
    assert time.monotonic() - t0 < 60  # one name lookup, not five minutes of retries


def test_replication_to_a_refusing_endpoint_fails_the_save_once_and_keeps_the_local_copy(tmp_path) -> None:
    endpoint = _refusing_endpoint()
    ck = fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options={"endpoint_url": endpoint, **KEYS})
    url = "s3://bucket/run7/step-1.pt"
    h = ck.save({"w": torch.arange(10)}, url)
    with pytest.raises(TargetUnreachableError, match=endpoint):
        h.wait()
    assert os.path.exists(ck.local_path(url))
    ck.close()  # seen through the handle: not raised again


def test_cli_names_the_endpoint_without_a_traceback() -> None:
    endpoint = _refusing_endpoint()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s",
               AWS_DEFAULT_REGION="us-east-1")
    done = subprocess.run([sys.executable, "-m", "fastckpt.cli", "latest", "s3://bucket/run7"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    assert "TargetUnreachableError" in done.stderr and endpoint in done.stderr and "Traceback" not in done.stderr
