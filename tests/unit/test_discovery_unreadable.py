"""commit/discovery: a checkpoint ``latest`` cannot read is no reason to name an older one.

``latest`` (and ``ls``, ``verify --latest``) passed over a newer file it could not read (EACCES:
a job restarted under another account, a root-owned copy; EIO) and a group directory it could
not list, and named the older checkpoint: a resume silently went back in time. Only a file gone
since the listing (a race with retention) is passed over; any other error is raised, naming the
path and the fix, as an unreadable group manifest already was.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.commit import discovery
from fastckpt.storage.homes import Homes
from fastckpt.testing import Fault, FaultyOps


def _save(root: Path, *steps: int, group: bool = False) -> None:
    with fastckpt.Checkpointer() as ck:
        for step in steps:
            if group:
                g = str(root / f"step-{step}")
                ck.save({"w": torch.full((3,), float(step))}, f"{g}/m.pt", group=g)
                ck.commit(g, step=step).wait(60)
            else:
                ck.save({"w": torch.full((3,), float(step))}, str(root / f"step-{step}.pt")).wait()


def test_a_newest_file_that_cannot_be_read_is_raised_not_passed_over(tmp_path: Path) -> None:
    _save(tmp_path, 1, 2)
    ops = FaultyOps([Fault("open", errno.EACCES, path_contains="step-2.pt")])
    with pytest.raises(PermissionError) as err:
        discovery.latest(Homes(ops=ops), str(tmp_path))
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert f"{tmp_path}/step-2.pt cannot be read" in notes and "owner/mode" in notes
    assert discovery.latest(Homes(), str(tmp_path)) == str(tmp_path / "step-2.pt")


def test_a_directory_that_cannot_be_listed_is_raised_not_taken_for_empty(tmp_path: Path, monkeypatch) -> None:
    """``os.scandir`` is no ``FileOps`` call, so the fault (what mode 700 of another owner gives
    a non-root reader) is injected at it; every other directory is listed for real."""
    _save(tmp_path, 1, 2, group=True)
    (tmp_path / "latest").unlink()  # the scan, not the pointer, finds the newest
    real = os.scandir

    def scandir(d: str = "."):  # noqa: ANN202 (os.scandir's iterator)
        if os.fspath(d) == str(tmp_path / "step-2"):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(d))
        return real(d)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(PermissionError) as err:
        fastckpt.latest(str(tmp_path))
    assert f"listing of {tmp_path / 'step-2'}" in "\n".join(err.value.__notes__)
    monkeypatch.setattr(os, "scandir", real)
    assert fastckpt.latest(str(tmp_path)) == str(tmp_path / "step-2")
