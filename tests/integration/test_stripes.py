"""Striped burst buffer: ``local_dir=[dir_a, dir_b]`` (one per drive). Files spread across the
directories by the bytes queued on each, a file saved while one drive is busy goes to the
other, each file is restored from wherever it lives, retention removes copies on every drive,
and ``stats()`` and ``fastckpt doctor`` report each directory's bandwidth. Real files; the busy
drive is a write held at a gate (``FaultyOps.gate``), never a sleep."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

import fastckpt
from fastckpt.doctor import DoctorOptions, diagnose
from fastckpt.errors import CheckpointWriteError, ConfigError
from fastckpt.save.stripes import Stripes
from fastckpt.testing import Fault, FaultyOps
from fastckpt.urls import mirror_path

MiB = 1 << 20


def _state(nbytes: int, seed: int) -> dict:
    return {"w": torch.full((nbytes // 4,), float(seed)), "seed": seed}


def _where(ck: fastckpt.Checkpointer, path: str, dirs: list[str]) -> int:
    local = ck.local_path(path)
    assert local is not None and os.path.exists(local)
    return next(i for i, d in enumerate(dirs) if local.startswith(d + os.sep))


@pytest.fixture
def dirs(tmp_path) -> list[str]:  # noqa: ANN001
    return [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]


def test_a_busy_drive_gets_no_new_file(tmp_path, dirs) -> None:
    ops = FaultyOps()
    home = tmp_path / "home"
    with fastckpt.Checkpointer(local_dir=dirs, ops=ops, staging_buffers=2, rank=0, world_size=1) as ck:
        gate = ops.gate("fsync", path_contains=dirs[0])  # the first drive's first file stays in flight
        big = ck.save(_state(8 * MiB, 1), str(home / "big.pt"))
        assert gate.wait_entered()
        small = [ck.save(_state(MiB, 2 + i), str(home / f"small{i}.pt")) for i in range(2)]
        for h in small:
            h.wait()
        # round-robin alone would have sent small1 to the first drive: its queue decided
        assert [_where(ck, str(home / f"small{i}.pt"), dirs) for i in range(2)] == [1, 1]
        queued = {s.path: s.queued_bytes for s in ck.stats().local_dirs}
        assert queued[dirs[0]] >= 8 * MiB and queued[dirs[1]] == 0
        gate.open()
        big.wait()
        assert _where(ck, str(home / "big.pt"), dirs) == 0
        st = {s.path: s for s in ck.stats().local_dirs}
        assert st[dirs[0]].files == 1 and st[dirs[1]].files == 2
        assert st[dirs[0]].bytes > 8 * MiB and st[dirs[0]].bandwidth_Bps > 0 and st[dirs[1]].bandwidth_Bps > 0
        assert all(s.queued_bytes == 0 for s in st.values())
        for name, seed in (("big.pt", 1), ("small0.pt", 2), ("small1.pt", 3)):
            out = ck.load(str(home / name))
            assert out["seed"] == seed and ck.stats().last_restore_from == "local"


def test_group_files_spread_and_load_from_where_they_live(tmp_path, dirs) -> None:
    group = tmp_path / "home" / "step-1"
    files = [f"shard{i}.pt" for i in range(4)]
    with fastckpt.Checkpointer(local_dir=dirs, rank=0, world_size=1, staging_buffers=1) as ck:
        handles = [ck.save(_state(2 * MiB, i), str(group / f), group=str(group)) for i, f in enumerate(files)]
        ck.commit(str(group), step=1).wait()
        for h in handles:
            h.wait()
        used = {_where(ck, str(group / f), dirs) for f in files}
        assert used == {0, 1}
        for d in dirs:  # each drive's copy of the group is published (issue #9 item 11)
            local_group = os.path.join(d, str(group).lstrip(os.sep))
            assert os.path.exists(os.path.join(local_group, "fastckpt-manifest.json"))
        for i, f in enumerate(files):
            assert ck.load(str(group / f))["seed"] == i
            assert ck.stats().last_restore_from == "local"  # not a fallback to the durable copy
        ck.save(_state(2 * MiB, 9), str(group / files[0]), group=str(group))  # a new attempt
        for d in dirs:  # withdraws every drive's manifest until it commits
            assert not os.path.exists(os.path.join(d, str(group).lstrip(os.sep), "fastckpt-manifest.json"))
        ck.commit(str(group), step=2).wait()
        assert ck.load(str(group / files[0]))["seed"] == 9 and ck.stats().last_restore_from == "local"
    assert fastckpt.latest(str(tmp_path / "home")) == str(group)


def test_same_path_stays_on_its_drive_and_retention_cleans_every_drive(tmp_path, dirs) -> None:
    home = tmp_path / "home"
    with fastckpt.Checkpointer(local_dir=dirs, keep_local=1, rank=0, world_size=1) as ck:
        ck.save(_state(MiB, 0), str(home / "last.pt")).wait()
        first = _where(ck, str(home / "last.pt"), dirs)
        ck.save(_state(MiB, 1), str(home / "last.pt")).wait()
        assert _where(ck, str(home / "last.pt"), dirs) == first  # no stale copy on the other drive
        for i in range(3):
            ck.save(_state(MiB, i), str(home / f"c{i}.pt")).wait()
        kept = [p for d in dirs for _, _, fs in os.walk(d) for p in fs if p.endswith(".pt")]
        assert kept == ["c2.pt"]
        assert ck.load(str(home / "c2.pt"))["seed"] == 2


def test_saves_of_one_path_in_flight_are_written_on_one_drive_in_order(tmp_path, dirs) -> None:
    """Two quick saves of a new path: the second waits behind the first on the first's drive (one
    writer thread, in order), instead of racing it on the other drive, where it could finish
    first and then be replaced at the home by the older save's replication."""
    ops, path = FaultyOps(), str(tmp_path / "home" / "last.pt")
    with fastckpt.Checkpointer(local_dir=dirs, ops=ops, staging_buffers=2, rank=0, world_size=1) as ck:
        # the first drive is slow right now (its files, not the tier's probe of the drive)
        gate = ops.gate("pwrite", path_contains=mirror_path(dirs[0], str(tmp_path / "home")) + os.sep)
        try:
            first = ck.save(_state(MiB, 1), path)
            assert gate.wait_entered()
            second = ck.save(_state(MiB, 2), path)
            queued = {s.path: s.queued_bytes for s in ck.stats().local_dirs}
            assert queued[dirs[1]] == 0 and queued[dirs[0]] >= 2 * MiB
        finally:
            gate.open()
        assert first.wait().superseded or first.wait().durable_s is not None
        assert second.wait().durable_s is not None
        assert fastckpt.load(path)["seed"] == 2 and ck.load(path)["seed"] == 2
        assert [c.startswith(dirs[0] + os.sep) for c in ck._stripes.copies(path)] == [True]


