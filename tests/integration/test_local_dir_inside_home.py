"""A burst buffer inside the checkpoint folder (``local_dir="/ckpt/bb"``, saves to
``/ckpt/step-N.pt``): its copies (``/ckpt/bb/ckpt/step-N.pt``) are no checkpoints of that folder.

The job is killed (SIGKILL) during step-2's upload. Another process's ``fastckpt.latest`` named
the burst-buffer copy of step 2, which never reached its home, and ``fastckpt ls`` listed every
save twice. A Checkpointer's first save marks each ``local_dir`` at its root, and every scan
passes over what lies below a mark. The home is two folders below ``/`` (``/tmp/X``) so that the copies lie
within the scan's depth, as they do under ``/ckpt``.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.urls import mirror_path

CHILD = """
import sys, torch, fastckpt
home, bb = sys.argv[1], sys.argv[2]

class Queued:  # step 2's local copy is written: its upload (40 s at 100 kB/s) starts
    def emit(self, ev):
        if ev.name == "queued" and ev.path.endswith("step-2.pt"):
            print("queued", flush=True)

ck = fastckpt.Checkpointer(local_dir=bb, replicate_bandwidth_Bps=1e5, sinks=(Queued(),))
ck.save({"w": torch.zeros(10), "step": 1}, home + "/step-1.pt").wait()
ck.save({"w": torch.ones(1 << 20), "step": 2}, home + "/step-2.pt")
sys.stdin.read()
"""


@pytest.fixture
def home() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="fastckpt-bb-home-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_burst_buffer_inside_the_checkpoint_folder_is_never_a_checkpoint_of_it(home: Path) -> None:
    bb = home / "bb"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(home), str(bb)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "queued\n"
    finally:
        child.send_signal(signal.SIGKILL)  # the job dies during step-2's upload
        child.wait()
    copy = Path(mirror_path(str(bb), str(home / "step-2.pt")))
    assert copy.exists() and not (home / "step-2.pt").exists()
    assert fastckpt.latest(str(home)) == str(home / "step-1.pt")  # the restarted job resumes there
    assert fastckpt.latest(str(bb)) == str(copy)  # asked of the burst buffer itself: its copies count
    listed = subprocess.run([sys.executable, "-m", "fastckpt", "ls", str(home), "--json"], capture_output=True,
                            text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["checkpoints"]
    assert [(r["path"], r["status"], r["latest"]) for r in rows] == [(str(home / "step-1.pt"), "complete", True)]
    from fastckpt.commit.names import BURST_BUFFER_MARK

    assert (bb / BURST_BUFFER_MARK).is_file()  # what tells any process's scan where the burst buffer is


def test_ls_lists_no_group_of_a_burst_buffer_inside_the_folder(home: Path) -> None:
    """A committed group and one whose commit has not come: each once, at its home (the burst
    buffer's copies were listed again, the uncommitted one as an incomplete group of its own)."""
    with fastckpt.Checkpointer(local_dir=str(home / "bb"), rank=0, world_size=1) as ck:
        for step in (0, 1):
            group = str(home / f"g-{step}")
            ck.save({"w": torch.full((4,), float(step))}, f"{group}/model.pt", group=group).wait()
        ck.commit(str(home / "g-0"), step=0).wait()
        assert Path(mirror_path(str(home / "bb"), str(home / "g-1" / "model.pt"))).exists()
        listed = subprocess.run([sys.executable, "-m", "fastckpt", "ls", str(home), "--json"], capture_output=True,
                                text=True, timeout=300)
        ck.commit(str(home / "g-1"), step=1).wait()
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["checkpoints"]
    assert sorted((r["path"], r["status"]) for r in rows) == [(str(home / "g-0"), "complete"),
                                                                (str(home / "g-1"), "incomplete")]


def test_a_runs_own_checkpoints_in_its_burst_buffer_folder_are_found_from_above(tmp_path) -> None:
    """local_dir set to the run's folder, saves below it: the mark at that folder hid the run's
    real checkpoints from a scan of any folder above it (latest() of the experiments folder gave
    None); only the copies (under the folder's own absolute path) are passed over."""
    run = tmp_path / "runs" / "exp1"
    with fastckpt.Checkpointer(local_dir=str(run), overhead_budget=0.99) as ck:
        ck.save({"w": torch.ones(4)}, str(run / "ckpt" / "step-1.pt")).wait()
    copy = Path(mirror_path(str(run), str(run / "ckpt" / "step-1.pt")))
    assert copy.exists() and (run / ".fastckpt-burst-buffer").exists()
    assert fastckpt.latest(str(tmp_path / "runs")) == str(run / "ckpt" / "step-1.pt")  # before: None
    assert fastckpt.latest(str(run / "ckpt")) == str(run / "ckpt" / "step-1.pt")
