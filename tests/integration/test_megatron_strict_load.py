"""A load with one of megatron's non-default ``strict`` modes keeps the common loader's note.

megatron-core 0.16.1's ``dist_checkpointing.load(..., strict=X)`` (Megatron-LM's
``--dist-ckpt-strictness``) checks the sharded backend again after ``load_common`` and reads the
sharded metadata: the check erased the note of which save ``common.pt`` was read from, so a
``common.pt`` rewritten by a save under way (or deleted) was reported as damage, with advice to put
it back over that save, and a save swapped in after megatron read ``common.pt`` loaded mixed,
without an error. Real megatron-core, gloo, one process (a child: it owns the process group)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

CHILD = r"""
import json, os, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
from megatron.core.dist_checkpointing.validation import StrictHandling
import fastckpt
from fastckpt.integrations import megatron as fm
from fastckpt.integrations._megatron import commonload

root = sys.argv[1]
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(root, ".s"), 1), rank=0, world_size=1)
ck = fastckpt.Checkpointer()
_, base = fm.register(ck)
ck_dir = os.path.join(root, "iter_0000005")
os.makedirs(ck_dir)
state = lambda v: {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 6), float(v))), "iteration": v}
request = lambda: {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6))}
common = os.path.join(ck_dir, "common.pt")
out = {}

def load(key, strict, **kw):
    try:
        got = dc.load(request(), ck_dir, strict=strict, **kw)
        got = got[0] if isinstance(got, tuple) else got
        out[key] = [got["iteration"], float(got["w"][0, 0])]
    except Exception as exc:
        out[key] = [type(exc).__name__, str(exc)[:200]]

class TwoCalls(type(base)):  # as FullyParallelLoadStrategyWrapper: objects, then tensors
    swap = False
    def load(self, sharded_state_dict, checkpoint_dir):
        base.load({}, checkpoint_dir)
        if self.swap:
            dc.save(state(3), ck_dir, ("fastckpt", 1))
        return base.load(sharded_state_dict, checkpoint_dir)

dc.save(state(1), ck_dir, ("fastckpt", 1))
committed = open(common, "rb").read()
for strict in (StrictHandling.ASSUME_OK_UNEXPECTED, StrictHandling.RAISE_ALL, StrictHandling.LOG_ALL,
               StrictHandling.RETURN_ALL):
    torch.save({"iteration": 9}, common)  # a save into iteration 5 under way in another job
    load(f"rewritten {strict.name}", strict)
    os.remove(common)
    load(f"deleted {strict.name}", strict)
    open(common, "wb").write(committed)
    dc.load_common_state_dict(ck_dir)  # as Megatron-LM does first: its note must not outlive this load
    load(f"their common loader {strict.name}", strict, common_strategy=TorchCommonLoadStrategy())
    load(f"two calls {strict.name}", strict, sharded_strategy=TwoCalls(ck))

for strict in (StrictHandling.ASSUME_OK_UNEXPECTED, StrictHandling.RAISE_ALL):
    dc.save(state(1), ck_dir, ("fastckpt", 1))
    orig = commonload.FastCkptCommonLoadStrategy.load_common
    def swapped(self, d):
        got = orig(self, d)
        commonload.FastCkptCommonLoadStrategy.load_common = orig
        dc.save(state(2), ck_dir, ("fastckpt", 1))  # another job re-saves iteration 5 and commits
        return got
    commonload.FastCkptCommonLoadStrategy.load_common = swapped
    load(f"swapped after common.pt {strict.name}", strict)
    commonload.FastCkptCommonLoadStrategy.load_common = orig
    dc.save(state(1), ck_dir, ("fastckpt", 1))
    swapping = TwoCalls(ck)
    swapping.swap = True
    load(f"swapped between two calls {strict.name}", strict, sharded_strategy=swapping)
print("RESULT " + json.dumps(out), flush=True)
ck.close()
dist.destroy_process_group()
"""

STRICT = ["ASSUME_OK_UNEXPECTED", "RAISE_ALL", "LOG_ALL", "RETURN_ALL"]


@pytest.fixture(scope="module")
def loads(tmp_path_factory, megatron_python) -> dict:
    root: Path = tmp_path_factory.mktemp("strict-load")
    res = megatron_python.run_code(CHILD, [str(root)], 400)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, res.stdout[-3000:] + res.stderr[-5000:]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("strict", STRICT)
def test_a_common_pt_rewritten_or_deleted_loads_the_committed_save_in_every_strict_mode(loads, strict) -> None:
    # was (any strict mode but the default): CorruptCheckpointError "... Put it back with repair_checkpoint"
    assert loads[f"rewritten {strict}"] == [1, 1.0], loads
    assert loads[f"deleted {strict}"] == [1, 1.0], loads


@pytest.mark.parametrize("strict", STRICT)
def test_the_note_lives_for_one_load_and_through_two_sharded_calls_in_every_strict_mode(loads, strict) -> None:
    assert loads[f"their common loader {strict}"] == [1, 1.0], loads  # no stale note: no false GroupChangedError
    assert loads[f"two calls {strict}"] == [1, 1.0], loads


@pytest.mark.parametrize("strict", ["ASSUME_OK_UNEXPECTED", "RAISE_ALL"])
def test_a_resave_swapped_in_after_megatron_read_common_pt_is_refused_in_every_strict_mode(loads, strict) -> None:
    # was (RAISE_ALL): iteration 1's common state with step 2's tensors, and no error
    assert loads[f"swapped after common.pt {strict}"][0] == "GroupChangedError", loads
    assert loads[f"swapped between two calls {strict}"][0] == "GroupChangedError", loads
