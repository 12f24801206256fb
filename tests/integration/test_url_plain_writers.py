"""Another writer beside fastckpt at a URL home (real SeaweedFS): what a load and ``latest`` do when
a plain writer (Lightning's ``TorchCheckpointIO``, ``aws s3 cp``, a restore tool) replaced or
deleted an object that fastckpt published, leaving its sidecar ``NAME.fastckpt.json``.

- A load prefers the burst-buffer copy only while the object holds that save (the manifest in the
  object's tail), not only while the sidecar names it: before, the stale copy was loaded silently.
- ``latest`` passes over a file whose object is gone under its sidecar, both where the ``latest``
  pointer names it and in the scan: before, it named the missing file, whose load then failed.
"""

from __future__ import annotations

import logging

import pytest
import torch

import fastckpt

L = pytest.importorskip("lightning")
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402

from fastckpt.integrations.lightning import FastCkptIO  # noqa: E402


def _state(step: int) -> dict:
    return {"global_step": step, "w": torch.full((1 << 14,), float(step))}


def _step(obj: dict) -> int:
    assert bool((obj["w"] == obj["global_step"]).all())
    return obj["global_step"]


@pytest.fixture
def plain_env(s3_server, monkeypatch) -> None:
    """Lightning's TorchCheckpointIO opens URLs through fsspec, which only the environment configures."""
    for k, v in {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
                 "AWS_DEFAULT_REGION": s3_server.region, "AWS_ENDPOINT_URL": s3_server.endpoint_url}.items():
        monkeypatch.setenv(k, v)


class Requests:
    """Counts the S3 requests of one s3fs session by operation (a botocore ``before-send`` hook)."""

    def __init__(self) -> None:
        from aiobotocore.session import AioSession

        self.ops: list[str] = []
        self.session = AioSession()
        self.session.register("before-send.s3", self, unique_id="test-count-requests")

    def __call__(self, request, event_name: str, **_: object) -> None:
        self.ops.append(event_name.rsplit(".", 1)[-1])  # before-send.s3.HeadObject

    def count(self, op: str) -> int:
        return self.ops.count(op)


def test_a_plain_overwrite_at_the_url_is_loaded_not_the_burst_buffer_copy(s3_server, s3_bucket, plain_env,
                                                                           tmp_path) -> None:
    """FastCkptIO saved step 4 (object, sidecar, burst-buffer copy); TorchCheckpointIO then wrote
    step 8 to the same URL. The same node's load returned step 4 from its burst buffer."""
    opts, url, nvme = s3_server.storage_options(), f"s3://{s3_bucket}/run/last.ckpt", str(tmp_path / "nvme")
    FastCkptIO(local_dir=nvme, storage_options=opts).save_checkpoint(_state(4), url)
    TorchCheckpointIO().save_checkpoint(_state(8), url)
    io = FastCkptIO(local_dir=nvme, storage_options=opts)
    assert _step(io.load_checkpoint(url)) == 8
    assert _step(torch.load(io._checkpointer().local_path(url), weights_only=True)) == 4  # kept: loaded past
    with fastckpt.Checkpointer(local_dir=nvme, storage_options=opts) as ck:
        assert _step(ck.load(url)) == 8 and ck.stats().last_restore_from == "remote"


def test_an_older_save_restored_over_the_object_is_loaded_and_reported(s3_server, s3_bucket, tmp_path,
                                                                       caplog) -> None:
    """The object put back to step 1's bytes (a restore tool), the sidecar still step 2's: the
    object is what the URL holds, so it is loaded, with the WARNING load.published gives, not the
    newer burst-buffer copy."""
    opts, url = s3_server.storage_options(), f"s3://{s3_bucket}/run/last.ckpt"
    client = s3_server.client()
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=opts) as ck:
        ck.save(_state(1), url).wait()
        old = client.get_object(Bucket=s3_bucket, Key="run/last.ckpt")["Body"].read()
        ck.save(_state(2), url).wait()
        client.put_object(Bucket=s3_bucket, Key="run/last.ckpt", Body=old)
        with caplog.at_level(logging.WARNING, logger="fastckpt"):
            assert _step(ck.load(url)) == 1 and ck.stats().last_restore_from == "remote"
    assert any("is not the save its sidecar" in r.getMessage() for r in caplog.records)


def test_the_burst_buffer_copy_of_the_objects_save_costs_one_head(s3_server, s3_bucket, tmp_path) -> None:
    """The common path: the object holds the burst-buffer copy's save. Its sidecar and its tail
    are read (two small GETs) after one HEAD; the object itself is not downloaded."""
    requests = Requests()
    opts = s3_server.storage_options(session=requests.session)
    url = f"s3://{s3_bucket}/run/last.ckpt"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=opts) as ck:
        ck.save(_state(3), url).wait()
        del requests.ops[:]
        assert _step(ck.load(url)) == 3 and ck.stats().last_restore_from == "local"
    assert (requests.count("HeadObject"), requests.count("GetObject"), len(requests.ops)) == (1, 2, 3)


def test_latest_passes_over_a_file_whose_object_was_deleted_by_another_tool(s3_server, s3_bucket, plain_env,
                                                                          tmp_path) -> None:
    """TorchCheckpointIO's remove_checkpoint (a plain run's top-k) deleted step=4.ckpt, leaving its
    sidecar and the latest pointer naming it: latest() named the missing file, whose load raised
    CheckpointNotFoundError, whose advice named latest() again."""
    opts, base = s3_server.storage_options(), f"s3://{s3_bucket}/run"
    io = FastCkptIO(local_dir=str(tmp_path / "nvme"), storage_options=opts)
    for step in (2, 4):
        io.save_checkpoint(_state(step), f"{base}/step={step}.ckpt")
    TorchCheckpointIO().remove_checkpoint(f"{base}/step=4.ckpt")
    fresh = FastCkptIO(local_dir=str(tmp_path / "nvme2"), storage_options=opts)  # the resumed job's node
    assert fresh.latest(base) == f"{base}/step=2.ckpt"
    assert _step(fresh.load_checkpoint(fresh.latest(base))) == 2
    # the scan too: with no pointer, the sidecar left without its object is no checkpoint
    s3_server.client().delete_object(Bucket=s3_bucket, Key="run/latest")
    assert fastckpt.latest(base, storage_options=opts) == f"{base}/step=2.ckpt"
