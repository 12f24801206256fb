"""A full or unwritable drive: the error names the drive that failed (the target, or the burst
buffer the file is written to first) and the fix, and the previous checkpoint stays loadable.

FaultyOps picks the failing call; where this process may mount (root), a real 4 MiB tmpfs
fills up for real.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.eventlog import read_events
from fastckpt.io.atomic import PROBE_TAG
from fastckpt.testing import Fault, FaultyOps
from tests.helpers import tmp_files, tmpfs

MiB = 1 << 20


def _state(v: int, mib: float = 0.01) -> dict:
    return {"w": torch.full((int(mib * MiB) // 4,), float(v)), "v": v}


def test_full_target_names_its_directory_and_the_fix(tmp_path: Path) -> None:
    ops = FaultyOps()
    with fastckpt.Checkpointer(ops=ops) as ck:
        ck.save(_state(1), str(tmp_path / "a.pt")).wait()
        ops.inject(Fault("pwrite", errno.ENOSPC, path_contains="b.pt"))
        with pytest.raises(fastckpt.CheckpointWriteError) as ei:
            ck.save(_state(2), str(tmp_path / "b.pt")).wait()
    ops.assert_all_reached()
    msg = str(ei.value)
    assert ei.value.errno == errno.ENOSPC
    assert msg.count("No space left on device") == 1 and f") in {tmp_path}: free space there" in msg
    assert "keep_persistent=N" in msg and "nothing was there before" in msg  # b.pt was never saved
    assert "burst buffer" not in msg
    assert fastckpt.load(str(tmp_path / "a.pt"))["v"] == 1
    assert fastckpt.latest(str(tmp_path)) == str(tmp_path / "a.pt")
    assert tmp_files(tmp_path) == []


def test_full_burst_buffer_is_named_not_the_target(tmp_path: Path) -> None:
    """A group's file (which commits from the burst buffer) fails there, naming it."""
    home, local = tmp_path / "home", tmp_path / "nvme"
    group = home / "step-2"
    ops = FaultyOps()
    with fastckpt.Checkpointer(local_dir=str(local), ops=ops) as ck:
        ck.save(_state(1), str(home / "a.pt")).wait()
        ops.inject(Fault("pwrite", errno.ENOSPC, path_startswith=str(local)))
        with pytest.raises(fastckpt.CheckpointWriteError) as ei:
            ck.save(_state(2), str(group / "b.pt"), group=str(group)).wait()
    ops.assert_all_reached()
    msg = str(ei.value)
    assert ei.value.errno == errno.ENOSPC
    assert f"saving {group / 'b.pt'} failed: No space left on device" in msg
    assert f"in the burst buffer {local}{group}" in msg  # the copy's directory there
    assert "keep_local=N" in msg and "point local_dir at a larger drive" in msg
    assert "keep_persistent" not in msg
    assert fastckpt.load(str(home / "a.pt"))["v"] == 1
    assert not (group / "b.pt").exists()
    assert tmp_files(home, local) == []


def test_a_single_file_the_burst_buffer_runs_out_of_room_for_mid_write_goes_to_its_path(tmp_path: Path,
                                                                                       caplog) -> None:
    """The room check passed (another writer filled the drive since): the file is written
    straight to its path, as when the check finds no room, and it says so."""
    home, local, log = tmp_path / "home", tmp_path / "nvme", tmp_path / "events.jsonl"
    ops = FaultyOps()
    with fastckpt.Checkpointer(local_dir=str(local), ops=ops, event_log=str(log)) as ck:
        assert ck.save(_state(1), str(home / "b.pt")).wait().tier == "nvme"
        ops.inject(Fault("pwrite", errno.ENOSPC, path_startswith=str(local)))
        rec = ck.save(_state(2), str(home / "b.pt")).wait()
        ops.assert_all_reached()
        assert rec.tier == "direct" and rec.durable_s > 0 and rec.local_durable_s is None
        assert ck.load(str(home / "b.pt"))["v"] == 2
        assert ck.save(_state(3), str(home / "b.pt")).wait().tier == "nvme"  # room again: the burst buffer
    assert fastckpt.load(str(home / "b.pt"))["v"] == 3
    assert f"the burst buffer ran out of space while writing {home / 'b.pt'}" in caplog.text
    assert "keep_local=N" in caplog.text
    assert tmp_files(home, local) == []
    events = read_events(str(log))  # a save that went on, not a failure (metrics, report, drill)
    assert [e for e in events if e.error] == []
    assert [(e.name, e.tier) for e in events if e.path == str(home / "b.pt") and e.name in ("write", "commit")] == [
        ("write", "direct"), ("commit", "direct")]


