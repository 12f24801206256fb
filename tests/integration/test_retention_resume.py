"""A single file that a killed run saved to the burst buffer but did not replicate is replicated
by the next run (``save.resume``), then counted by keep_local: the burst buffer stays bounded
however often the job is killed, and the home gets the save the killed run could not upload.

Each killed run is a real process: an older save's upload is held (an event nobody sets) while
a newer save is verified at its home, then the process SIGKILLs itself, as in a job killed mid-upload.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.urls import mirror_path

_RUN = r'''
import json, os, signal, sys, threading
import torch, fastckpt
from fastckpt.save import replicator as R
so, local, dest, start, kill = json.loads(sys.argv[1])
held = threading.Event()  # never set: the older save's upload is under way when the job dies
orig = R.Replicator._copy
def copy(self, job, manifest):
    if kill and job.rec.path.endswith(f"step-{start:04d}.pt"):
        held.wait()
    return orig(self, job, manifest)
R.Replicator._copy = copy
ck = fastckpt.Checkpointer(local_dir=local, storage_options=so, replicate_policy="all", keep_local=1,
                           overhead_budget=0.99)
hs = [ck.save({"w": torch.full((1 << 14,), float(s)), "step": s}, f"{dest}/step-{s:04d}.pt")
      for s in (start, start + 1)]
hs[1].wait()  # the newer one is verified at its home
if kill:
    os.kill(os.getpid(), signal.SIGKILL)
ck.close()
'''


def _runs(nvme: Path, dest: str, so: dict) -> tuple[list[str], list[int]]:
    """Three runs killed mid-upload, then one that ends normally, each resuming after ``latest``
    as a job does; returns what the burst buffer holds at the end and the steps the killed runs
    could not upload."""
    step, held = 1, []
    for run in range(4):
        kill = run < 3
        proc = subprocess.run([sys.executable, "-c", _RUN, json.dumps([so, str(nvme), dest, step, kill])],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == (-signal.SIGKILL if kill else 0), proc.stderr[-3000:]
        if kill:
            held.append(step)
        step = int(fastckpt.latest(dest, storage_options=so).rsplit("-", 1)[1][:4]) + 1
    left = sorted(f for _, _, fs in os.walk(nvme) for f in fs if not f.startswith("."))
    return left, held


def test_copies_killed_runs_did_not_replicate_are_replicated_and_counted(tmp_path: Path) -> None:
    nvme, dest = tmp_path / "nvme", tmp_path / "ckpt"
    left, held = _runs(nvme, str(dest), {})
    assert left == ["step-0008.pt"]  # keep_local=1: before save.resume the three held saves stayed too
    for s in held:  # each held save is at its home, whole and verified: it loads with no burst buffer at all
        assert fastckpt.load(str(dest / f"step-{s:04d}.pt"))["step"] == s


def test_copies_killed_runs_did_not_replicate_to_s3_are_replicated(s3_server, s3_bucket, tmp_path: Path) -> None:
    so, url = s3_server.storage_options(), f"s3://{s3_bucket}/run"
    left, held = _runs(tmp_path / "nvme", url, so)
    assert left == ["step-0008.pt"]
    for s in held:
        assert fastckpt.load(f"{url}/step-{s:04d}.pt", storage_options=so)["step"] == s


def _left_one(nvme: Path, dest: Path) -> Path:
    """A closed run that leaves ``a.pt`` only in the burst buffer (its home copy removed, as if never uploaded)."""
    with fastckpt.Checkpointer(local_dir=str(nvme), overhead_budget=0.99) as ck:
        ck.save({"w": torch.ones(256), "step": 1}, str(dest / "a.pt")).wait()
    os.remove(dest / "a.pt")
    return Path(mirror_path(str(nvme), str(dest / "a.pt")))


def _next_run(nvme: Path, dest: Path) -> None:
    with fastckpt.Checkpointer(local_dir=str(nvme), keep_local=1, overhead_budget=0.99) as ck:
        ck.save({"w": torch.zeros(256), "step": 2}, str(dest / "b.pt")).wait()


def test_a_copy_whose_home_holds_a_newer_save_is_counted_not_uploaded(tmp_path: Path) -> None:
    nvme, dest = tmp_path / "nvme", tmp_path / "ckpt"
    local = _left_one(nvme, dest)
    with fastckpt.Checkpointer(overhead_budget=0.99) as ck:  # a newer save of it, straight to its home
        ck.save({"step": 9}, str(dest / "a.pt")).wait()
    _next_run(nvme, dest)
    assert not local.exists()  # obsolete: keep_local=1 counted it
    assert fastckpt.load(str(dest / "a.pt"))["step"] == 9  # the newer save stays


def test_a_damaged_copy_is_never_uploaded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    nvme, dest = tmp_path / "nvme", tmp_path / "ckpt"
    local = _left_one(nvme, dest)
    with open(local, "r+b") as f:  # one payload byte flipped: the manifest still parses, the checksum does not match
        f.seek(200)
        b = f.read(1)
        f.seek(200)
        f.write(bytes([b[0] ^ 0xFF]))
    with caplog.at_level("WARNING", logger="fastckpt"):
        _next_run(nvme, dest)
    assert local.exists() and not (dest / "a.pt").exists()
    assert f"not replicating {dest}/a.pt, which an earlier run saved to the burst buffer" in caplog.text


def test_another_ranks_copy_is_not_this_ranks_to_resume(tmp_path: Path) -> None:
    nvme, dest = tmp_path / "nvme", tmp_path / "ckpt"
    with fastckpt.Checkpointer(local_dir=str(nvme), rank=1, world_size=2, overhead_budget=0.99) as ck:
        ck.save({"step": 1}, str(dest / "a.pt")).wait()
    os.remove(dest / "a.pt")
    with fastckpt.Checkpointer(local_dir=str(nvme), rank=0, world_size=2, keep_local=1, overhead_budget=0.99) as ck:
        ck.save({"step": 2}, str(dest / "b.pt")).wait()
    assert Path(mirror_path(str(nvme), str(dest / "a.pt"))).exists() and not (dest / "a.pt").exists()


def test_with_replicate_in_order_a_resumed_copy_lands_before_this_runs_files(tmp_path: Path) -> None:
    nvme, dest, log = tmp_path / "nvme", tmp_path / "ckpt", tmp_path / "events.jsonl"
    _left_one(nvme, dest)
    with fastckpt.Checkpointer(local_dir=str(nvme), keep_local=1, replicate_in_order=True, replicate_workers=4,
                               event_log=str(log), overhead_budget=0.99) as ck:
        ck.save({"w": torch.zeros(256), "step": 2}, str(dest / "b.pt")).wait()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    done = {e["path"]: e for e in events if e["name"] == "replicate" and e["error"] is None}
    assert {f"{dest}/a.pt", f"{dest}/b.pt"} <= set(done)  # the resumed copy's events are in the log too
    assert done[f"{dest}/a.pt"]["end"] <= done[f"{dest}/b.pt"]["start"]  # it was saved first: it lands first
    assert fastckpt.load(str(dest / "a.pt"))["step"] == 1