@pytest.mark.parametrize("where", ["dir", "s3"])
def test_a_later_save_written_first_stays_the_newest(tmp_path, dirs, where, request) -> None:  # noqa: ANN001
    """Two paths, the first save's local write slow: the second is written on the other drive and
    is durable first. The file's order was the end of its write, so once the first save was
    durable too, latest() named it (in a directory by the scan; at a URL the pointer moved back,
    and keep_persistent=1 then kept the older one for good: the pointer named it). Now the
    save call orders."""
    if where == "s3":
        s3, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
        home, opts = f"s3://{bucket}/run", s3.storage_options()
    else:
        home, opts = str(tmp_path / "home"), None
    ops = FaultyOps()
    gate = ops.gate("pwrite", path_contains="step-1.pt")
    keep = 1 if where == "s3" else None  # in a directory, keep_persistent=1 deleted the older one: hid it
    with fastckpt.Checkpointer(local_dir=dirs, staging_buffers=2, keep_persistent=keep, ops=ops,
                               storage_options=opts, rank=0, world_size=1) as ck:
        first = ck.save(_state(MiB, 1), f"{home}/step-1.pt")
        try:
            assert gate.wait_entered()
            assert ck.save(_state(MiB, 2), f"{home}/step-2.pt").wait().durable_s is not None
            assert fastckpt.latest(home, storage_options=opts) == f"{home}/step-2.pt"
        finally:
            gate.open()
        first.wait()
    assert fastckpt.latest(home, storage_options=opts) == f"{home}/step-2.pt"  # was step-1
    assert fastckpt.load(f"{home}/step-2.pt", storage_options=opts)["seed"] == 2
    if keep:
        with pytest.raises(FileNotFoundError):  # keep_persistent=1 deleted the older one
            fastckpt.load(f"{home}/step-1.pt", storage_options=opts)


