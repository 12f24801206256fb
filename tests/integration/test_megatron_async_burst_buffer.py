"""Megatron's async save waits for the commit, whose copy home (with a burst buffer) and this
rank's own write (without one) ``commit_timeout_s`` does not bound.

The async part (``AsyncRequest.execute_sync``, or megatron's async worker) gave up after
``commit_timeout_s + 30`` s with ``CommitTimeoutError: ... some rank did not finish its part``,
while every rank had finished and the commit only waited for the copy to the home; the same save
then committed, but megatron had skipped its finalize and Megatron-LM's tracker write. Here the
grace is 0 and ``commit_timeout_s`` 1 s: the old deadline passes while the copy home (or, without
a burst buffer, the rank's own tensor file write: fixed later) is held.
Real megatron-core, gloo, one process (a child: it owns the process group; forked by the
session's ``megatron_python`` server, tests/integration/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from tests.integration._fork_server import ForkServer  # noqa: E402

CHILD = r"""
import os, sys, threading, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedTensor
import fastckpt
from fastckpt.integrations import megatron as fm
from fastckpt.io.atomic import final_path
from fastckpt.testing import FaultyOps

root, held = sys.argv[1], sys.argv[2]
home = os.path.join(root, "home")
ckpt = os.path.join(home, "iter_0000001")
os.makedirs(ckpt)
entered, release = threading.Event(), threading.Event()

def hold(op, path):  # the copy to the durable home (or the write itself) waits for `release`
    if op == "pwrite" and (path.startswith(home + os.sep) if held == "copy" else
                           "fastckpt-rank00000" in (final_path(path) or path)) \
            and not release.is_set():
        entered.set()
        assert release.wait(120)

fm.ASYNC_GRACE_S = 0.0
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(root, ".store"), 1), rank=0, world_size=1)
ck = fastckpt.Checkpointer(local_dir=os.path.join(root, "nvme") if held == "copy" else None,
                           ops=FaultyOps(on_call=hold), commit_timeout_s=1.0, overhead_budget=0.99)
save, _ = fm.register(ck)
req = dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(256, 64)), "iteration": 1}, ckpt,
              ("fastckpt", 1), async_sharded_save=True)
outcome = []

def run():
    try:
        req.execute_sync()
        outcome.append("ok")
    except Exception as exc:
        outcome.append(repr(exc))

t = threading.Thread(target=run, daemon=True)
t.start()
assert entered.wait(60), "the held write never started"
t.join(3)  # three times the deadline the async part had before
early = list(outcome)
release.set()
t.join(120)
print("EARLY", early, "OUTCOME", outcome, "LATEST", fastckpt.latest(home) == ckpt, flush=True)
ck.close()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("held", ["copy", "write"])
def test_the_async_part_waits_for_the_copy_home_and_the_write(megatron_python: ForkServer, tmp_path: Path,
                                                             held: str) -> None:
    res = megatron_python.run_code(CHILD, [str(tmp_path), held], 300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "EARLY [] OUTCOME ['ok'] LATEST True" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
