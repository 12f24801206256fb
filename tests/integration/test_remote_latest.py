"""The remote ``latest`` pointer for single files at a URL, against a real S3 server (SeaweedFS).

After the replicator verifies an upload it publishes the sidecar, then moves ``DIR/latest``
forward; ``fastckpt.latest(url)`` reads it instead of listing the bucket, and falls back to a
listing when the pointer is stale.
"""

from __future__ import annotations

import torch

import fastckpt
from fastckpt.commit import discovery
from fastckpt.commit import protocol as C
from fastckpt.commit.protocol import SIDECAR
from fastckpt.storage.homes import Homes


def _state(step: int) -> dict:
    return {"w": torch.full((1 << 16,), step, dtype=torch.int32), "step": step}


def _keys(s3_server, bucket: str) -> list[str]:
    return [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket).get("Contents", [])]


def _pointer(s3_server, bucket: str, key: str) -> str:
    return s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read().decode()


class Listings:
    """Counts the listings a Target makes, to show that the pointer answers without one."""

    def __init__(self, target) -> None:
        self.n, self._list = 0, target.list

        def counted(prefix: str = "") -> list[str]:
            self.n += 1
            return self._list(prefix)

        target.list = counted


def test_pointer_follows_each_verified_file_and_answers_latest(s3_server, s3_bucket, tmp_path) -> None:
    opts = s3_server.storage_options()
    url = f"s3://{s3_bucket}/ckpts"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=opts) as ck:
        for step in (1, 2, 3):
            ck.save(_state(step), f"{url}/step={step}.ckpt").wait()
            # published after the sidecar, so whatever it names is complete
            assert _pointer(s3_server, s3_bucket, "ckpts/latest") == f"step={step}.ckpt"
            assert f"ckpts/step={step}.ckpt{SIDECAR}" in _keys(s3_server, s3_bucket)
    homes = Homes(opts, retry_deadline_s=30.0, parallelism=2)
    target = homes.resolve(url).target
    listings = Listings(target)
    assert discovery.latest(homes, url) == f"{url}/step=3.ckpt"
    assert listings.n == 0  # a few small requests (the pointer, the sidecar, a HEAD), no listing
    assert fastckpt.latest(url, storage_options=opts) == f"{url}/step=3.ckpt"
    assert fastckpt.load(fastckpt.latest(url, storage_options=opts), storage_options=opts)["step"] == 3
    # a fresh node restores from the pointer; the restore time (RTO) is in stats()
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "fresh"), storage_options=opts) as ck2:
        assert ck2.stats().last_restore_s is None
        assert ck2.load(ck2.latest(url))["step"] == 3
        st = ck2.stats()
        assert st.last_restore_from == "remote" and 0 < st.last_restore_s < 60


def test_stale_pointer_falls_back_to_a_listing(s3_server, s3_bucket, tmp_path) -> None:
    opts = s3_server.storage_options()
    url = f"s3://{s3_bucket}/ckpts"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=opts) as ck:
        for step in (1, 2):
            ck.save(_state(step), f"{url}/step={step}.ckpt").wait()
    for key in ("ckpts/step=2.ckpt", f"ckpts/step=2.ckpt{SIDECAR}"):  # deleted by another tool (aws s3 rm)
        s3_server.client().delete_object(Bucket=s3_bucket, Key=key)
    assert _pointer(s3_server, s3_bucket, "ckpts/latest") == "step=2.ckpt"  # it names a deleted checkpoint
    assert fastckpt.latest(url, storage_options=opts) == f"{url}/step=1.ckpt"
    # garbage in the pointer (a hand edit, a foreign tool) is ignored the same way
    s3_server.client().put_object(Bucket=s3_bucket, Key="ckpts/latest", Body=b"../../etc")
    assert fastckpt.latest(url, storage_options=opts) == f"{url}/step=1.ckpt"


def test_pointer_never_moves_backwards(s3_server, s3_bucket, tmp_path) -> None:
    """An older file finishing its upload after a newer one (replicate_policy="all", two
    workers) leaves the pointer on the newer one."""
    opts = s3_server.storage_options()
    url = f"s3://{s3_bucket}/ckpts"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=opts) as ck:
        ck.save(_state(1), f"{url}/a.ckpt").wait()
        ck.save(_state(2), f"{url}/b.ckpt").wait()
    place = Homes(opts).resolve(url).place()
    assert C.move_pointer(place, "a.ckpt", 0.0) is False
    assert _pointer(s3_server, s3_bucket, "ckpts/latest") == "b.ckpt"


def test_concurrent_publishers_leave_the_newest(s3_server, s3_bucket, tmp_path) -> None:
    """Two replication workers publishing at once: the pointer ends on the newer file."""
    opts = s3_server.storage_options()
    url = f"s3://{s3_bucket}/ckpts"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=opts,
                               replicate_policy="all", replicate_workers=2) as ck:
        futures = [ck.save(_state(s), f"{url}/s{s}.ckpt") for s in (1, 2, 3, 4)]
        for f in futures:
            f.wait()
    assert _pointer(s3_server, s3_bucket, "ckpts/latest") == "s4.ckpt"
    assert fastckpt.latest(url, storage_options=opts) == f"{url}/s4.ckpt"


def test_groups_and_files_share_one_pointer_order(s3_server, s3_bucket) -> None:
    """A file pointer is not overwritten by an older group's commit, and vice versa."""
    opts = s3_server.storage_options()
    loc = Homes(opts).resolve(f"s3://{s3_bucket}/mixed")
    target, prefix, place = loc.target, loc.key, loc.place()
    target.put_bytes(f"{prefix}/new.ckpt", b"x")
    target.put_bytes(f"{prefix}/new.ckpt{SIDECAR}", b'{"written_at": 200.0}')
    assert C.move_pointer(place, "new.ckpt", 200.0)
    one = {"files": {"r0.pt": {"size": 1, "checksum": "0" * 16}}}  # a group is published with its files
    for name in ("old-group", "newer-group"):
        target.put_bytes(f"{prefix}/{name}/r0.pt", b"x")
    C.publish_group(place.child("old-group"), 1, {0: one}, {}, requested_at=100.0)
    assert C.pointed_name(place) == "new.ckpt"
    C.publish_group(place.child("newer-group"), 1, {0: one}, {}, requested_at=300.0)
    assert C.pointed_name(place) == "newer-group"