def test_coalescing_keeps_the_newest_save_whatever_drive_finishes_first(s3_server, s3_bucket, dirs) -> None:  # noqa: ANN001
    """replicate_policy='coalesce' drops queued saves older than a newer one. Saves reach the
    queue as their local writes end: the older save, written last, dropped the newer one, and only
    the older reached the home. Now an arriving save older than one queued is dropped itself."""
    opts, url, ops = s3_server.storage_options(), f"s3://{s3_bucket}/run", FaultyOps()
    busy = ops.gate("preadv", path_contains="step-0.pt")  # the one replication worker uploads step-0
    queued = threading.Event()

    class Sink:
        def emit(self, ev) -> None:  # noqa: ANN001
            if ev.name == "queued" and ev.path.endswith("step-2.pt"):
                queued.set()

    with fastckpt.Checkpointer(local_dir=dirs, staging_buffers=2, replicate_workers=1, ops=ops,
                               storage_options=opts, rank=0, world_size=1, sinks=(Sink(),)) as ck:
        h0 = ck.save(_state(MiB, 0), f"{url}/step-0.pt")
        slow = None
        try:
            assert busy.wait_entered()
            slow = ops.gate("pwrite", path_contains="step-1.pt")
            h1 = ck.save(_state(MiB, 1), f"{url}/step-1.pt")
            assert slow.wait_entered()
            h2 = ck.save(_state(MiB, 2), f"{url}/step-2.pt")  # written on the other drive, queued
            assert queued.wait(60)
            slow.open()
            assert h1.wait(timeout=60).superseded  # it arrived after step-2: the older one is dropped
        finally:
            for g in (slow, busy):
                if g is not None:
                    g.open()
        h0.wait()
        r2 = h2.wait()
    assert not r2.superseded and r2.durable_s is not None  # was superseded by step-1
    assert fastckpt.latest(url, storage_options=opts) == f"{url}/step-2.pt"


def test_a_best_group_written_last_is_never_dropped_for_the_series(tmp_path, dirs) -> None:  # noqa: ANN001
    """A group committed with move_latest=False is never coalesced away. Its file, saved before a
    series group's but written last (slow drive), arrives older than the series upload running:
    with the arrival rule for every save, it was superseded before its commit said it is kept."""
    home, ops = str(tmp_path / "home"), FaultyOps()
    best, series = f"{home}/best", f"{home}/step-10"
    queued = {"best": threading.Event(), "step-10": threading.Event()}

    class Sink:
        def emit(self, ev) -> None:  # noqa: ANN001
            for name, seen in queued.items():
                if ev.name == "queued" and f"/{name}/" in ev.path:
                    seen.set()

    slow = ops.gate("pwrite", path_contains="best/model.pt")
    upload = ops.gate("preadv", path_contains="step-10/model.pt")  # the series upload stays running
    with fastckpt.Checkpointer(local_dir=dirs, staging_buffers=2, replicate_workers=1, ops=ops,
                               rank=0, world_size=1, sinks=(Sink(),)) as ck:
        try:
            ck.save(_state(MiB, 1), f"{best}/model.pt", group=best)
            assert slow.wait_entered()
            ck.save(_state(MiB, 2), f"{series}/model.pt", group=series)
            assert queued["step-10"].wait(60) and upload.wait_entered()
            slow.open()  # best's local write ends while the series upload runs
            assert queued["best"].wait(60)  # was superseded on arrival: never queued
        finally:
            slow.open()
            upload.open()
        series_rec, best_rec = ck.commit(series, step=10), ck.commit(best, move_latest=False)
        assert best_rec.wait().durable_s is not None and series_rec.wait().durable_s is not None
    assert fastckpt.load(f"{best}/model.pt")["seed"] == 1 and fastckpt.latest(home) == series


def test_a_drive_that_refused_a_write_gets_no_more_saves_of_a_path_it_holds(tmp_path, dirs) -> None:  # noqa: ANN001
    """A drive that refuses writes (read-only now) leaves the rotation, but a path whose copy was
    on it went on being sent there, failing for good though the other drive was writable."""
    ops, path = FaultyOps(), str(tmp_path / "home" / "last.pt")
    with fastckpt.Checkpointer(local_dir=dirs, ops=ops, rank=0, world_size=1) as ck:
        ck.save(_state(MiB, 1), path).wait()
        held = _where(ck, path, dirs)
        ops.inject(*(Fault("pwrite", errno.EROFS, nth=n, path_startswith=dirs[held]) for n in range(1, 65)))
        with pytest.raises(CheckpointWriteError, match="Read-only"):
            ck.save(_state(MiB, 2), path).wait()  # the drive refuses: it leaves the rotation
        assert ck.save(_state(MiB, 3), path).wait().durable_s is not None  # failed before, again and again
        assert ck.load(path)["seed"] == 3 and fastckpt.load(path)["seed"] == 3
        assert ck.local_path(path).startswith(dirs[1 - held] + os.sep)


