"""A failed group is raised once: once its commit's failure was raised, the failures of the
group's files (each copy to a full home failed) are not raised again, one per sync point.

Before, ``wait()`` on the commit raised the first file's error (the commit's) and marked only
that one seen; the second file's error came at the next ``save``, which then saved nothing: one
failed group cost a second checkpoint (DeepSpeed: a second ``save_checkpoint``).
"""

from __future__ import annotations

import errno
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.errors import CheckpointWriteError
from fastckpt.testing import Fault, FaultyOps


def _full_home(tmp_path: Path, *names: str) -> tuple[fastckpt.Checkpointer, FaultyOps, Path]:
    """A Checkpointer whose copies of g1/``names`` to the home fail with ENOSPC (the burst
    buffer is fine)."""
    home = tmp_path / "ckpt"
    ops = FaultyOps([Fault("pwrite", errno.ENOSPC, path_startswith=str(home / "g1" / n)) for n in names])
    ck = fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), ops=ops, io_threads=1, commit_timeout_s=60)
    return ck, ops, home


def _save(ck: fastckpt.Checkpointer, group: Path, step: int) -> list:
    return [ck.save({"w": torch.full((64,), float(step)), "step": step}, str(group / n), group=str(group))
            for n in ("a.pt", "b.pt")]


def _failed(handles: list) -> None:
    """Wait for the saves without marking their failures seen (``result()``, as a commit does)."""
    for h in handles:
        with pytest.raises(OSError):
            h.result(60)


def _next_group_commits(ck: fastckpt.Checkpointer, home: Path) -> None:
    _save(ck, home / "g2", 2)
    assert ck.commit(str(home / "g2")).wait(60).durable_s is not None
    ck.wait()
    assert ck.latest(str(home)) == str(home / "g2")


def _failed_commit(ck: fastckpt.Checkpointer, home: Path) -> fastckpt.SaveHandle:
    """Both files of g1 saved and failed (not seen yet); the commit's handle."""
    files = _save(ck, home / "g1", 1)
    handle = ck.commit(str(home / "g1"))
    _failed(files)
    return handle


def test_commit_wait_raises_the_group_once(tmp_path: Path) -> None:
    ck, ops, home = _full_home(tmp_path, "a.pt", "b.pt")
    try:
        handle = _failed_commit(ck, home)
        assert len(ops.fired) == 2
        with pytest.raises(CheckpointWriteError):
            handle.wait(60)
        _next_group_commits(ck, home)  # b.pt's copy error is the same failed group: not raised again
    finally:
        ck.close()


def test_sync_point_raises_the_group_once(tmp_path: Path) -> None:
    """Nobody waits on the commit: the next save raises the group's failure, once."""
    ck, ops, home = _full_home(tmp_path, "a.pt", "b.pt")
    try:
        handle = _failed_commit(ck, home)
        with pytest.raises(OSError):
            handle.result(60)
        with pytest.raises(CheckpointWriteError, match=r"g1/[ab]\.pt"):  # whichever copy failed first stands
            _save(ck, home / "g2", 2)  # for the group (two replication workers: either)
        _next_group_commits(ck, home)
    finally:
        ck.close()


def test_a_file_failing_after_its_commit_was_raised_is_not_raised_again(tmp_path: Path) -> None:
    """b.pt is still being written when a.pt's failure ends the commit; it fails after that."""
    ck, ops, home = _full_home(tmp_path, "a.pt", "b.pt")
    gate = ops.gate("pwrite", str(home / "g1" / "b.pt"))
    try:
        files = _save(ck, home / "g1", 1)
        handle = ck.commit(str(home / "g1"))
        assert gate.wait_entered()
        with pytest.raises(CheckpointWriteError, match="a.pt"):
            handle.wait(60)
        gate.open()
        _failed(files[1:])
        _next_group_commits(ck, home)
    finally:
        gate.open()
        ck.close()



def _group(inflight: object, *names: str) -> tuple[list[Future], Future]:
    files = [Future() for _ in names]
    for f, n in zip(files, names, strict=True):
        f.set_running_or_notify_cancel()
        inflight.track(f, f"/g/{n}", "/g")
    commit = Future()
    inflight.track(commit, "/g", "/g")
    return files, commit


def _raised(inflight: object) -> list[str]:
    out = []
    for _ in range(3):
        try:
            inflight.raise_unseen()
        except OSError as exc:
            out.append(str(exc))
    return out


def test_the_file_that_failed_first_in_time_stands_for_its_group() -> None:
    """The commit raises its files' failures in save order (a.pt's), but b.pt failed first (its
    drive filled first): the sync point that raises b.pt's failure raises the group's, once."""
    from fastckpt.inflight import InFlight

    inflight = InFlight()
    (a, b), commit = _group(inflight, "a.pt", "b.pt")
    b.set_exception(OSError("b.pt failed"))
    a.set_exception(ea := OSError("a.pt failed"))
    commit.set_exception(ea)
    assert _raised(inflight) == ["b.pt failed"]

    inflight = InFlight()  # b.pt's failure raised while a.pt and the commit are still under way
    (a, b), commit = _group(inflight, "a.pt", "b.pt")
    b.set_exception(OSError("b.pt failed"))
    assert _raised(inflight) == ["b.pt failed"]
    a.set_exception(ea := OSError("a.pt failed"))
    commit.set_exception(ea)
    assert _raised(inflight) == []


def test_a_commit_that_succeeds_excuses_nothing_else() -> None:
    """b.pt failed and was saved again in the same attempt, which committed: a failure of
    another group stays to be raised."""
    from fastckpt.inflight import InFlight

    inflight = InFlight()
    (a, b), commit = _group(inflight, "a.pt", "b.pt")
    b.set_exception(OSError("b.pt failed"))
    assert _raised(inflight) == ["b.pt failed"]
    a.set_result(None)
    commit.set_result(None)
    (c,), other = _group(inflight, "c.pt")
    c.set_exception(OSError("c.pt failed"))
    assert _raised(inflight) == ["c.pt failed"]
