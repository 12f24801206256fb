"""``replicate_in_order=True`` with ``replicate_policy="all"``: a queued upload of a single file
keeps its save's bytes when a newer save replaces its burst-buffer copy (``save.versions``).

Each queued upload of a file saved every step (Lightning's ``last.ckpt``) was dropped for the
next save of it ("superseded"), so while uploads ran behind none of them reached the path. The
upload of an earlier file is held by a FaultyOps hook while the same path is saved three times;
every rename at the home copy of that path records which save it lands: no timing.
"""

from __future__ import annotations

import errno
import os
import threading

import torch

import fastckpt
from fastckpt.io.atomic import final_path
from fastckpt.testing import Fault, FaultyOps
from tests.helpers import Queued, tmp_files


def _state(step: int) -> dict:
    return {"w": torch.full((1 << 14,), step, dtype=torch.int32), "step": step}


class Held:
    """FaultyOps ``on_call``: holds the rename of ``held``'s upload at ``home`` until ``release``;
    records the step of every file renamed onto ``landing`` at ``home``."""

    def __init__(self, home: str, held: str, landing: str) -> None:
        self.home, self.held, self.landing = home, held, landing
        self.entered, self.release = threading.Event(), threading.Event()
        self.landed: list[int] = []

    def __call__(self, op: str, path: str) -> None:
        if op != "replace" or not path.startswith(self.home + "/"):
            return
        p = final_path(path) or path
        if p == self.held and not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(60)
        elif p == self.landing:
            self.landed.append(torch.load(path, weights_only=True)["step"])


def _saved_behind(tmp_path, faults: tuple[Fault, ...] = ()) -> tuple:  # noqa: ANN001
    """``top.ckpt`` saved, its upload held at its rename; then ``last.ckpt`` saved three times
    (steps 1-3), each local write done while the earlier uploads wait."""
    home, nvme = str(tmp_path / "home"), str(tmp_path / "nvme")
    top, last = f"{home}/top.ckpt", f"{home}/last.ckpt"
    held, queued = Held(home, top, last), Queued()
    ck = fastckpt.Checkpointer(local_dir=nvme, ops=FaultyOps(faults, on_call=held), replicate_policy="all",
                               replicate_in_order=True, replicate_workers=1, sinks=(queued,), staging_buffers=2,
                               rank=0, world_size=1)
    handles = [ck.save(_state(0), top)]
    assert held.entered.wait(60)
    for step in (1, 2, 3):
        handles.append(ck.save(_state(step), last))
        assert queued.wait(last, step)
    return ck, held, handles, nvme, last


def test_the_oldest_queued_save_of_a_path_lands_in_its_turn_and_the_newest_after_it(tmp_path) -> None:  # noqa: ANN001
    """One version of a path waits (the oldest queued), with its own bytes; a save between it and the
    newest is dropped, so a path holds at most two copies in the burst buffer however far behind the
    uploads run (a review found every version kept filled it: ENOSPC in fit())."""
    ck, held, handles, nvme, last = _saved_behind(tmp_path)
    held.release.set()
    recs = [h.wait(60) for h in handles]
    ck.close()
    assert [r.superseded for r in recs] == [False, False, True, False]  # was: saves 1 and 2 of last.ckpt dropped
    assert held.landed == [1, 3]  # each with its own bytes, in the order of the calls
    assert torch.load(last, weights_only=True)["step"] == 3
    assert tmp_files(nvme) == []  # each version link went with its upload


def test_a_removed_path_takes_the_version_links_of_its_queued_uploads(tmp_path) -> None:  # noqa: ANN001
    ck, held, handles, nvme, last = _saved_behind(tmp_path)
    try:
        ck.remove(last)
        recs = [h.wait(60) for h in handles[1:]]
        assert [r.cancelled for r in recs] == [True, False, True] and recs[1].superseded  # save 2: dropped for 3
    finally:
        held.release.set()
    assert handles[0].wait(60).durable_s is not None
    ck.close()
    assert held.landed == [] and not os.path.exists(last)
    assert tmp_files(nvme) == []  # the cancelled uploads' version links went with them


