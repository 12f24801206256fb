"""A Megatron load looks each saved shard's storage record up without walking the file's zip
records again.

Every shard's lookup scanned all of its file's records (twice per shard), so a load took time
quadratic in the tensors of one rank's file: 4000 took 13-28 s where 1000 took under 1 s, and
megatron's distributed optimizer puts thousands of ShardedTensors in one file. Timing is too
noisy to test here, so the test counts the walks of each file's record list (the real list,
from the real ``VerifiedFile.records``). Real megatron-core, gloo, one process (a child: it owns
the process group)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

TENSORS = 2000

CHILD = r"""
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedTensor
import fastckpt
from fastckpt.integrations import megatron as fm
from fastckpt.integrations._megatron import read

root, n = sys.argv[1], int(sys.argv[2])
walks = {}

class Counted(dict):  # the records VerifiedFile.records read, counting each walk over them
    def _walk(self, how):
        walks[self.path] = walks.get(self.path, 0) + 1
        return how(self)
    def items(self):
        return self._walk(dict.items)
    def keys(self):
        return self._walk(dict.keys)
    def values(self):
        return self._walk(dict.values)
    def __iter__(self):
        return self._walk(dict.__iter__)

real_records = read.VerifiedFile.records

def records(self, pool):
    out = Counted(real_records(self, pool))
    out.path = os.path.basename(self.path)
    return out

read.VerifiedFile.records = records
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(root, ".store"), 1), rank=0, world_size=1)
ck = fastckpt.Checkpointer(overhead_budget=0.99)
_, load = fm.register(ck)
d = os.path.join(root, "iter_0000001")
os.makedirs(d)
dc.save({f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((4,), float(i))) for i in range(n)}, d,
        ("fastckpt", 1))
got = dc.load({f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.empty(4)) for i in range(n)}, d)
wrong = [i for i in range(n) if not torch.equal(got[f"t{i}"], torch.full((4,), float(i)))]
print("WRONG", wrong[:5], "FILES", load.last_load.files, "WALKS", sorted(walks.items()), flush=True)
ck.close()
dist.destroy_process_group()
"""


def test_a_file_of_many_tensors_has_its_records_walked_once(tmp_path: Path, megatron_python) -> None:
    res = megatron_python.run_code(CHILD, [str(tmp_path), str(TENSORS)], 300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("WRONG")), res.stdout[-3000:])
    # one rank: all the tensors in one file, its records walked once (were: twice per tensor)
    assert line == "WRONG [] FILES 1 WALKS [('fastckpt-rank00000.pt', 1)]", line
