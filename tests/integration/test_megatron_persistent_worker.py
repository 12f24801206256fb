"""Megatron async saves through megatron-core's persistent checkpoint worker
(``AsyncCallsQueue(persistent=True)``: Megatron-LM's ``--async-save --use-persistent-ckpt-worker``).

megatron-core 0.16.1's ``PersistentAsyncCaller.async_loop`` catches nothing. Our ``async_fn``
(``await_commit``) raised in that spawned worker when a save failed, or merely outlasted the
worker's deadline: the worker died, the save was never finalized (its error never reached the
training thread), no later save was finalized either, and the blocking finalize at exit waited
for ever. Now the worker returns and the finalize step raises the save's error on the training
thread; a save that commits after the worker's deadline finalizes as committed.

Real megatron-core, gloo, one rank (a child: it owns the process group). The queue's CUDA-only
calls are stood in for: ``device_count``/``set_device`` in the spawned worker (a sitecustomize on
its PYTHONPATH), ``current_device``/``synchronize`` in the training process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

STANDIN = textwrap.dedent("""
    import os
    if os.environ.get("FASTCKPT_TEST_CUDA_STANDIN") == "1":
        import torch
        torch.cuda.device_count = lambda: 1
        torch.cuda.set_device = lambda *a, **k: None
""")

CHILD = r"""
import errno, os, sys, threading, warnings
from multiprocessing.connection import wait as mp_wait
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
import fastckpt
from fastckpt.integrations import megatron as fm
from fastckpt.io.atomic import final_path
from fastckpt.testing import Fault, FaultyOps

root, scenario = sys.argv[1], sys.argv[2]
release = threading.Event()

def hold(op, path):  # the slow scenario: iteration 2's tensor file is written once `release` is set
    if scenario == "slow" and op == "pwrite" and "iter_0000002" in path \
            and "fastckpt-rank00000" in (final_path(path) or path):
        assert release.wait(120)

dist.init_process_group("gloo", store=dist.FileStore(os.path.join(root, ".store"), 1), rank=0, world_size=1)
ops = FaultyOps(on_call=hold)
fm.ASYNC_GRACE_S = 0.0  # the worker's deadline: commit_timeout_s
ck = fastckpt.Checkpointer(ops=ops, commit_timeout_s=1.0 if scenario == "slow" else 30.0, overhead_budget=0.99)
fm.register(ck, ops=ops)
queue = AsyncCallsQueue(persistent=True)

def schedule(n):
    path = os.path.join(root, f"iter_{n:07d}")
    os.makedirs(path, exist_ok=True)
    queue.schedule_async_request(dc.save(
        {"w": ShardedTensor.from_rank_offsets("w", torch.full((256, 64), float(n)))}, path, ("fastckpt", 1),
        async_sharded_save=True))

def worker_reported():  # the worker put the call on its completion queue (without taking it off), or died
    caller = queue.persistent_caller  # (the queue's pipe turns readable, or the process's sentinel does)
    ready = mp_wait([caller.comp_q._reader, caller.process.sentinel], timeout=120)
    return caller.comp_q._reader in ready

def finalize():  # maybe_finalize_async_calls(blocking=True) spins for ever once the worker is dead
    if not worker_reported():
        print("WORKER DIED", queue.persistent_caller.process.exitcode, flush=True)
        queue.persistent_caller.process.kill()
        os._exit(1)  # the queue's close() would wait on the dead worker for ever
    return queue.maybe_finalize_async_calls(blocking=True, no_dist=True)

schedule(1)
print("FINALIZED 1", finalize(), flush=True)
if scenario == "failed":  # iteration 2's group manifest cannot be published
    ops.inject(Fault("replace", errno.EIO, path_contains="iter_0000002/fastckpt-manifest"))
schedule(2)
if scenario == "slow" and not worker_reported():  # its deadline passed while the write was held
    print("WORKER DIED", queue.persistent_caller.process.exitcode, flush=True)
    os._exit(1)
release.set()
try:
    print("FINALIZED 2", finalize(), flush=True)
except Exception as exc:
    print("RAISED 2", threading.current_thread() is threading.main_thread(), type(exc).__name__, exc, flush=True)
schedule(3)
print("FINALIZED 3", finalize(), "TRACKER", fm.read_tracker(root), flush=True)
queue.close()
try:
    ck.close()
except fastckpt.CheckpointWriteError:  # iteration 2's failure, raised once more at close
    pass
dist.destroy_process_group()
"""


def _run(tmp_path: Path, scenario: str) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(STANDIN)
    path = [str(site)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, FASTCKPT_TEST_CUDA_STANDIN="1", PYTHONPATH=os.pathsep.join(path))
    res = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), scenario], capture_output=True, text=True,
                         env=env, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res


def test_a_failed_save_is_raised_at_finalize_and_the_worker_lives_on(tmp_path: Path) -> None:
    res = _run(tmp_path, "failed")
    out = res.stdout
    assert "FINALIZED 1 [0]" in out
    # the save's own error, on the training thread, from megatron's finalize step
    assert "RAISED 2 True ReplicationError" in out and "Input/output error" in out, out + res.stderr[-3000:]
    assert "FINALIZED 3 [2] TRACKER 3" in out, out + res.stderr[-3000:]
    # the worker's warning names the failed rank as its own, not as "another rank"
    assert "failed on this rank (0)" in res.stderr and "another rank" not in res.stderr, res.stderr[-3000:]


def test_a_save_that_commits_after_the_workers_deadline_finalizes(tmp_path: Path) -> None:
    res = _run(tmp_path, "slow")
    out = res.stdout
    assert "FINALIZED 1 [0]" in out
    assert "FINALIZED 2 [1]" in out and "RAISED" not in out, out + res.stderr[-3000:]
    assert "FINALIZED 3 [2] TRACKER 3" in out, out + res.stderr[-3000:]
    assert "was not committed within 1 s" in res.stderr, res.stderr[-3000:]