def test_a_group_whose_copy_is_on_a_drive_that_refused_writes_is_saved_again_elsewhere(tmp_path, dirs) -> None:  # noqa: ANN001
    """The group's commit still wrote to the refused drive (it clears and publishes the copy's
    manifest in each directory), so every re-save of the group failed there for good."""
    ops, g = FaultyOps(), str(tmp_path / "home" / "step-1")
    with fastckpt.Checkpointer(local_dir=dirs, ops=ops, rank=0, world_size=1) as ck:
        ck.save(_state(MiB, 1), f"{g}/model.pt", group=g)
        assert ck.commit(g, step=1).wait().durable_s is not None
        held = _where(ck, f"{g}/model.pt", dirs)
        ops.inject(*(Fault(op, errno.EROFS, nth=n, path_startswith=dirs[held]) for n in range(1, 65)
                     for op in ("pwrite", "unlink", "write_small", "replace", "makedirs", "link", "exchange", "rmdir")))
        with pytest.raises(CheckpointWriteError):  # the drive refuses: it leaves the rotation
            ck.save(_state(MiB, 2), f"{g}/model.pt", group=g).wait()
            ck.commit(g, step=1).wait()
        ck.save(_state(MiB, 3), f"{g}/model.pt", group=g)
        assert ck.commit(g, step=1).wait().durable_s is not None  # failed: a delete on the refused drive
        assert fastckpt.load(f"{g}/model.pt")["seed"] == 3 and ck.load(f"{g}/model.pt")["seed"] == 3


def test_a_directory_that_cannot_be_made_leaves_groups_to_the_others(tmp_path, caplog) -> None:  # noqa: ANN001
    """local_dir=[good, below a file]: the second is left out with a warning, but every group save
    failed at once (the commit cleared a stale manifest in each directory: ENOTDIR)."""
    (tmp_path / "afile").write_bytes(b"x")
    good, bad, g = str(tmp_path / "nvme0"), str(tmp_path / "afile" / "nvme1"), str(tmp_path / "home" / "step-1")
    with fastckpt.Checkpointer(local_dir=[good, bad], rank=0, world_size=1) as ck:
        assert "cannot be used" in caplog.text
        ck.save(_state(MiB, 1), f"{g}/model.pt", group=g)
        ck.save(_state(MiB, 2), f"{g}/optim.pt", group=g)
        assert ck.commit(g, step=1).wait().durable_s is not None
    assert fastckpt.latest(str(tmp_path / "home")) == g and fastckpt.load(f"{g}/optim.pt")["seed"] == 2


def test_a_path_in_flight_keeps_its_drive(dirs) -> None:
    stripes = Stripes(tuple(dirs), rank=1)  # round-robin alone would start on the second drive
    direct = stripes.choose("/x/last.pt", 1 << 62, may_bypass=True)  # no room anywhere: straight to its path
    assert direct is not None and direct.local is None and direct.index == 0
    again = stripes.choose("/x/last.pt", 10, may_bypass=True)  # while it is written: its writer, no bypass
    assert again is not None and again.index == 0 and again.local is not None
    third = stripes.choose("/x/last.pt", 10)
    assert third is not None and third.index == 0
    for r in (direct, again, third, third):
        stripes.release(r)
    assert stripes.choose("/x/last.pt", 10).index == 1  # nothing in flight and no copy: free to move


def test_ranks_start_on_different_drives(dirs) -> None:
    a, b = Stripes(tuple(dirs), rank=0), Stripes(tuple(dirs), rank=1)
    assert a.choose("/x/r0.pt", 10).root != b.choose("/x/r1.pt", 10).root


@pytest.mark.parametrize("bad", [[], ["/a", "/a/"], ["s3://b/x"], ["/a", 3]])
def test_bad_local_dirs_are_refused(bad) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match="local_dir"):
        fastckpt.Checkpointer(local_dir=bad)


def test_doctor_measures_each_drive(tmp_path, dirs) -> None:
    dx = diagnose(DoctorOptions(local_dir=tuple(dirs), target=str(tmp_path / "home"), probe_bytes=8 * MiB,
                                progress="off"))
    bw = {f.check: f for f in dx.findings if f.check.endswith(".bandwidth")}
    assert set(bw) == {"local_dir[0].bandwidth", "local_dir[1].bandwidth"}
    assert dx.auto["cpu"] == "nvme"


def test_doctor_cli_takes_local_dir_twice(tmp_path) -> None:
    import json
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "fastckpt.cli", "doctor", "--local-dir", str(tmp_path / "a"),
                          "--local-dir", str(tmp_path / "b"), "--target", str(tmp_path / "home"), "--probe-size",
                          "8MiB", "--json"], capture_output=True, text=True)
    out = json.loads(res.stdout)
    checks = {f["check"] for f in out["findings"]}
    assert {"local_dir[0].bandwidth", "local_dir[1].bandwidth", "local_dir[0].writable"} <= checks
    assert out["auto"]["cpu"] == "nvme"
