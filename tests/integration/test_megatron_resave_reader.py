"""Another job loading an iteration while it is saved again: megatron rewrites ``common.pt`` in
place before our strategy runs, so the reader found it changed and was told the checkpoint was
damaged, and to run ``repair_checkpoint`` (which then wrote the old bytes over the re-save in
flight). It now reads the committed ``common.pt`` kept in the group's index and loads the
committed save; after the re-save commits, it loads the new one. Real megatron-core, gloo; the
reader is a process of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

READER = r"""
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedTensor
from fastckpt.integrations import megatron as fm  # registers the strategies

ck_dir, store = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
try:
    got = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(64, 64))}, ck_dir)
    print("READ", got["iteration"], float(got["w"][0, 0]), flush=True)
except Exception as exc:
    print("READ", type(exc).__name__, str(exc)[:300], flush=True)
"""

SAVER = r"""
import os, subprocess, sys, threading, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedTensor
import fastckpt
from fastckpt.integrations import megatron as fm
from fastckpt.io.atomic import final_path
from fastckpt.testing import FaultyOps

root, reader = sys.argv[1], sys.argv[2]
ck_dir = os.path.join(root, "iter_0000005")
os.makedirs(ck_dir)
entered, release, armed = threading.Event(), threading.Event(), threading.Event()

def hold(op, path):  # the re-save's tensor file is held while the other job reads
    if armed.is_set() and op == "pwrite" and "fastckpt-rank00000" in (final_path(path) or path) \
            and not release.is_set():
        entered.set()
        assert release.wait(120)

dist.init_process_group("gloo", store=dist.FileStore(os.path.join(root, ".s"), 1), rank=0, world_size=1)
ck = fastckpt.Checkpointer(ops=FaultyOps(on_call=hold), overhead_budget=0.99)
fm.register(ck)
state = lambda v: {"w": ShardedTensor.from_rank_offsets("w", torch.full((64, 64), float(v))), "iteration": v}
dc.save(state(1), ck_dir, ("fastckpt", 1))
armed.set()
req = dc.save(state(2), ck_dir, ("fastckpt", 1), async_sharded_save=True)  # common.pt rewritten by now
assert entered.wait(60)

def read(tag):
    r = subprocess.run([sys.executable, "-c", reader, ck_dir, os.path.join(root, f".r{tag}")], capture_output=True,
                       text=True, timeout=120)
    return next((x for x in r.stdout.splitlines() if x.startswith("READ")), "READ none " + r.stderr[-300:])

print("DURING", read(1), flush=True)
release.set()
req.execute_sync()
print("AFTER", read(2), flush=True)
ck.close()
dist.destroy_process_group()
"""


def test_another_job_reading_during_a_resave_loads_the_committed_save(tmp_path: Path, megatron_python) -> None:
    res = megatron_python.run_code(SAVER, [str(tmp_path), READER], 400)
    out = res.stdout + res.stderr[-3000:]
    assert res.returncode == 0, out
    assert "DURING READ 1 1.0" in res.stdout, out  # was: CorruptCheckpointError "... Put it back with ..."
    assert "AFTER READ 2 2.0" in res.stdout, out
