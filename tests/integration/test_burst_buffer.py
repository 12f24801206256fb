"""The burst buffer end to end: local_dir -> POSIX directory or a real S3 server (SeaweedFS).

Outages are real: the server process is stopped and started. Synchronisation is by events
(fastckpt's own retry events, FaultyOps gates), never by sleeping.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

import fastckpt
from fastckpt.commit.protocol import SIDECAR
from fastckpt.errors import ConfigError, CorruptCheckpointError, ReplicationError
from fastckpt.io.atomic import TMP_TAG, final_path
from fastckpt.storage.types import BucketNotFoundError
from fastckpt.testing import FaultyOps


def _state(step: int, n: int = 1 << 18) -> dict:
    return {"w": torch.full((n,), step, dtype=torch.int32), "step": step}


def _same(a: dict, step: int) -> bool:
    return a["step"] == step and bool((a["w"] == step).all())


class Waiter:
    """An EventSink that lets a test wait for a named event."""

    def __init__(self, name: str) -> None:
        self.name, self.seen = name, threading.Event()
        self.events: list = []

    def emit(self, ev) -> None:  # noqa: ANN001
        self.events.append(ev)
        if ev.name == self.name:
            self.seen.set()


class QueueWaiter:
    """An EventSink set when ``path`` joins the replication queue."""

    def __init__(self, path: str) -> None:
        self.path, self.seen = path, threading.Event()

    def emit(self, ev) -> None:  # noqa: ANN001
        if ev.name == "queued" and ev.path == self.path:
            self.seen.set()


# ----------------------------------------------------------------------------- S3


def test_s3_round_trip_latest_and_fresh_node_restore(s3_server, s3_bucket, tmp_path) -> None:
    opts = s3_server.storage_options()
    url = f"s3://{s3_bucket}/run7"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=opts) as ck:
        for step in (1, 2):
            rec = ck.save(_state(step), f"{url}/step-{step}/state.pt").wait()
            assert rec.tier == "nvme" and rec.local_durable_s <= rec.durable_s
        st = ck.stats()
        assert st.replication_lag_s == 0.0 and st.rpo_s is not None and st.rpo_s >= 0
    keys = {o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"]}
    assert "run7/step-2/state.pt" in keys and "run7/step-2/state.pt" + SIDECAR in keys
    assert fastckpt.latest(url, storage_options=opts) == f"{url}/step-2/state.pt"
    # a fresh node: empty burst buffer, the newest complete remote checkpoint loads verified
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "fresh"), storage_options=opts) as ck2:
        newest = fastckpt.latest(url, storage_options=opts)
        assert _same(ck2.load(newest), 2)
        assert not os.path.exists(ck2.local_path(newest))
        assert _same(ck2.load(newest, prefetch=True), 2)  # downloaded into the burst buffer
        assert os.path.exists(ck2.local_path(newest))
    body = s3_server.client().get_object(Bucket=s3_bucket, Key="run7/step-1/state.pt")["Body"].read()
    (tmp_path / "plain.pt").write_bytes(body)
    assert _same(torch.load(tmp_path / "plain.pt", weights_only=True), 1)  # no lock-in


def test_s3_outage_then_recovery_completes(s3_server, s3_bucket, tmp_path) -> None:
    retries = Waiter("retry")
    ck = fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=s3_server.storage_options(),
                               retry_deadline_s=120, sinks=(retries,))
    assert ck.latest(f"s3://{s3_bucket}/r") is None  # the endpoint answered once: what follows is an outage
    s3_server.stop()
    try:
        h = ck.save(_state(3), f"s3://{s3_bucket}/r/s3.pt")
        assert retries.seen.wait(60), "replication never retried against the stopped server"
    finally:
        s3_server.start()
    rec = h.wait()
    assert rec.durable_s is not None and rec.durable_s >= rec.local_durable_s
    ck.close()
    assert _same(fastckpt.load(f"s3://{s3_bucket}/r/s3.pt", storage_options=s3_server.storage_options()), 3)


def test_s3_stopped_mid_upload_resumes_and_publishes_only_verified(s3_server, s3_bucket, tmp_path) -> None:
    # The server is killed by the upload's own first acknowledged part (a botocore hook) and
    # restarted once fastckpt reports a retry: the order is fixed by events, not timing.
    from aiobotocore.session import AioSession

    client = s3_server.client()
    url, key = f"s3://{s3_bucket}/mid/state.pt", "mid/state.pt"

    def visible() -> set[str]:
        return {o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])}

    stopped = threading.Event()
    at_stop: list[set[str]] = []
    at_sidecar: list[tuple[int, int]] = []

    def after_part(http_response, **_: object) -> None:
        if http_response.status_code == 200 and not stopped.is_set():
            at_stop.append(visible())
            s3_server.stop()
            stopped.set()

    def before_put(params: dict, **_: object) -> None:
        if params["Key"] == key + SIDECAR:  # what is there when the sidecar is about to be published
            head = client.head_object(Bucket=s3_bucket, Key=key)
            at_sidecar.append((head["ContentLength"], len(client.list_multipart_uploads(Bucket=s3_bucket)
                                                            .get("Uploads", []))))

    session = AioSession()
    session.register("after-call.s3.UploadPart", after_part, unique_id="test-stop-after-part")
    session.register("before-parameter-build.s3.PutObject", before_put, unique_id="test-sidecar-order")
    opts = s3_server.storage_options(session=session)
    sink = Waiter("retry")
    ck = fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=opts, io_threads=1,
                               retry_deadline_s=120, sinks=(sink,))
    try:
        h = ck.save(_state(6, n=10 << 20), url)  # 40 MiB: three 16 MiB parts, sent one at a time
        assert sink.seen.wait(120), "replication never retried against the stopped server"
        assert stopped.is_set()
    finally:
        if not s3_server.running:
            s3_server.start()
    rec = h.wait()
    ck.close()  # nothing left to raise
    assert rec.durable_s is not None and rec.durable_s >= rec.local_durable_s
    assert at_stop == [set()]  # one part stored, nothing visible: no object, no sidecar
    assert at_sidecar == [(rec.bytes, 0)]  # the sidecar came after the whole object, upload closed
    retries = [e for e in sink.events if e.name == "retry"]
    assert retries and all(e.path.startswith("upload of part 2/3 of ") for e in retries)
    reps = [e for e in sink.events if e.name == "replicate"]
    assert len(reps) == 1 and reps[0].error is None  # one outcome: success, after the retries
    assert f"retries={len(retries)} " in reps[0].detail and "verified=checksum" in reps[0].detail
    assert ck.stats().replication_failures == 0
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "fresh"), storage_options=s3_server.storage_options()) as ck2:
        assert _same(ck2.load(url), 6)  # a fresh node: read from the bucket, verified


def test_store_without_checksums_is_read_back(tmp_path) -> None:
    # fsspec's memory filesystem confirms no part checksum: the replica is read back instead.
    pytest.importorskip("fsspec")
    sink = Waiter("replicate")
    url = f"memory://fastckpt-{os.getpid()}-{id(sink)}/r/x.pt"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), sinks=(sink,)) as ck:
        assert ck.save(_state(8), url).wait().durable_s is not None
    (rep,) = [e for e in sink.events if e.name == "replicate"]
    assert rep.error is None and "verified=readback" in rep.detail
    assert _same(fastckpt.load(url), 8)


def test_s3_readback_mode_reads_every_replica_back(s3_server, s3_bucket, tmp_path) -> None:
    sink = Waiter("replicate")
    url = f"s3://{s3_bucket}/rb/x.pt"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=s3_server.storage_options(),
                               replicate_verify="readback", sinks=(sink,)) as ck:
        assert ck.save(_state(9), url).wait().durable_s is not None
    (rep,) = [e for e in sink.events if e.name == "replicate"]
    assert rep.error is None and "verified=readback" in rep.detail
    with pytest.raises(fastckpt.ConfigError, match="replicate_verify='md5'.*'checksum'.*'readback'"):
        fastckpt.Checkpointer(replicate_verify="md5")


def test_s3_never_comes_back_keeps_local_and_errors_once(s3_server, s3_bucket, tmp_path) -> None:
    ck = fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=s3_server.storage_options(),
                               retry_deadline_s=2)
    assert ck.latest(f"s3://{s3_bucket}/r") is None  # answered once (never reached at all: test_s3_endpoint.py)
    s3_server.stop()
    try:
        h = ck.save(_state(4), f"s3://{s3_bucket}/r/down.pt")
        with pytest.raises(ReplicationError, match="down.pt|deadline|unavailable|reach"):
            h.wait()
        assert ck.stats().replication_failures == 1
        local = ck.local_path(f"s3://{s3_bucket}/r/down.pt")
        assert os.path.exists(local) and _same(torch.load(local, weights_only=True), 4)
        ck.close()  # the error was seen through the handle: not raised again
    finally:
        s3_server.start()


def test_s3_a_name_whose_sidecar_the_store_refuses_is_refused_at_save(s3_server, s3_bucket, tmp_path) -> None:
    """SeaweedFS, as MinIO, takes at most 255 bytes in one part of a key: a 248-byte file name was
    uploaded whole, then its sidecar (NAME.fastckpt.json, 262 bytes) was refused, on every save,
    leaving the object unpublished and an error (KeyTooLongError) naming neither limit nor fix."""
    run = f"s3://{s3_bucket}/run"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=s3_server.storage_options()) as ck:
        with pytest.raises(ConfigError, match=r"NAME\.fastckpt\.json, would have a last part of 262 bytes, over the "
                                              r"255 bytes SeaweedFS and MinIO take in one part of a key.*Choose a "
                                              r"shorter file name, of at most 241 bytes \(it has 248\)"):
            ck.save(_state(1), f"{run}/{'m' * 245}.pt")
        longest = f"{'n' * 238}.pt"  # 241 bytes: its sidecar's 255 is taken
        ck.save(_state(2), f"{run}/{longest}").wait()
    listed = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
    assert sorted(listed) == ["run/latest", f"run/{longest}", f"run/{longest}{SIDECAR}"]
    assert [p.name for p in (tmp_path / "nvme").rglob("m*")] == []  # nothing written for the refused name
    assert fastckpt.latest(run, storage_options=s3_server.storage_options()) == f"{run}/{longest}"


def test_s3_missing_bucket_is_named(s3_server, tmp_path) -> None:
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=s3_server.storage_options()) as ck:
        h = ck.save(_state(1), "s3://no-such-bucket-fastckpt/x.pt")
        with pytest.raises(ReplicationError, match="no-such-bucket-fastckpt"):
            h.wait()


def test_s3_missing_bucket_of_a_group_is_named_at_its_commit(s3_server, s3_bucket, tmp_path) -> None:
    """A group saved to a missing bucket (a typo): its commit raises BucketNotFoundError, which
    names the fix, and only once; never GroupRemovedError ("removed while it was being committed",
    when nobody removed anything). The next group, to a bucket that exists, commits."""
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=s3_server.storage_options()) as ck:
        bad, good = "s3://no-such-bucket-fastckpt/run/t1", f"s3://{s3_bucket}/run/t2"
        for n in ("a.pt", "b.pt"):
            ck.save(_state(1, 1 << 10), f"{bad}/{n}", group=bad)
        with pytest.raises(BucketNotFoundError, match="no-such-bucket-fastckpt.* create it"):
            ck.commit(bad).wait(60)
        for n in ("a.pt", "b.pt"):
            ck.save(_state(2, 1 << 10), f"{good}/{n}", group=good)
        ck.commit(good).wait(60)
        assert fastckpt.latest(f"s3://{s3_bucket}/run", storage_options=s3_server.storage_options()) == good


def test_s3_corrupted_remote_detected_and_local_preferred(s3_server, s3_bucket, tmp_path) -> None:
    opts = s3_server.storage_options()
    url = f"s3://{s3_bucket}/c/x.pt"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=opts) as ck:
        ck.save(_state(5), url).wait()
        cli = s3_server.client()
        body = bytearray(cli.get_object(Bucket=s3_bucket, Key="c/x.pt")["Body"].read())
        body[5000] ^= 0xFF
        cli.put_object(Bucket=s3_bucket, Key="c/x.pt", Body=bytes(body))
        assert _same(ck.load(url), 5)  # the verified burst-buffer copy is used
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "fresh"), storage_options=opts) as ck2:
        with pytest.raises(CorruptCheckpointError, match="x.pt"):
            ck2.load(url)


def test_s3_a_burst_buffer_copy_of_another_save_is_not_loaded(s3_server, s3_bucket, tmp_path) -> None:
    """Node A saves step 100, node B then saves step 200 to the same URL: node A's burst-buffer
    copy is of another save than the one at the home (its sidecar says so), so node A loads 200."""
    opts, url = s3_server.storage_options(), f"s3://{s3_bucket}/stale/last.ckpt"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nodeA"), storage_options=opts) as a:
        a.save(_state(100), url).wait()
        with fastckpt.Checkpointer(local_dir=str(tmp_path / "nodeB"), storage_options=opts) as b:
            b.save(_state(200), url).wait()
        assert _same(a.load(url), 200) and a.stats().last_restore_from == "remote"
        a.save(_state(300), url).wait()  # the same save at both: the local copy is read
        assert _same(a.load(url), 300) and a.stats().last_restore_from == "local"


def test_s3_unreachable_home_still_loads_the_burst_buffer_copy(s3_server, s3_bucket, tmp_path) -> None:
    """Which save the home holds cannot be asked: the local copy is loaded, as without the
    check, after a short wait (not the retry deadline of 300 s)."""
    url = f"s3://{s3_bucket}/down/x.pt"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=s3_server.storage_options()) as ck:
        ck.save(_state(7), url).wait()
        s3_server.stop()
        try:
            t0 = time.monotonic()
            assert _same(ck.load(url), 7) and ck.stats().last_restore_from == "local"
            assert time.monotonic() - t0 < 60
        finally:
            s3_server.start()


def test_s3_group_from_two_ranks(s3_server, s3_bucket, tmp_path) -> None:
    opts = s3_server.storage_options()
    tag = f"s3://{s3_bucket}/ds/global_step10"
    cks = [fastckpt.Checkpointer(local_dir=str(tmp_path / f"nvme{r}"), storage_options=opts, rank=r,
                                 world_size=2, commit_timeout_s=60) for r in range(2)]
    for r, ck in enumerate(cks):
        ck.save(_state(10 + r), f"{tag}/rank{r}.pt", group=tag)
    handles = [ck.commit(tag, step=10) for ck in cks]
    recs = [h.wait() for h in handles]
    assert all(not r.superseded for r in recs)
    manifest = json.loads(s3_server.client().get_object(Bucket=s3_bucket, Key="ds/global_step10/"
                                                        "fastckpt-manifest.json")["Body"].read())
    assert sorted(manifest["files"]) == ["rank0.pt", "rank1.pt"] and manifest["step"] == 10
    latest = s3_server.client().get_object(Bucket=s3_bucket, Key="ds/latest")["Body"].read()
    assert latest == b"global_step10"
    assert fastckpt.latest(f"s3://{s3_bucket}/ds", storage_options=opts) == tag
    for ck in cks:
        ck.close()
    with fastckpt.Checkpointer(storage_options=opts, local_dir=str(tmp_path / "fresh")) as ck:
        assert _same(ck.load(f"{tag}/rank1.pt"), 11)


# ----------------------------------------------------------------------------- POSIX target


def test_posix_coalesce_drops_superseded_queued_checkpoints(tmp_path) -> None:
    ops = FaultyOps()
    local = str(tmp_path / "nvme")
    gate = ops.gate("preadv", path_contains=local)  # holds the first copy to the target
    queued = QueueWaiter(str(tmp_path / "t" / "a3.pt"))
    ck = fastckpt.Checkpointer(local_dir=local, ops=ops, replicate_workers=1, sinks=(queued,))
    h1 = ck.save(_state(1), str(tmp_path / "t" / "a1.pt"))
    assert gate.wait_entered(60)
    h2 = ck.save(_state(2), str(tmp_path / "t" / "a2.pt"))
    h3 = ck.save(_state(3), str(tmp_path / "t" / "a3.pt"))
    assert queued.seen.wait(60)  # a3 joined the queue while a1 was held: a2 is superseded
    gate.open()
    r1, r2, r3 = h1.wait(), h2.wait(), h3.wait()
    assert not r1.superseded and r2.superseded and r2.durable_s is None and not r3.superseded
    assert not os.path.exists(tmp_path / "t" / "a2.pt") and os.path.exists(ck.local_path(str(tmp_path / "t" / "a2.pt")))
    assert fastckpt.latest(str(tmp_path / "t")) == str(tmp_path / "t" / "a3.pt")
    ck.close()


def test_posix_policy_all_replicates_every_one(tmp_path) -> None:
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), replicate_policy="all") as ck:
        hs = [ck.save(_state(i), str(tmp_path / "t" / f"b{i}.pt")) for i in range(4)]
        recs = [h.wait() for h in hs]
    assert not any(r.superseded for r in recs)
    assert sorted(os.listdir(tmp_path / "t")) == [f"b{i}.pt" for i in range(4)]


def test_retention_keeps_newest_local_and_persistent(tmp_path) -> None:
    dest = tmp_path / "t"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), keep_local=1, keep_persistent=2) as ck:
        for i in range(4):
            ck.save(_state(i), str(dest / f"c{i}.pt")).wait()
        local_files = [p for p in (ck.local_path(str(dest / f"c{i}.pt")) for i in range(4)) if os.path.exists(p)]
    assert sorted(os.listdir(dest)) == ["c2.pt", "c3.pt"]
    assert [os.path.basename(p) for p in local_files] == ["c3.pt"]


def test_retention_keeps_the_newest_save_when_an_older_one_is_verified_last(tmp_path) -> None:
    nvme, dest = str(tmp_path / "nvme"), tmp_path / "t"
    old, new = str(dest / "c1.pt"), str(dest / "c2.pt")
    entered, release = threading.Event(), threading.Event()

    def hold_upload_of_c1(op: str, path: str) -> None:  # its copy to dest waits; c2's runs beside it
        if op == "pwrite" and final_path(path) == str(dest / "c1.pt"):
            entered.set()
            assert release.wait(60)

    ck = fastckpt.Checkpointer(local_dir=nvme, ops=FaultyOps(on_call=hold_upload_of_c1), keep_local=1,
                               keep_persistent=1, replicate_workers=2)
    h1 = ck.save(_state(1), old)
    assert entered.wait(60)
    ck.save(_state(2), new).wait()
    release.set()
    h1.wait()
    assert os.listdir(dest) == ["c2.pt"] and not os.path.exists(ck.local_path(old))
    assert os.path.exists(ck.local_path(new))  # before: c2 was trimmed, as the first one verified
    ck.close()


class BadReadBack(FaultyOps):
    """Reads of the destination's temp file (only the verification reads it) come back with
    one byte flipped, the first ``times`` times: storage that returns other bytes than it was
    given."""

    def __init__(self, target_dir: str, times: int) -> None:
        super().__init__()
        self.target_dir, self.times, self.damaged = target_dir, times, 0

    def preadv(self, fd: int, buf: memoryview, offset: int) -> int:
        n = super().preadv(fd, buf, offset)
        path = self._path_of(fd)
        if path.startswith(self.target_dir) and TMP_TAG in path and n > 0 and self.damaged < self.times:
            buf[0] ^= 0xFF
            self.damaged += 1
        return n


@pytest.mark.parametrize("times", [1, 1 << 30])
def test_posix_read_back_mismatch_copies_again_or_fails_unpublished(tmp_path, times: int) -> None:
    target = str(tmp_path / "t")
    ops = BadReadBack(target, times)
    sink = Waiter("replicate")
    dest = os.path.join(target, "r.pt")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), ops=ops, sinks=(sink,)) as ck:
        h = ck.save(_state(7), dest)
        if times == 1:  # the second copy reads back right: published
            rec = h.wait()
            assert rec.durable_s is not None and _same(torch.load(dest, weights_only=True), 7)
            assert "attempts=2" in next(e.detail for e in sink.events if e.name == "replicate")
        else:
            with pytest.raises(CorruptCheckpointError, match="read back with the wrong checksum"):
                h.wait()
            assert ops.damaged >= 3 and sorted(os.listdir(target)) == []  # nothing published, no temp file
            assert os.path.exists(ck.local_path(dest))


def test_bandwidth_cap_bounds_replication_rate(tmp_path) -> None:
    size = 48 << 20
    cap = 64e6
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), replicate_bandwidth_Bps=cap,
                               chunk_bytes=16 << 20) as ck:
        rec = ck.save({"w": torch.zeros(size, dtype=torch.uint8)}, str(tmp_path / "t" / "big.pt")).wait()
    # the first chunk may pass as a burst; the rest cannot go faster than the cap
    assert rec.durable_s - rec.local_durable_s >= 0.9 * (size - (16 << 20)) / cap


def test_bandwidth_cap_bounds_a_checkpoint_smaller_than_a_chunk(tmp_path) -> None:
    """The cap's burst was a whole chunk (64 MiB): a checkpoint up to that size replicated at full
    speed whatever the cap. Now it is one second's worth: 2 MiB under 1 MB/s passes 1 MB at once,
    and the rest of the copy, then its read-back, are paced by the cap."""
    cap = 1e6
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), replicate_bandwidth_Bps=cap) as ck:
        rec = ck.save({"w": torch.zeros(2 << 20, dtype=torch.uint8)}, str(tmp_path / "t" / "small.pt")).wait()
    assert rec.bytes > 2 << 20
    assert rec.durable_s - rec.local_durable_s >= (2 * rec.bytes - cap) / cap  # copy + read-back, less the burst


def test_an_infinite_bandwidth_cap_is_no_cap(tmp_path) -> None:
    """replicate_bandwidth_Bps=float("inf") (accepted by the config, and no cap before the burst was
    bounded) made Checkpointer() raise OverflowError (int() of infinity): now it replicates uncapped."""
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), replicate_bandwidth_Bps=float("inf")) as ck:
        rec = ck.save(_state(1), str(tmp_path / "t" / "a.pt")).wait(60)
    assert rec.durable_s is not None
    assert fastckpt.load(str(tmp_path / "t" / "a.pt"))["w"].equal(_state(1)["w"])


def test_url_without_local_dir_is_refused(tmp_path) -> None:
    with fastckpt.Checkpointer() as ck, pytest.raises(fastckpt.ConfigError, match="local_dir"):
        ck.save(_state(1), "s3://bucket/x.pt")


# ----------------------------------------------------------------------------- groups in the burst buffer


def test_group_load_after_commit_reads_the_local_copy(tmp_path, caplog) -> None:
    """The burst-buffer copy of a committed group gets the group's manifest, so a load reads it
    (issue #9 item 11); a new attempt at the same group withdraws it until that one commits."""
    group = str(tmp_path / "t" / "global_step3")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), rank=0, world_size=1) as ck:
        ck.save(_state(3), f"{group}/rank0.pt", group=group)
        ck.commit(group, step=3).wait()
        local_group = ck.local_path(group)
        assert os.path.exists(os.path.join(local_group, "fastckpt-manifest.json"))
        with caplog.at_level("WARNING", logger="fastckpt"):
            assert _same(ck.load(f"{group}/rank0.pt"), 3)
        assert ck.stats().last_restore_from == "local"
        assert not [r for r in caplog.records if "unusable" in r.getMessage()]
        ck.save(_state(4), f"{group}/rank0.pt", group=group)  # a new attempt: not complete yet
        assert not os.path.exists(os.path.join(local_group, "fastckpt-manifest.json"))
        ck.commit(group, step=4).wait()
        assert _same(ck.load(f"{group}/rank0.pt"), 4) and ck.stats().last_restore_from == "local"


