"""A ShardedObject that weights_only refuses (a ``fractions.Fraction``, not on torch's allow list).

Before, ``dist_checkpointing.load`` raised torch's UnpicklingError with a note to load the objects
file "with weights_only=False": a torch.load call the caller never made, naming neither the
ShardedObject nor how to pass that to megatron. The error now names both; the fix it names loads
the object. Real megatron-core, gloo, one process (a child: it owns the process group)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

CHILD = r"""
import fractions, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
import fastckpt
from fastckpt.integrations import megatron as fm

ck_dir = sys.argv[1]
dist.init_process_group("gloo", store=dist.FileStore(ck_dir + ".store", 1), rank=0, world_size=1)
ck = fastckpt.Checkpointer()
fm.register(ck)


def state(obj):
    return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4)),
            "rng": ShardedObject("rng_state", obj, (1,), (0,), replica_id=0)}


dc.save(state(fractions.Fraction(1, 3)), ck_dir, ("fastckpt", 1))
try:
    dc.load(state(None), ck_dir)
except Exception as exc:
    print("REFUSED", type(exc).__name__, str(exc), flush=True)
got = dc.load(state(None), ck_dir, sharded_strategy=fm.FastCkptLoadStrategy(ck, weights_only=False))
print("LOADED", got["rng"], flush=True)
ck.close()
dist.destroy_process_group()
"""


def test_a_refused_sharded_object_names_its_key_and_the_fix(tmp_path, megatron_python) -> None:
    ck_dir = tmp_path / "iter_0000001"
    ck_dir.mkdir()
    res = megatron_python.run_code(CHILD, [str(ck_dir)], 300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    lines = {ln.split(" ", 1)[0]: ln for ln in res.stdout.splitlines() if ln.startswith(("REFUSED", "LOADED"))}
    refused = lines["REFUSED"]
    assert refused.startswith(f"REFUSED UnpicklingError ShardedObject 'rng_state' cannot be loaded from "
                              f"{ck_dir / 'fastckpt-objects-rank00000.pt'}: it holds an object that weights_only=True "
                              "refuses (Unsupported global: GLOBAL fractions.Fraction"), refused
    assert refused.endswith("If you trust this checkpoint, load it with dist_checkpointing.load(..., sharded_strategy="
                            "FastCkptLoadStrategy(checkpointer, weights_only=False)), or allow the type first with "
                            "torch.serialization.add_safe_globals([...])"), refused
    assert lines["LOADED"] == "LOADED 1/3"  # the fix it names works
