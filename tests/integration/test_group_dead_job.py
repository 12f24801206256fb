"""A job restarted after it died saving a group (no store: marker files) commits that group:
the failure record the dead job's rank 1 left in it ends nothing of the new job.

Launch 1 (two real processes, RANK/WORLD_SIZE in the environment) commits step1 (and, re-saving,
step2); then rank 1's save into step2 fails (ENOSPC, injected by ``FaultyOps``) before rank 0
began it, so its record names no attempt (``.fastckpt/failed-00001.json``, in step2 or in its
re-save directory), and rank 1 exits; rank 0, still computing, is SIGKILLed, as a launcher tears
a failed job down. Launch 2 (new processes) saves step2 again on both ranks and commits it.
Before, the dead job's record was taken for launch 2's first attempt (it replaced none either):
both ranks failed with launch 1's ENOSPC and latest stayed at step1. In-process cases:
tests/unit/test_commit_abort.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import fastckpt
from fastckpt.commit import protocol as P

REPO = Path(__file__).resolve().parents[2]

RANK = textwrap.dedent("""
    import errno, json, os, sys, torch, fastckpt
    from fastckpt.testing import Fault, FaultyOps

    root, launch, resave = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    rank = int(os.environ["RANK"])
    ops = FaultyOps()
    ck = fastckpt.Checkpointer(ops=ops, commit_timeout_s=60, io_threads=1, overhead_budget=0.99)
    g2 = f"{root}/step2"
    if launch == 1:
        for step in (1, 2) if resave else (1,):
            g = f"{root}/step{step}"
            ck.save({"w": torch.arange(64) + rank, "launch": 1}, f"{g}/rank{rank}.pt", group=g)
            ck.commit(g, step=step).wait()
        if rank == 0:
            print("computing step2", flush=True)
            sys.stdin.readline()  # never answered: SIGKILLed
            sys.exit(0)
        ops.inject(Fault("pwrite", errno.ENOSPC, path_contains="rank1.pt"))
        try:
            ck.save({"w": torch.arange(64) + rank, "launch": 1}, f"{g2}/rank{rank}.pt", group=g2).wait()
        except fastckpt.CheckpointWriteError:
            pass  # raised again by the commit, which leaves the failure record
        try:
            ck.commit(g2, step=2).wait()
        except fastckpt.CheckpointWriteError as exc:
            print(json.dumps({"said": f"{type(exc).__name__}: {exc}"}), flush=True)
        os._exit(1)  # the training script dies on it: no close(), as a crash
    ck.save({"w": torch.arange(64) + 10 * rank, "launch": 2}, f"{g2}/rank{rank}.pt", group=g2)
    try:
        ck.commit(g2, step=2).wait()
        said = "ok"
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"said": said}), flush=True)
    ck.close()
""")


def _start(rank: int, root: Path, launch: int, resave: bool) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-c", RANK, str(root), str(launch), "1" if resave else "0"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _said(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=120)
    lines = out.strip().splitlines()
    assert lines, err
    return json.loads(lines[-1])["said"]


@pytest.mark.parametrize("resave", [False, True], ids=["new-group", "resave"])
def test_a_restarted_job_commits_the_group_its_dead_predecessor_failed_to_save(tmp_path: Path, resave: bool) -> None:
    procs = [_start(r, tmp_path, 1, resave) for r in (0, 1)]
    guard = threading.Timer(240, lambda: [p.kill() for p in procs])  # a hung rank must not hang the suite
    guard.start()
    try:
        assert procs[0].stdout.readline().strip() == "computing step2", procs[0].communicate()[1]
        said = _said(procs[1])
        assert procs[1].returncode == 1 and "No space left on device" in said, said
        procs[0].send_signal(signal.SIGKILL)
        procs[0].communicate()
        left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("failed-*.json"))
        assert len(left) == 1 and (P.NEXT_TAG in left[0]) == resave, left
        procs = [_start(r, tmp_path, 2, resave) for r in (0, 1)]
        said2 = [_said(p) for p in procs]
    finally:
        guard.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert said2 == ["ok", "ok"], said2
    assert fastckpt.latest(str(tmp_path)) == f"{tmp_path}/step2"
    assert fastckpt.load(str(tmp_path / "step2" / "rank1.pt"))["launch"] == 2
