"""A burst buffer without room for a single file: the file goes straight to its path (same
stall, durable at the path's speed), a warning says so once, and saves go through the burst
buffer again once it has room. So does a file the drive runs out of room for mid-write. A stale
burst-buffer copy of an earlier save is removed; an earlier save of the same path still
replicating keeps the new one in the burst buffer.

A real 4 MiB tmpfs is the burst buffer, where this process may mount (root).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.io.atomic import TMP_TAG
from fastckpt.testing import FaultyOps
from fastckpt.urls import mirror_path
from tests.helpers import WriteDetails, tmp_files, tmpfs

MiB = 1 << 20
NO_ROOM = "has no room for"


def _state(v: int, mib: float = 1) -> dict:
    return {"w": torch.full((int(mib * MiB) // 4,), float(v)), "v": v}


def _local(local: Path, path: Path) -> Path:
    return Path(mirror_path(str(local), str(path)))


def test_single_files_skip_a_full_burst_buffer_and_return_once_it_has_room(tmp_path: Path, caplog) -> None:
    home = tmp_path / "home"
    caplog.set_level(logging.INFO, logger="fastckpt")
    with tmpfs(tmp_path / "nvme", "size=4m") as local, fastckpt.Checkpointer(local_dir=str(local)) as ck:
        recs = [ck.save(_state(v), str(home / f"step{v}.pt")).wait() for v in range(1, 7)]
        through = [r.tier for r in recs]
        assert through[0] == "nvme" and through[-1] == "direct", through
        skipped = [r for r in recs if r.tier == "direct"]
        assert all(r.local_durable_s is None and r.durable_s > 0 for r in skipped)
        assert [_local(local, Path(r.path)).exists() for r in recs] == [r.tier == "nvme" for r in recs]
        for v, r in enumerate(recs, 1):
            assert fastckpt.load(r.path)["v"] == v
        assert fastckpt.latest(str(home)) == str(home / "step6.pt")
        assert caplog.text.count(NO_ROOM) == 1, caplog.text  # once, when saves start skipping it
        first_skipped = home / f"step{through.index('direct') + 1}.pt"
        assert f"the burst buffer ({local}) has no room for {first_skipped} (" in caplog.text
        assert "keep_local=N" in caplog.text
        for r in recs:  # room again
            if r.tier == "nvme":
                os.unlink(_local(local, Path(r.path)))
        again = ck.save(_state(7), str(home / "step7.pt")).wait()
        assert again.tier == "nvme" and _local(local, home / "step7.pt").exists()
        assert "has room again" in caplog.text
        assert ck.load(str(home / "step7.pt"))["v"] == 7
    assert tmp_files(home, local) == []


def test_a_burst_buffer_whose_file_system_reports_no_size_takes_single_files(tmp_path: Path, caplog) -> None:
    """statvfs of ramfs (and of some FUSE mounts) says f_blocks == 0: size unknown (``df`` shows
    0/0), not full. Every single file skipped such a burst buffer, with the no-room WARNING."""
    home = tmp_path / "home"
    with tmpfs(tmp_path / "nvme", "defaults", fstype="ramfs") as local:
        assert os.statvfs(local).f_blocks == 0
        with caplog.at_level(logging.WARNING, logger="fastckpt"), fastckpt.Checkpointer(local_dir=str(local)) as ck:
            rec = ck.save(_state(1), str(home / "a.pt")).wait()
            assert rec.tier == "nvme" and rec.local_durable_s is not None
            assert _local(local, home / "a.pt").exists()
        assert NO_ROOM not in caplog.text
        assert fastckpt.load(str(home / "a.pt"))["v"] == 1


def test_a_stale_burst_buffer_copy_goes_when_its_path_skips_the_burst_buffer(tmp_path: Path) -> None:
    home, path = tmp_path / "home", tmp_path / "home" / "last.pt"
    with tmpfs(tmp_path / "nvme", "size=4m") as local, fastckpt.Checkpointer(local_dir=str(local)) as ck:
        assert ck.save(_state(1, mib=0.5), str(path)).wait().tier == "nvme"
        assert _local(local, path).exists()
        (local / "filler").write_bytes(b"\0" * (2 * MiB))  # another job's scratch data
        rec = ck.save(_state(2), str(path)).wait()  # 1 MiB, plus the margin: no room beside the old copy
        assert rec.tier == "direct" and not _local(local, path).exists()
        assert ck.load(str(path))["v"] == 2 and fastckpt.load(str(path))["v"] == 2
    assert tmp_files(home, local) == []


def test_a_path_still_replicating_keeps_its_next_save_in_the_burst_buffer(tmp_path: Path) -> None:
    """The earlier save's copy to the path could land after a direct write of the new one, so
    the new save stays in the burst buffer although it looks full (here the file still fits
    in the margin kept free), and the path ends up holding the newer save."""
    home, path = tmp_path / "home", tmp_path / "home" / "last.pt"
    entered, second_written, release = threading.Event(), threading.Event(), threading.Event()

    def hold(op: str, p: str) -> None:
        if op == "fsync_dir" and entered.is_set():  # after its rename: the second save is written
            second_written.set()
        if op == "replace" and p.startswith(f"{home}{os.sep}") and not entered.is_set():
            entered.set()  # the first save's replication, about to rename its copy into place
            assert release.wait(60)

    ops = FaultyOps(on_call=hold)
    with tmpfs(tmp_path / "nvme", "size=4m") as local, fastckpt.Checkpointer(local_dir=str(local), ops=ops) as ck:
        first = ck.save(_state(1, mib=0.5), str(path))
        assert entered.wait(30)
        (local / "filler").write_bytes(b"\0" * (2 * MiB))
        second = ck.save(_state(2), str(path))
        assert second_written.wait(30)  # (in the burst buffer; straight to the path, it would be the newest there)
        release.set()
        assert first.wait().tier == "nvme" and second.wait().tier == "nvme"
        assert ck.load(str(path))["v"] == 2 and fastckpt.load(str(path))["v"] == 2
    assert tmp_files(home, local) == []


def test_a_group_file_never_skips_the_burst_buffer(tmp_path: Path) -> None:
    """A group's files are committed together from the burst buffer: a full one fails the save,
    naming it (tests/unit/test_full_drive.py fills one up with groups)."""
    group = tmp_path / "home" / "step1"
    with tmpfs(tmp_path / "nvme", "size=4m") as local, fastckpt.Checkpointer(local_dir=str(local)) as ck:
        with pytest.raises(fastckpt.CheckpointWriteError) as ei:
            ck.save(_state(1, mib=5), str(group / "model.pt"), group=str(group)).wait()
        assert f"in the burst buffer {local}" in str(ei.value)


def test_striped_files_pass_over_the_drive_without_room(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with tmpfs(tmp_path / "nvme0", "size=4m") as small:
        (small / "filler").write_bytes(b"\0" * (3 * MiB))
        roomy = tmp_path / "nvme1"
        with fastckpt.Checkpointer(local_dir=[str(small), str(roomy)]) as ck:
            for v in range(1, 4):  # round-robin would put one of them on nvme0
                group = home / f"step{v}"
                ck.save(_state(v), str(group / "model.pt"), group=str(group))
                ck.commit(str(group)).wait()
                assert ck.local_path(str(group / "model.pt")).startswith(f"{roomy}{os.sep}")
            rec = ck.save(_state(4), str(home / "last.pt")).wait()
            assert rec.tier == "nvme" and _local(roomy, home / "last.pt").exists()
            for v in range(1, 4):
                assert ck.load(str(home / f"step{v}" / "model.pt"))["v"] == v


@pytest.mark.parametrize("grouped", [True, False], ids=["group-tag", "single-file"])
def test_a_path_whose_drive_filled_up_moves_to_a_drive_with_room(tmp_path: Path, caplog, grouped: bool) -> None:
    """A re-saved group tag (or single file) stayed on the drive holding its earlier copy: once
    another job filled that drive, every later save of it failed with ENOSPC (a single file
    skipped the burst buffer) while the other drive had room. It moves, and its old copy goes."""
    home = tmp_path / "home"
    group = home / "last"
    path = group / "model.pt" if grouped else home / "last.pt"

    def save(ck: fastckpt.Checkpointer, v: int) -> str:
        if not grouped:
            return ck.save(_state(v), str(path)).wait().tier
        ck.save(_state(v), str(path), group=str(group))
        ck.commit(str(group), step=v).wait()
        return "nvme"

    with tmpfs(tmp_path / "nvme0", "size=8m") as small:
        roomy = tmp_path / "nvme1"
        with caplog.at_level(logging.INFO, logger="fastckpt"), \
                fastckpt.Checkpointer(local_dir=[str(small), str(roomy)], rank=0, world_size=1) as ck:
            assert save(ck, 0) == "nvme" and ck.local_path(str(path)) == str(_local(small, path))
            (small / "other-job-data").write_bytes(b"x" * (13 * MiB // 2))  # leaves under 1 MiB free
            for v in (1, 2):  # moved, then saved again where it now is
                assert save(ck, v) == "nvme"
                assert ck.local_path(str(path)) == str(_local(roomy, path)) and not _local(small, path).exists()
                assert ck.load(str(path))["v"] == v and fastckpt.load(str(path))["v"] == v
        assert caplog.text.count("it moves to") == 1, caplog.text
        moved = next(r.getMessage() for r in caplog.records if "it moves to" in r.getMessage())
        assert f"burst-buffer directory {small} is too full for {path} (" in moved and f"moves to {roomy}," in moved
        assert NO_ROOM not in caplog.text
        assert tmp_files(home, small, roomy) == []


def test_a_read_only_drive_leaves_the_rotation_after_its_first_refusal(tmp_path: Path, caplog) -> None:
    """A striped drive that takes no writes (remounted read-only) failed every other save; now
    the first failure takes it out of the rotation, and that error does not claim a previous
    checkpoint is untouched when there was none."""
    home = tmp_path / "home"
    with tmpfs(tmp_path / "nvme0", "size=4m,ro") as ro:
        good = tmp_path / "nvme1"
        failed = []
        with caplog.at_level(logging.WARNING, logger="fastckpt"), \
                fastckpt.Checkpointer(local_dir=[str(ro), str(good)]) as ck:
            for v in range(1, 6):
                try:
                    ck.save(_state(v, 0.1), str(home / f"step-{v}.pt")).wait()
                except fastckpt.CheckpointWriteError as exc:
                    failed.append(str(exc))
        assert len(failed) <= 1  # the first save on the read-only drive, at most
        assert all("nothing was there before" in m and "untouched" not in m for m in failed)
        if failed:
            assert any("refused a write" in r.getMessage() and str(ro) in r.getMessage() for r in caplog.records)
        assert [fastckpt.load(str(home / f"step-{v}.pt"))["v"] for v in range(len(failed) + 1, 6)] == list(
            range(len(failed) + 1, 6))


def test_a_burst_buffer_another_writer_fills_mid_write_sends_the_file_to_its_path(tmp_path: Path, caplog) -> None:
    """The room check passes, then another job fills the drive before the first byte lands:
    the write fails for real (ENOSPC) and the file is written straight to its path."""
    path = tmp_path / "home" / "last.pt"
    ops = FaultyOps()
    with tmpfs(tmp_path / "nvme", "size=4m") as local, fastckpt.Checkpointer(local_dir=str(local), ops=ops) as ck:
        gate = ops.gate("pwrite", path_contains=TMP_TAG)  # the file's first write, after the check
        handle = ck.save(_state(1, mib=2), str(path))
        assert gate.wait_entered()
        fd = os.open(local / "filler", os.O_WRONLY | os.O_CREAT)
        with pytest.raises(OSError) as full:
            while os.write(fd, b"\0" * MiB):
                pass
        os.close(fd)
        assert full.value.errno == errno.ENOSPC
        gate.open()
        rec = handle.wait()
        assert rec.tier == "direct" and rec.local_durable_s is None and rec.durable_s > 0
        assert ck.load(str(path))["v"] == 1 and fastckpt.load(str(path))["v"] == 1
        assert not _local(local, path).exists()
        assert "ran out of space while writing" in caplog.text
        assert tmp_files(path.parent, local) == []


@pytest.mark.parametrize("when", ["full-at-the-call", "fills-mid-write"])
def test_a_file_sent_to_a_path_that_refuses_o_direct_names_the_refusal(tmp_path: Path, when: str) -> None:
    """A file that skips the burst buffer (no room at the call, or ENOSPC mid-write) is written
    buffered to a path whose file system refuses O_DIRECT (ramfs): its record and write event said
    "O_DIRECT disabled", as if odirect=False had been given, not the probe's refusal."""
    ops, writes = FaultyOps(), WriteDetails()
    with tmpfs(tmp_path / "nvme", "size=4m") as local, tmpfs(tmp_path / "home", "defaults", fstype="ramfs") as home, \
            fastckpt.Checkpointer(local_dir=str(local), ops=ops, sinks=[writes]) as ck:
        if when == "full-at-the-call":
            rec = ck.save(_state(1, mib=5), str(home / "last.pt")).wait()
        else:
            gate = ops.gate("pwrite", path_contains=TMP_TAG)
            handle = ck.save(_state(1, mib=2), str(home / "last.pt"))
            assert gate.wait_entered()
            (local / "filler").write_bytes(b"\0" * (3 * MiB))  # leaves under 1 MiB for the 2 MiB file
            gate.open()
            rec = handle.wait()
        refused = f"filesystem at {home} refused O_DIRECT"
        assert (rec.tier, rec.odirect, rec.odirect_reason) == ("direct", False, refused)
        assert writes.details[-1] == f"buffered: {refused}"
        assert fastckpt.load(str(home / "last.pt"))["v"] == 1
