"""Two processes committing groups into one directory: ``latest`` only moves forward.

``latest``'s read-compare-write was guarded by a thread lock only, which is per process: a
commit whose pointer write landed after a newer commit of another process (another job, or an
orphaned launch outliving its restart) moved ``latest`` back to its older group. The write now
holds an ``flock`` of the directory. Real processes, synchronised through their pipes.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fastckpt
from fastckpt.storage import places
from tests.helpers import place

CHILD = r'''
import fcntl, os, sys, torch, fastckpt
from fastckpt.io.ops import FileOps
d, name, role = sys.argv[1], sys.argv[2], sys.argv[3]
flock = fcntl.flock

def telling(fd, op):  # B: says when another process holds the directory
    try:
        return flock(fd, op)
    except BlockingIOError:
        print("blocked", flush=True)
        fcntl.flock = flock
        raise

class Holding(FileOps):  # A: stops right before its ``latest`` rename until told to go on
    def replace(self, src, dst):
        if dst == os.path.join(d, "latest"):
            print("at pointer", flush=True)
            assert sys.stdin.readline() == "go\n"
        return super().replace(src, dst)

if role == "B":
    fcntl.flock = telling
g = os.path.join(d, name)
with fastckpt.Checkpointer(rank=0, world_size=1, odirect=False, overhead_budget=0.99,
                           ops=Holding() if role == "A" else None) as ck:
    ck.save({"w": torch.ones(4)}, os.path.join(g, "model.pt"), group=g)
    ck.commit(g, step=int(name[4:])).wait(120)
print("done", flush=True)
'''


def _child(d: Path, name: str, role: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(d), name, role], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def test_a_commit_of_another_process_never_moves_latest_back(tmp_path: Path) -> None:
    """A commits step1 and stops right before its ``latest`` rename; B commits step2, which was
    requested later. Before: B moved ``latest`` to step2 and A, let go, moved it back to step1.
    Now B waits for A's hold of the directory, reads step1 there and moves ``latest`` on."""
    a = _child(tmp_path, "step1", "A")
    b = None
    try:
        assert a.stdout.readline() == "at pointer\n"
        b = _child(tmp_path, "step2", "B")
        said = b.stdout.readline()  # "blocked" (it waits for A), or, before, "done" (it went past A)
        assert said in ("blocked\n", "done\n")
        a.stdin.write("go\n")
        a.stdin.flush()
        assert a.wait(120) == 0 and b.wait(120) == 0
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
    assert fastckpt.latest(str(tmp_path)) == str(tmp_path / "step2")
    assert (tmp_path / "latest").read_text() == "step2"
    assert said == "blocked\n"


def test_a_directory_held_past_the_wait_is_written_without_the_lock(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder that never lets go (a stopped process) delays a commit by ``LOCK_WAIT_S`` at
    most: the pointer moves without the lock, with a warning naming the directory."""
    monkeypatch.setattr(places, "LOCK_WAIT_S", 0.0)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open of the directory: it conflicts as another process's
        with caplog.at_level(logging.WARNING, logger="fastckpt"), place(tmp_path).exclusive():
            (tmp_path / "inside").write_text("x")
    finally:
        os.close(fd)
    assert "another process held it for 0 s" in caplog.text and str(tmp_path) in caplog.text
    with place(tmp_path).exclusive():  # let go: held again at once
        pass


def test_the_pointer_temp_file_of_a_killed_process_goes_when_latest_moves_again(tmp_path: Path) -> None:
    """A is killed -9 between writing ``latest``'s temp file and renaming it; the next process to
    move ``latest`` in that directory removes the temp file (docs/faults.md: "the first time the
    directory is written again"). Before: the pointer's write never swept its directory, so the
    temp file stayed for good."""
    import torch

    from fastckpt.io.atomic import TMP_TAG

    a = _child(tmp_path, "step1", "A")
    try:
        assert a.stdout.readline() == "at pointer\n"  # its temp file is written, the rename not done
    finally:
        a.kill()
        a.wait(60)
    left = [n for n in os.listdir(tmp_path) if TMP_TAG in n]
    assert len(left) == 1
    g = str(tmp_path / "step2")
    with fastckpt.Checkpointer(rank=0, world_size=1, odirect=False, overhead_budget=0.99) as ck:
        ck.save({"w": torch.ones(4)}, os.path.join(g, "model.pt"), group=g)
        ck.commit(g, step=2).wait(120)
    assert [n for n in os.listdir(tmp_path) if TMP_TAG in n] == []
    assert fastckpt.latest(str(tmp_path)) == g