def test_burst_buffer_probe_and_other_errors_name_the_burst_buffer(tmp_path: Path) -> None:
    home, local = tmp_path / "home", tmp_path / "nvme"
    ops = FaultyOps([Fault("pwrite", errno.ENOSPC, path_contains=PROBE_TAG)])
    with fastckpt.Checkpointer(local_dir=str(local), ops=ops) as ck:
        with pytest.raises(fastckpt.CheckpointWriteError) as ei:
            ck.save(_state(1), str(home / "a.pt"))  # the tier probe runs at the call
        assert f"in the burst buffer {local} (the file's local copy is written there first)" in str(ei.value)
        ck.save(_state(1), str(home / "a.pt")).wait()  # probes again, and works
        ops.inject(Fault("open", errno.EACCES, path_startswith=str(local)))
        with pytest.raises(fastckpt.CheckpointWriteError) as ei:
            ck.save(_state(2), str(home / "b.pt")).wait()
    ops.assert_all_reached()
    assert ei.value.errno == errno.EACCES
    assert f"(writing its burst-buffer copy in {local}{home})" in str(ei.value)
    assert fastckpt.load(str(home / "a.pt"))["v"] == 1
    assert tmp_files(home, local) == []


def _fill(ck: fastckpt.Checkpointer, root: Path, first: int, groups: bool = False
          ) -> tuple[list[Path], fastckpt.CheckpointWriteError]:
    """Save 1 MiB files into ``root`` (each as a one-file group: ``groups``) until one fails;
    (the saved ones, the error)."""
    saved: list[Path] = []
    for v in range(first, first + 8):
        path = root / (f"step{v}/model.pt" if groups else f"step{v}.pt")
        try:
            if groups:
                ck.save(_state(v, mib=1), str(path), group=str(path.parent))
                ck.commit(str(path.parent)).wait()
            else:
                ck.save(_state(v, mib=1), str(path)).wait()
        except fastckpt.CheckpointWriteError as exc:
            return saved, exc
        saved.append(path)
    raise AssertionError(f"8 MiB fit on a 4 MiB tmpfs: {saved}")


@pytest.mark.parametrize("full", ["target", "burst buffer"])
def test_a_really_full_drive_keeps_every_checkpoint_and_recovers_once_freed(tmp_path: Path, full: str) -> None:
    """A full target, or a full burst buffer under a group's files (a single file skips a full
    burst buffer: tests/unit/test_full_burst_buffer.py)."""
    with tmpfs(tmp_path / "small", "size=4m") as small:
        home, local = (small, None) if full == "target" else (tmp_path / "home", small)
        groups = local is not None
        with fastckpt.Checkpointer(local_dir=str(local) if local else None) as ck:
            saved, err = _fill(ck, home, 1, groups)
            assert err.errno == errno.ENOSPC and len(saved) >= 2
            where = f"in the burst buffer {small}" if local else f"in {small}: free space there"
            assert where in str(err)
            failed = home / (f"step{len(saved) + 1}/model.pt" if groups else f"step{len(saved) + 1}.pt")
            assert not failed.exists()
            assert tmp_files(home, small) == []  # the failed file's blocks are freed
            for v, path in enumerate(saved, 1):
                assert fastckpt.load(str(path))["v"] == v
            assert fastckpt.latest(str(home)) == str(saved[-1].parent if groups else saved[-1])
            for path in saved[:2]:  # free space: the oldest two go
                if groups:  # its burst-buffer copy fills the small drive
                    shutil.rmtree(local / str(path.parent).lstrip(os.sep))
                    shutil.rmtree(path.parent)
                else:
                    os.unlink(path)
            again, _ = _fill(ck, home, len(saved) + 1, groups)
            assert len(again) >= 1
        assert fastckpt.load(str(again[0]))["v"] == len(saved) + 1
        assert tmp_files(home, small) == []