def test_s3_group_load_after_commit_reads_the_local_copy(s3_server, s3_bucket, tmp_path) -> None:
    opts = s3_server.storage_options()
    group = f"s3://{s3_bucket}/ds/global_step5"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=opts, rank=0, world_size=1) as ck:
        ck.save(_state(5), f"{group}/rank0.pt", group=group)
        ck.commit(group).wait()
        assert _same(ck.load(f"{group}/rank0.pt"), 5)
        assert ck.stats().last_restore_from == "local"


def test_ranks_sharing_a_burst_buffer_trim_it_quietly(tmp_path, caplog) -> None:
    """Two ranks of one node share local_dir; both apply keep_local to the same group directory
    there, and the one that finds it gone says nothing."""
    nvme, root = str(tmp_path / "nvme"), tmp_path / "t"
    cks = [fastckpt.Checkpointer(local_dir=nvme, rank=r, world_size=2, keep_local=1, commit_timeout_s=60)
           for r in range(2)]
    with caplog.at_level("WARNING", logger="fastckpt"):
        for step in range(4):
            group = str(root / f"global_step{step}")
            for r, ck in enumerate(cks):
                ck.save(_state(step), f"{group}/rank{r}.pt", group=group)
            for h in [ck.commit(group) for ck in cks]:
                h.wait()
        for ck in cks:
            ck.close()
    assert not [r for r in caplog.records if "retention" in r.getMessage()], caplog.text
    assert sorted(os.listdir(os.path.join(nvme, str(root).lstrip(os.sep)))) == ["global_step3"]


