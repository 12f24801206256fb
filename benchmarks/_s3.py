"""A SeaweedFS S3 endpoint on 127.0.0.1 for benchmarks, reusing the tests' ``tests/s3server.py``.

That module is loaded by its path (not as ``tests.s3server``), so a benchmark needs neither the
repository root on ``sys.path`` nor the test suite's package. Everything it does (free ports,
signed requests only, the server dying with this process) applies here too; see its docstring.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

S3SERVER_PATH = Path(__file__).resolve().parents[1] / "tests" / "s3server.py"
_MODULE_NAME = "_fastckpt_bench_s3server"


def s3server_module() -> ModuleType:
    """``tests/s3server.py``, loaded once by path."""
    mod = sys.modules.get(_MODULE_NAME)
    if mod is None:
        spec = importlib.util.spec_from_file_location(_MODULE_NAME, S3SERVER_PATH)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {S3SERVER_PATH}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[_MODULE_NAME] = mod  # dataclasses look their module up while the class is built
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[_MODULE_NAME]
            raise
    return mod


@contextlib.contextmanager
def seaweed(state_dir: Path) -> Iterator[object]:
    """Start ``weed server`` with its data under ``state_dir``; yield an ``S3Server`` handle
    (``endpoint_url``, ``client()``, ``storage_options()``, ``make_bucket()``); stop it on exit,
    whatever happens (an exception, Ctrl-C)."""
    m = s3server_module()
    proc = m.SeaweedProcess(state_dir)
    try:
        proc.start()
        yield m.S3Server(proc.endpoint_url, m.ACCESS_KEY, m.SECRET_KEY, m.REGION, proc)
    finally:
        proc.close()


def client(server: object, *, plain: bool = False) -> object:
    """A boto3 S3 client for ``server``. ``plain``: botocore's defaults (what a user gets), else,
    for setting up and cleaning, patient timeouts (deleting a bucket makes SeaweedFS drop its
    volumes, which can take seconds on a busy machine) and standard retries. Path-style
    addressing either way: the endpoint is an IP address, no virtual hosts."""
    import boto3
    from botocore.config import Config

    cfg = Config(s3={"addressing_style": "path"}) if plain else Config(
        connect_timeout=10, read_timeout=120, retries={"total_max_attempts": 5, "mode": "standard"},
        s3={"addressing_style": "path"})
    return boto3.client("s3", endpoint_url=server.endpoint_url, aws_access_key_id=server.access_key,
                        aws_secret_access_key=server.secret_key, region_name=server.region, config=cfg)


def delete_prefix(client: object, bucket: str, prefix: str = "") -> None:
    """Delete every object and open multipart upload under ``prefix`` in ``bucket``."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    for up in client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []):
        client.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])


def delete_bucket(client: object, bucket: str) -> None:
    """Empty ``bucket`` and remove it; a bucket already gone is fine (a retried delete whose
    first attempt did succeed answers NoSuchBucket)."""
    delete_prefix(client, bucket)
    with contextlib.suppress(client.exceptions.NoSuchBucket):
        client.delete_bucket(Bucket=bucket)


def server_cpu_s(server: object) -> float:
    """CPU seconds (user + system) the ``weed`` process has used so far; 0.0 when unknown."""
    proc = getattr(server.process, "_proc", None)  # SeaweedProcess keeps its Popen to itself
    try:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (AttributeError, OSError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def pin_server(server: object, cpus: set[int]) -> bool:
    """Confine every thread of the ``weed`` process to ``cpus`` (threads it starts later inherit
    it); False when that is not possible here."""
    proc = getattr(server.process, "_proc", None)
    try:
        tids = os.listdir(f"/proc/{proc.pid}/task")
        for tid in tids:
            os.sched_setaffinity(int(tid), cpus)
    except (AttributeError, OSError):
        return False
    return True
