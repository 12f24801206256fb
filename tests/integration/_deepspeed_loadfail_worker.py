"""Run by test_deepspeed_loadfail.py as 2 plain processes (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT: no torchrun, whose agent would kill one rank as soon as the other exits), gloo,
DS_ACCELERATOR=cpu, ZeRO-3 with DeepSpeed's default persistence threshold (its load ends with a
gather of the persistent parameters on every rank: ``checkpoint_event_epilogue``).

Usage: _deepspeed_loadfail_worker.py ROOT SCENARIO. Tags t0 and t1 are saved, then a fresh engine
loads t1 and rank 1 only raises inside DeepSpeed's own load body, after fastckpt's pre-read and
agreement:
  customfn   rank 1's ``custom_load_fn`` (the user's function, which DeepSpeed calls with the
             module state) raises
  fp32route  the same under ``load_optimizer_states=False`` (the weights come from DeepSpeed's
             consolidation of every rank's files; the function runs inside its gather of the
             parameters)
  optimfile  t1 saved by DeepSpeed's own engine (no fastckpt manifest), rank 1's optimizer file
             then rewritten without its fp32 partition: a readable file that only DeepSpeed's
             optimizer load finds wrong
Every rank then loads t0 (collective: it returns only when every rank came there, in step),
prints "LOADED t0", and raises t1's error again: the process exits 1, its traceback on stderr.
"""

from __future__ import annotations

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed import comm as dist  # noqa: E402

from fastckpt.integrations.deepspeed import initialize  # noqa: E402
from tests.integration._ds_common import ds_config, full_weights, make_model, same, two_tags  # noqa: E402
from tests.integration._exit import leave  # noqa: E402


def engine(seed: int, fastckpt: bool = True):
    cfg = ds_config(3, {"commit_timeout_s": 60} if fastckpt else None)
    cfg["zero_optimization"].pop("stage3_param_persistence_threshold")  # every parameter persistent
    model = make_model(seed)
    init = initialize if fastckpt else deepspeed.initialize
    eng, _, _, _ = init(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), config=cfg)
    return eng


def fails_on_rank1(src: dict, dst: torch.nn.Module) -> None:
    """A user's custom_load_fn that raises on rank 1 only."""
    if dist.get_rank() == 1:
        raise ValueError("custom_load_fn refused the module state on rank 1")
    dst.load_state_dict(src)


def main(root: str, scenario: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    d = os.path.join(root, scenario)
    w = engine(0, fastckpt=scenario != "optimfile")
    t0_w = two_tags(w, d)
    if scenario == "optimfile" and dist.get_rank() == 0:
        path = os.path.join(d, "t1", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
        state = torch.load(path, weights_only=False)
        del state["optimizer_state_dict"]["fp32_flat_groups"]
        torch.save(state, path)
    dist.barrier()
    r = engine(1)
    kwargs = {"custom_load_fn": fails_on_rank1} if scenario in ("customfn", "fp32route") else {}
    if scenario == "fp32route":
        kwargs["load_optimizer_states"] = False
    try:
        r.load_checkpoint(d, "t1", **kwargs)
    except Exception:
        r.load_checkpoint(d, "t0")  # the fallback, on every rank together
        same(full_weights(r), t0_w, "weights after the fallback to t0")
        print(f"[rank={dist.get_rank()}] LOADED t0", flush=True)
        r.destroy()
        raise
    r.destroy()


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2])
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        leave(1)
    leave(0)