def test_without_hard_links_a_queued_save_is_dropped_for_the_newer_one(tmp_path) -> None:  # noqa: ANN001
    no_links = tuple(Fault("link", error=errno.EPERM, nth=n, path_contains="last.ckpt") for n in range(1, 9))
    ck, held, handles, nvme, last = _saved_behind(tmp_path, no_links)
    held.release.set()
    recs = [h.wait(60) for h in handles]
    ck.close()
    assert [r.superseded for r in recs] == [False, True, True, False]  # as before version links
    assert held.landed == [3]
    assert tmp_files(nvme) == []


def test_the_room_check_first_removes_what_a_killed_run_left_in_the_burst_buffer(tmp_path) -> None:  # noqa: ANN001
    """A killed run's version links (hidden temp names of a dead process) hold blocks: the room
    check counted them, every save then went straight to its path, and nothing ever wrote into
    that directory again to sweep them. ``Stripes.choose`` sweeps a drive's directory first."""
    import subprocess
    import sys

    from fastckpt.io.atomic import _HOST
    from fastckpt.save.stripes import Stripes
    from fastckpt.urls import mirror_path

    nvme, path = str(tmp_path / "nvme"), str(tmp_path / "home" / "last.ckpt")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    os.makedirs(os.path.dirname(mirror_path(nvme, path)))
    stale = os.path.join(os.path.dirname(mirror_path(nvme, path)),
                         f".fastckpt-tmp-{_HOST}.{child.pid}.0123456789ab~{b'last.ckpt'.hex()}")
    with open(stale, "wb") as f:
        f.write(b"x" * 4096)
    Stripes((nvme,)).choose(path, 4096, may_bypass=True)
    assert not os.path.exists(stale)


_KILLED_RUN = """
import os, signal, sys, threading
import torch
import fastckpt
from fastckpt.testing import FaultyOps
home, nvme = sys.argv[1], sys.argv[2]
queued, n = threading.Condition(), [0]

class Sink:
    def emit(self, ev):
        if ev.name == "queued":
            with queued:
                n[0] += 1
                queued.notify_all()

def hold(op, path):  # a slow home: no upload gets past its first write
    if op == "pwrite" and path.startswith(home + os.sep):
        threading.Event().wait()

ck = fastckpt.Checkpointer(local_dir=nvme, ops=FaultyOps(on_call=hold), replicate_policy="all",
                           replicate_in_order=True, replicate_workers=1, sinks=(Sink(),), rank=0, world_size=1)
for step in (1, 2, 3):
    ck.save({"w": torch.full((1 << 14,), step)}, os.path.join(home, "version_0", "last.ckpt"))
with queued:
    assert queued.wait_for(lambda: n[0] == 3, timeout=60)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_runs_version_links_in_another_folder_go_when_the_next_run_picks_the_drive(tmp_path) -> None:  # noqa: ANN001
    """A run killed with uploads behind leaves the hidden version links of its queued saves
    (one the only name of a whole checkpoint); the next run saves into another folder (Lightning's
    next ``version_N``), and only the folders a run wrote into were swept: they stayed for good.
    The first save of a Checkpointer now sweeps each drive's whole tree (dead processes only)."""
    import signal
    import subprocess
    import sys

    from fastckpt.io.atomic import tmp_name
    from fastckpt.urls import mirror_path

    home, nvme = str(tmp_path / "home"), str(tmp_path / "nvme")
    killed = subprocess.Popen([sys.executable, "-c", _KILLED_RUN, home, nvme], stderr=subprocess.PIPE, text=True)
    _, err = killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL, err
    old_dir = os.path.dirname(mirror_path(nvme, os.path.join(home, "version_0", "last.ckpt")))
    dead = [f for f in tmp_files(nvme) if f".{killed.pid}." in os.path.basename(f)]
    assert len(dead) >= 2 and all(os.path.dirname(f) == old_dir for f in dead)  # the oldest queued and the newest
    assert min(os.stat(f).st_nlink for f in dead) == 1  # a replaced save's bytes: no other name
    mine = tmp_name(os.path.join(old_dir, "last.ckpt"))  # a live process's (this one's): left alone
    open(mine, "wb").close()
    with fastckpt.Checkpointer(local_dir=nvme, rank=0, world_size=1) as ck:
        ck.save(_state(7), os.path.join(home, "version_1", "last.ckpt")).wait(60)
    assert tmp_files(nvme) == [mine]
    assert torch.load(os.path.join(home, "version_1", "last.ckpt"), weights_only=True)["step"] == 7
