"""One burst buffer (``local_dir``) shared by jobs whose homes are the same bucket and key on two S3
stores: each job's local copy has its own place (``urls.mirror_path`` takes the store's endpoint), so
neither replaces the other's, and no save is taken for superseded by another job's. The event-log
readers (``report``, ``plan --from-run``) still tie a copy placed so to its home's save."""

from __future__ import annotations

import datetime
import json
import os
import threading

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

import fastckpt
from fastckpt.cli import cli
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


def test_report_counts_the_bytes_of_a_save_to_a_store_at_an_endpoint(s3_server: S3Server, s3_bucket: str,
                                                                      tmp_path) -> None:
    """The copy's write and commit events name ``local_dir/s3@<tag>/bucket/...``; report tied them to
    the save by the suffix ``s3/bucket/...`` alone, so it dropped both phases: '0 B committed'."""
    log = str(tmp_path / "events.jsonl")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nv"), storage_options=s3_server.storage_options(),
                               event_log=log, overhead_budget=0.99) as ck:
        ck.save({"w": torch.ones(1024)}, f"s3://{s3_bucket}/run/a.pt").wait()
    commit = next(e for e in map(json.loads, open(log)) if e["name"] == "commit")
    assert "@" in commit["path"]  # the copy's place names its store
    r = CliRunner().invoke(cli, ["report", "--json", log])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["bytes"] == commit["bytes"] > 0


def test_plan_estimates_the_ranks_of_a_group_job_saving_to_a_store_at_an_endpoint(s3_server: S3Server,
                                                                                   s3_bucket: str, tmp_path) -> None:
    """One rank's log of a 4-rank job: plan finds each group's share by tying the burst-buffer copies'
    writes to the group; with the store's tag in their path none was found, and plan said 1 GPU."""
    n = 4
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    logs = [str(tmp_path / f"r{r}.jsonl") for r in range(n)]
    cks = [fastckpt.Checkpointer(local_dir=str(tmp_path / "nv"), rank=r, world_size=n, store=store,
                                 storage_options=s3_server.storage_options(), event_log=logs[r],
                                 overhead_budget=0.99) for r in range(n)]
    try:
        for step in (1, 2):
            tag = f"s3://{s3_bucket}/run/global_step{step}"
            for ck in cks:
                ck.save({"w": torch.full((4096,), float(ck.rank))}, f"{tag}/mp_rank_{ck.rank:02d}.pt", group=tag)
            for h in [ck.commit(tag, step=step) for ck in cks]:
                h.wait(60)
    finally:
        for ck in cks:
            ck.close()
    r = CliRunner().invoke(cli, ["plan", "--from-run", logs[0], "--state-size", "1TB", "--json"])
    d = json.loads(r.stdout)
    assert d["gpus"] == n and d["measured"]["logged_share"] == pytest.approx(1 / n, abs=0.03), r.output


def test_a_restart_that_spells_the_endpoint_another_way_finds_the_earlier_runs_copies(
        s3_server: S3Server, s3_bucket: str, tmp_path) -> None:
    """Run 2 writes the endpoint ``HTTP://...`` (schemes are case-insensitive): its place was another,
    so it missed run 1's copies, and its ``keep_local`` restart scan never trimmed them."""
    nv, a, b = str(tmp_path / "nvme"), f"s3://{s3_bucket}/run/step-1.pt", f"s3://{s3_bucket}/run/step-2.pt"
    with fastckpt.Checkpointer(local_dir=nv, storage_options=s3_server.storage_options()) as ck1:
        ck1.save({"w": torch.ones(1024), "step": 1}, a).wait()
        first = ck1.local_path(a)
    other = s3_server.storage_options(endpoint_url=s3_server.endpoint_url.replace("http://", "HTTP://", 1) + "/")
    with fastckpt.Checkpointer(local_dir=nv, storage_options=other, keep_local=1) as ck2:
        assert ck2.local_path(a) == first and ck2.load(a)["step"] == 1
        ck2.save({"w": torch.ones(1024), "step": 2}, b).wait()
    assert not os.path.exists(first)  # run 1's copy, replicated, trimmed by run 2's keep_local=1


def test_an_upload_close_gave_up_on_never_lands_over_a_newer_save(s3_server: S3Server, tmp_path) -> None:
    """At an s3:// URL the check comes before the object becomes visible (``Expected.publishing``): the
    upload close() gave up on, held while it reads its local copy, is aborted; the newer save, made by
    a Checkpointer of the process with another burst buffer (the old local copy stays as it was), stays."""
    from fastckpt.testing import FaultyOps

    url, nv, opts = f"s3://{s3_server.make_bucket()}/run/last.pt", str(tmp_path / "nvme"), s3_server.storage_options()
    entered, release = threading.Event(), threading.Event()

    def hold(op: str, path: str) -> None:  # the first upload's first read of its local copy waits
        if op == "preadv" and threading.current_thread().name.startswith(("fastckpt-replicate", "fastckpt-put")) \
                and not entered.is_set():
            entered.set()
            assert release.wait(60)

    ck1 = fastckpt.Checkpointer(local_dir=nv, storage_options=opts, ops=FaultyOps(on_call=hold), close_timeout_s=0.5)
    try:
        old = ck1.save({"w": torch.ones(1000), "v": 1}, url)
        assert entered.wait(60)
        with pytest.raises(fastckpt.errors.ReplicationError, match="still pending"):
            ck1.close()
        with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme2"), storage_options=opts) as ck2:
            ck2.save({"w": torch.ones(10), "v": 2}, url).wait()
            release.set()
            with pytest.raises(fastckpt.errors.ReplicationError, match="its Checkpointer was closed before the copy"):
                old.wait(60)
    finally:
        release.set()
    assert fastckpt.load(url, storage_options=opts)["v"] == 2