def test_close_timeout_bounds_close_and_keeps_what_it_gave_up(tmp_path, caplog) -> None:
    """close_timeout_s: close() gives up on a replication held at its start and returns, raising
    the ReplicationError that names what is pending; the replication still queued resolves as
    not replicated (its local copy stays), the running one is not waited for, and an earlier
    failure nobody saw, which that error hides, is logged."""
    import errno
    import time

    from fastckpt.testing import Fault

    ops, local, home = FaultyOps(), str(tmp_path / "nvme"), tmp_path / "home"
    queued = QueueWaiter(str(home / "b.pt"))
    log = str(tmp_path / "events.jsonl")
    ck = fastckpt.Checkpointer(local_dir=local, ops=ops, replicate_workers=1, close_timeout_s=0.5, sinks=(queued,),
                               rank=0, world_size=1, event_log=log)
    gate = ops.gate("preadv", path_contains=local)  # holds the first replication as it starts
    try:
        running = ck.save(_state(1), str(home / "a.pt"))
        assert gate.wait_entered(60)
        waiting = ck.save(_state(2), str(home / "b.pt"))
        assert queued.seen.wait(60)
        ops.inject(Fault("pwrite", errno.EIO, path_contains="bad.pt"))
        bad = ck.save(_state(3), str(home / "bad.pt"))
        with pytest.raises(fastckpt.CheckpointWriteError):
            bad.result(60)  # failed, and still unseen: close() would raise it, if not for the timeout
        outcome: list[BaseException | None] = []

        def close() -> None:
            try:
                ck.close()
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 (checked below)
                outcome.append(exc)

        t0 = time.monotonic()
        closer = threading.Thread(target=close)
        closer.start()
        closer.join(60)
        assert not closer.is_alive()  # returned while the replication is still held
        assert time.monotonic() - t0 < 30
    finally:
        gate.open()
    (err,) = outcome
    assert isinstance(err, ReplicationError) and "still pending after" in str(err)
    assert str(home / "a.pt") in str(err) and str(home / "b.pt") in str(err)
    with pytest.raises(ReplicationError, match="was not replicated: close"):
        waiting.wait(60)
    assert os.path.exists(ck.local_path(str(home / "b.pt"))) and not os.path.exists(home / "b.pt")
    from fastckpt.report import load_run

    run, _ = load_run([log])  # the log says b.pt's replication failed: its replay never holds it pending
    (b,) = [t for t in run.saves() if t.path == str(home / "b.pt")]
    assert b.error is not None and "was not replicated: close() stopped waiting" in b.error
    logged = [r.getMessage() for r in caplog.records if "background failure not raised" in r.getMessage()]
    assert len(logged) == 2 and "bad.pt" in logged[0]  # the failure the timeout hid, then the one it caused:
    assert "close() raised another failure" in logged[1] and "b.pt was not replicated" in logged[1]
    with pytest.raises(ReplicationError, match="its Checkpointer was closed before the copy ended") as stopped:
        running.result(60)  # it ended on its own: close() stopped the I/O under it, and the error says so
    assert "after shutdown" in repr(stopped.value.__cause__)
    assert os.path.exists(ck.local_path(str(home / "a.pt")))


