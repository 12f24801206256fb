"""One burst buffer (``local_dir``) shared by jobs whose homes are the same bucket and key on two S3
stores: each job's local copy has its own place (``urls.mirror_path`` takes the store's endpoint), so
neither replaces the other's, and no save is taken for superseded by another job's."""

from __future__ import annotations

import threading

import torch

import fastckpt
from tests.s3server import ACCESS_KEY, REGION, SECRET_KEY, S3Server, SeaweedProcess


def test_one_bucket_and_key_on_two_endpoints_keep_their_own_local_copies(s3_server: S3Server, tmp_path) -> None:
    other = SeaweedProcess(tmp_path / "weed2")
    other.start()
    try:
        second = S3Server(other.endpoint_url, ACCESS_KEY, SECRET_KEY, REGION, other)
        bucket = s3_server.make_bucket()
        second.client().create_bucket(Bucket=bucket)
        url, nv = f"s3://{bucket}/run/last.pt", str(tmp_path / "nvme")
        queued, release = threading.Event(), threading.Event()

        class HoldQueued:  # job A's upload waits, queued, while job B saves the same bucket and key elsewhere
            def emit(self, e) -> None:
                if e.name == "queued" and e.path == url and not queued.is_set():
                    queued.set()
                    assert release.wait(60)

        a = fastckpt.Checkpointer(local_dir=nv, storage_options=s3_server.storage_options(), sinks=(HoldQueued(),))
        try:
            ha = a.save({"w": torch.full((1024,), 1.0), "job": "A"}, url)
            assert queued.wait(60)
            try:
                with fastckpt.Checkpointer(local_dir=nv, storage_options=second.storage_options()) as b:
                    b.save({"w": torch.full((1024,), 2.0), "job": "B"}, url).wait()
            finally:
                release.set()
            rec = ha.wait()
            assert not rec.superseded and rec.durable_s is not None
            assert a.load(url)["job"] == "A"  # (its local copy: B's is elsewhere)
        finally:
            a.close()
        assert fastckpt.load(url, storage_options=s3_server.storage_options())["job"] == "A"
        assert fastckpt.load(url, storage_options=second.storage_options())["job"] == "B"
    finally:
        other.close()
