"""A ShardedObject that weights_only refuses (a ``fractions.Fraction``, not on torch's allow list).

Before, ``dist_checkpointing.load`` raised torch's UnpicklingError with a note to load the objects
file "with weights_only=False": a torch.load call the caller never made, naming neither the
ShardedObject nor how to pass that to megatron. The error now names both; the fix it names loads
the object. Real megatron-core, gloo, one process (a child: it owns the process group)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from tests.integration._megatron_one_rank import PREAMBLE  # noqa: E402

CHILD = PREAMBLE + r"""


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


RESHARDED = PREAMBLE + r"""


def state(n, a, b):
    return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4)),
            "opt": ShardedObject("opt_extra", a, (1,), (0,), replica_id=0),
            "rank_obj": ShardedObject("rank_obj", b, (n,), (0,), replica_id=0)}


dc.save(state(1, {"lr": 1.0}, {"seed": 1}), ck_dir, ("fastckpt", 1))
try:  # one rank's view of a load with a changed data-parallel size
    dc.load(state(2, None, None), ck_dir, validate_access_integrity=False)
except Exception as exc:
    print("REFUSED", type(exc).__name__, str(exc), flush=True)
ck.close()
dist.destroy_process_group()
"""


def test_an_object_saved_in_another_layout_beside_a_loadable_one_is_named(tmp_path, megatron_python) -> None:
    """The refusal above gathered the keys of an objects file with ``index.objects[key]`` over every
    wanted object, before the check that names one missing from the save: a rank whose object was
    saved as 1 shard and is asked for as 2 died with a bare KeyError, not the ReshardingError."""
    ck_dir = tmp_path / "iter_0000001"
    ck_dir.mkdir()
    res = megatron_python.run_code(RESHARDED, [str(ck_dir)], 300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    refused = next(ln for ln in res.stdout.splitlines() if ln.startswith("REFUSED"))
    assert refused == ("REFUSED ReshardingError ShardedObject 'rank_obj' cannot be loaded as rank_obj/shard_0_2: saved "
                       "as ['rank_obj/shard_0_1']. Objects are not resharded; load with the layout they were saved "
                       "with"), refused