def test_a_read_only_home_names_the_remount_fix(tmp_path: Path) -> None:
    """A save straight to a read-only mount said "Read-only file system; nothing was there
    before": no fix, while the same home behind a burst buffer named the remount."""
    with tmpfs(tmp_path / "home", "size=4m,ro") as home, fastckpt.Checkpointer() as ck:
        with pytest.raises(fastckpt.CheckpointWriteError) as ei:
            ck.save(_state(1), str(home / "run" / "a.pt")).wait()
    assert ei.value.errno == errno.EROFS
    assert (f"saving {home / 'run' / 'a.pt'} failed: Read-only file system in {home / 'run'}: the file system is "
            "mounted read-only: remount it read-write or choose another target; nothing was there before") \
        in str(ei.value)


def test_a_burst_buffer_copy_to_a_read_only_home_names_the_fix_and_no_temp_file(tmp_path: Path, caplog) -> None:
    """The copy from the burst buffer into a read-only home's existing directory named the remount,
    after a WARNING `could not remove temp file ...: [Errno 30] Read-only file system`: a read-only
    mount answers EROFS to the unlink of a name that was never created."""
    with tmpfs(tmp_path / "home", "size=4m,ro") as home, caplog.at_level("WARNING", logger="fastckpt"), \
            fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        with pytest.raises(fastckpt.ReplicationError) as ei:
            ck.save(_state(1), str(home / "a.pt")).wait()
    assert ei.value.errno == errno.EROFS
    assert f"to {home / 'a.pt'}: Read-only file system ({home}); the file system is mounted read-only: remount it " \
           "read-write or choose another target" in str(ei.value)
    assert "temp file" not in caplog.text, caplog.text


@pytest.mark.parametrize(("code", "fix"), [(errno.EACCES, "fix the directory's owner/mode"),
                                           (errno.EPERM, "chattr -i / chattr -a clears it"),
                                           (errno.EIO, "check the mount (dmesg)")])
def test_a_home_that_refuses_the_write_names_the_fix(tmp_path: Path, code: int, fix: str) -> None:
    """Root ignores mode bits and no real drive fails on cue: FaultyOps refuses the file's open."""
    ops = FaultyOps()
    with fastckpt.Checkpointer(ops=ops) as ck:
        ck.save(_state(1), str(tmp_path / "a.pt")).wait()
        ops.inject(Fault("open", code, path_contains="b.pt"))
        with pytest.raises(fastckpt.CheckpointWriteError) as ei:
            ck.save(_state(2), str(tmp_path / "b.pt")).wait()
    ops.assert_all_reached()
    assert ei.value.errno == code
    msg = str(ei.value)
    assert f"saving {tmp_path / 'b.pt'} failed: {os.strerror(code)} (injected" in msg
    assert f") in {tmp_path}: " in msg and fix in msg and "nothing was there before" in msg
    assert fastckpt.load(str(tmp_path / "a.pt"))["v"] == 1 and tmp_files(tmp_path) == []


def test_a_read_only_local_dir_names_the_remount_not_permissions(tmp_path: Path, caplog) -> None:
    """Stripes turned every failed access(W_OK) into EACCES "no permission to write there",
    sending the user to fix permissions of a drive that was mounted read-only."""
    with tmpfs(tmp_path / "nvme", "size=4m,ro") as ro:
        with pytest.raises(fastckpt.ConfigError) as ei:
            fastckpt.Checkpointer(local_dir=str(ro))
        assert f"local_dir {ro} cannot hold checkpoints: [Errno 30] Read-only file system: '{ro}' (its drive is " \
               "mounted read-only: remount it read-write, mount -o remount,rw). Point local_dir at" in str(ei.value)
        assert "permission" not in str(ei.value)
        with caplog.at_level("WARNING", logger="fastckpt"), \
                fastckpt.Checkpointer(local_dir=[str(ro), str(tmp_path / "nvme1")]) as ck:
            ck.save(_state(1), str(tmp_path / "home" / "a.pt")).wait()
        assert f"{ro} cannot be used ([Errno 30] Read-only file system: '{ro}' (its drive is mounted read-only: " \
               "remount it read-write, mount -o remount,rw))" in caplog.text
    assert fastckpt.load(str(tmp_path / "home" / "a.pt"))["v"] == 1