@pytest.mark.parametrize("tag", ["best", "step-2"])
def test_a_group_published_at_home_is_not_reported_failed_for_its_local_manifest(tmp_path, caplog, tag) -> None:
    """The commit's last step writes the group's manifest into the burst-buffer copy. When that
    write failed (EIO), commit() raised CheckpointWriteError ("the previous checkpoint is
    untouched") though the group was published at its home and latest() named it. The home is
    what counts: a WARNING, and loads judge the copy by the home's manifest."""
    import errno

    from fastckpt.testing import Fault

    nvme, home = str(tmp_path / "nvme"), str(tmp_path / "home")
    ops = FaultyOps()
    with fastckpt.Checkpointer(local_dir=nvme, ops=ops, rank=0, world_size=1) as ck:
        for value, group in ((1.0, f"{home}/{'best' if tag == 'best' else 'step-1'}"), (2.0, f"{home}/{tag}")):
            if value == 2.0:
                ops.inject(Fault("write_small", errno.EIO, path_startswith=nvme))  # the local manifest's write
            for name in ("model.pt", "optim.pt"):
                ck.save({"w": torch.full((1000,), value)}, f"{group}/{name}", group=group)
            ck.commit(group).wait(60)
        assert ops.fired, "the fault never fired"
        assert float(ck.load(f"{home}/{tag}/model.pt")["w"][0]) == 2.0  # through the burst-buffer copy
    assert fastckpt.latest(home) == f"{home}/{tag}"
    assert "its burst-buffer copy" in caplog.text and "has no manifest" in caplog.text


