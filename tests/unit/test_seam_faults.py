"""Faults on the paths that once bypassed the FileOps seam: the tier probe, the group protocol's
small files, downloads and group removal. Each is reached through ``FaultyOps`` and leaves the
previous checkpoint intact and no temp or probe file behind."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.io.atomic import PROBE_TAG
from fastckpt.storage.posix import PosixTarget
from fastckpt.testing import Fault, FaultyOps
from tests.helpers import tmp_files


def _state(v: int) -> dict:
    return {"w": torch.arange(1024, dtype=torch.int64) + v, "v": v}


def test_tier_probe_fault_fails_the_save_at_the_call(tmp_path: Path) -> None:
    ops = FaultyOps([Fault("pwrite", errno.EIO, path_contains=PROBE_TAG)])
    with fastckpt.Checkpointer(ops=ops) as ck:
        with pytest.raises(fastckpt.CheckpointWriteError) as ei:
            ck.save(_state(1), str(tmp_path / "a.pt"))  # the probe runs on the training thread
        assert ei.value.errno == errno.EIO
        ops.assert_all_reached()
        assert tmp_files(tmp_path) == []
        ck.save(_state(2), str(tmp_path / "a.pt")).wait()  # the next save probes again and works
    assert fastckpt.load(str(tmp_path / "a.pt"))["v"] == 2


def test_marker_read_fault_fails_the_commit_and_keeps_the_previous_group(tmp_path: Path) -> None:
    ops = FaultyOps()
    g1, g2 = tmp_path / "step-1", tmp_path / "step-2"
    with fastckpt.Checkpointer(ops=ops, rank=0, world_size=1) as ck:
        ck.save(_state(1), str(g1 / "m.pt"), group=str(g1))
        ck.commit(str(g1)).wait()
        ops.inject(Fault("preadv", errno.EIO, path_contains=f"step-2{os.sep}.fastckpt{os.sep}rank-"))
        ck.save(_state(2), str(g2 / "m.pt"), group=str(g2))
        with pytest.raises(OSError) as ei:
            ck.commit(str(g2)).wait()
        assert ei.value.errno == errno.EIO
        ck.wait()
    ops.assert_all_reached()
    assert fastckpt.latest(str(tmp_path)) == str(g1)
    assert fastckpt.load(str(g1 / "m.pt"))["v"] == 1
    assert tmp_files(tmp_path) == []


def test_download_fault_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    root = tmp_path / "home"
    root.mkdir()
    (root / "x.bin").write_bytes(b"new" * 1000)
    dest = tmp_path / "local" / "x.bin"
    dest.parent.mkdir()
    dest.write_bytes(b"old")
    ops = FaultyOps([Fault("pwrite", errno.ENOSPC)])
    with pytest.raises(OSError) as ei:
        PosixTarget(root, ops=ops).download("x.bin", dest)
    assert ei.value.errno == errno.ENOSPC
    ops.assert_all_reached()
    assert dest.read_bytes() == b"old" and tmp_files(tmp_path) == []


def test_group_removal_fault_after_the_manifest_leaves_it_invisible_then_finishes(tmp_path: Path) -> None:
    g = tmp_path / "step-1"
    with fastckpt.Checkpointer(rank=0, world_size=1) as ck:
        ck.save(_state(1), str(g / "m.pt"), group=str(g))
        ck.commit(str(g)).wait()
    ops = FaultyOps([Fault("rmdir", errno.EBUSY, path_contains=".fastckpt")])
    with fastckpt.Checkpointer(ops=ops, rank=0, world_size=1) as ck:
        with pytest.raises(OSError):
            ck.remove(str(g))
        ops.assert_all_reached()
        assert fastckpt.latest(str(tmp_path)) is None  # the manifest went first
        ck.remove(str(g))
    assert not g.exists()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_a_pointer_write_fault_fails_the_group_commit(tmp_path: Path, err: int) -> None:
    """A group commit whose pointer write fails after its manifest is out fails, and ``latest()``
    stays on the group before it. (A commit that succeeded with a WARNING when the pointer could
    not be re-read was tried: during one outage the re-read failed too, the pointer looked absent,
    and the commit reported success while ``latest()`` named the older group afterwards.)"""
    ops = FaultyOps()
    g1, g2 = tmp_path / "step-1", tmp_path / "step-2"
    with fastckpt.Checkpointer(ops=ops, rank=0, world_size=1) as ck:
        ck.save(_state(1), str(g1 / "m.pt"), group=str(g1))
        ck.commit(str(g1), step=1).wait()
        ops.inject(Fault("write_small", err, path_contains=f"{os.sep}latest"))
        ck.save(_state(2), str(g2 / "m.pt"), group=str(g2))
        with pytest.raises(OSError) as raised:
            ck.commit(str(g2), step=2).wait()
        assert raised.value.errno == err
        ck.wait()
    ops.assert_all_reached()
    assert fastckpt.latest(str(tmp_path)) == str(g1)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_a_pointer_write_fault_takes_a_first_group_back(tmp_path: Path, err: int) -> None:
    """The directory's first group commit, whose pointer write fails: the commit failed, yet with no
    pointer to pass it by ``latest()`` found the group by its scan, and a resume loaded the save
    reported failed. Its manifest is taken back: ``latest()`` finds nothing, and the group's next
    save commits it."""
    ops = FaultyOps([Fault("write_small", err, path_contains=f"{os.sep}latest")])
    g1 = tmp_path / "step-1"
    with fastckpt.Checkpointer(ops=ops, rank=0, world_size=1) as ck:
        ck.save(_state(1), str(g1 / "m.pt"), group=str(g1))
        with pytest.raises(OSError) as raised:
            ck.commit(str(g1), step=1).wait()
        assert raised.value.errno == err
        assert fastckpt.latest(str(tmp_path)) is None  # before: the group, found by the scan
        assert any("was taken back, so that latest() does not find it" in n for n in raised.value.__notes__)
        with pytest.raises(fastckpt.IncompleteCheckpointError):
            fastckpt.load(str(g1 / "m.pt"))
        ck.save(_state(2), str(g1 / "m.pt"), group=str(g1))
        ck.commit(str(g1), step=1).wait()
    ops.assert_all_reached()
    assert fastckpt.latest(str(tmp_path)) == str(g1) and fastckpt.load(str(g1 / "m.pt"))["v"] == 2


def test_a_pointer_write_fault_swaps_a_resave_back_out(tmp_path: Path) -> None:
    """A group re-saved under one path while no pointer names it (here: removed by hand), whose
    pointer write fails: the re-save was swapped in, so ``latest()`` found it by its scan and a
    resume loaded the save reported failed. It is swapped back out: the save before it is the one
    ``latest()`` finds, whole."""
    ops = FaultyOps()
    g = tmp_path / "last"
    with fastckpt.Checkpointer(ops=ops, rank=0, world_size=1) as ck:
        ck.save(_state(1), str(g / "m.pt"), group=str(g))
        ck.commit(str(g), step=1).wait()
        (tmp_path / "latest").unlink()
        ops.inject(Fault("write_small", errno.EIO, path_contains=f"{os.sep}latest"))
        ck.save(_state(2), str(g / "m.pt"), group=str(g))
        with pytest.raises(OSError, match="Input/output error") as raised:
            ck.commit(str(g), step=2).wait()
        ops.assert_all_reached()
        assert fastckpt.latest(str(tmp_path)) == str(g) and fastckpt.load(str(g / "m.pt"))["v"] == 1  # before: 2
        assert any("the save it replaced is published there again" in n for n in raised.value.__notes__)
        ck.save(_state(3), str(g / "m.pt"), group=str(g))
        ck.commit(str(g), step=3).wait()
    assert fastckpt.latest(str(tmp_path)) == str(g) and fastckpt.load(str(g / "m.pt"))["v"] == 3


def test_a_pointer_renamed_in_before_its_directory_fsync_failed_commits(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """The pointer's rename got through, then the directory's fsync failed (EIO): ``latest()`` names
    the group, but its commit failed. The pointer is read again: it names the group, so the commit
    stands, with a WARNING."""
    armed: list[bool] = []

    def dir_fsync(op: str, path: str) -> None:
        if armed and op == "fsync_dir" and path == str(tmp_path):
            raise OSError(errno.EIO, "Input/output error (injected)", path)

    g = tmp_path / "step-1"
    with fastckpt.Checkpointer(ops=FaultyOps(on_call=dir_fsync), rank=0, world_size=1) as ck:
        ck.save(_state(1), str(g / "m.pt"), group=str(g)).wait()
        armed.append(True)
        ck.commit(str(g), step=1).wait()
    assert "names it (or a newer checkpoint), though its write failed" in caplog.text
    assert fastckpt.latest(str(tmp_path)) == str(g) and fastckpt.load(str(g / "m.pt"))["v"] == 1


@pytest.mark.parametrize("case", ["in place", "re-save"])
def test_a_manifest_renamed_in_before_its_directory_fsync_failed_commits(tmp_path: Path, case: str,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """The group's manifest landed (renamed in place, or the re-save's directory exchanged in), then the
    directory's fsync failed (EIO): rank 0 raised, yet the manifest stayed, ``latest()`` resumed the save
    reported failed, and a rank without a store reported it committed. The manifest is read again: it is
    this attempt's, so the commit stands, with a WARNING, and ``latest`` moves to it."""
    g = tmp_path / ("last" if case == "re-save" else "step-1")
    synced_dir = tmp_path if case == "re-save" else g  # an exchange syncs the parent, a rename the group
    armed: list[bool] = []
    hits: list[str] = []

    def dir_fsync(op: str, path: str) -> None:
        if armed and not hits and op == "fsync_dir" and path.rstrip(os.sep) == str(synced_dir):
            hits.append(path)
            raise OSError(errno.EIO, "Input/output error (injected)", path)

    with fastckpt.Checkpointer(ops=FaultyOps(on_call=dir_fsync), rank=0, world_size=1) as ck:
        if case == "re-save":
            ck.save(_state(1), str(g / "m.pt"), group=str(g)).wait()
            ck.commit(str(g), step=1).wait()
        ck.save(_state(2), str(g / "m.pt"), group=str(g)).wait()
        armed.append(True)
        ck.commit(str(g), step=2).wait()  # before: OSError (EIO), though latest() resumed it
    assert hits and "its manifest is in place, though the step after it failed" in caplog.text
    assert fastckpt.latest(str(tmp_path)) == str(g) and fastckpt.load(str(g / "m.pt"))["v"] == 2
    assert (tmp_path / "latest").read_text() == g.name