def test_a_local_copy_whose_manifest_is_damaged_before_replication_is_a_write_error(tmp_path) -> None:
    """A burst-buffer copy whose manifest was damaged after its local commit (bit rot, another
    tool on the drive) surfaced from save().wait() as CorruptCheckpointError, a ValueError naming
    only the local copy, not as the CheckpointWriteError a failed copy home is."""
    home, local = str(tmp_path / "home" / "x.pt"), None
    armed = threading.Event()

    def damage(op: str, path: str) -> None:  # the replicator's first open of the second save's copy
        if op == "open" and path == local and armed.is_set() and "replic" in threading.current_thread().name:
            armed.clear()
            data = bytearray(open(path, "rb").read())
            data[-30] ^= 0x01  # inside the manifest in the zip comment
            open(path, "wb").write(data)

    with fastckpt.Checkpointer(ops=FaultyOps(on_call=damage), local_dir=str(tmp_path / "nvme")) as ck:
        ck.save({"w": torch.ones(10), "v": 1}, home).wait()
        local = str(tmp_path / "nvme") + home
        armed.set()
        with pytest.raises(fastckpt.CheckpointWriteError, match="has a damaged manifest") as info:
            ck.save({"w": torch.ones(10) * 2, "v": 2}, home).wait()
        assert not armed.is_set() and home in str(info.value)
    assert fastckpt.load(home)["v"] == 1  # the previous checkpoint stands
