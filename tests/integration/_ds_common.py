"""What the DeepSpeed test workers share: a small model, deterministic data, configs, and
bit-exact comparisons. Imported by scripts that torchrun starts (CPU, gloo, DS_ACCELERATOR=cpu)."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch

from fastckpt.integrations.deepspeed import initialize
from tests.integration._trees import tree_equal as same  # noqa: F401 (the workers' name for it)

WIDTH = 64


def make_model(seed: int, width: int = WIDTH) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))


def ds_config(stage: int, fastckpt: dict | None = None, **extra: object) -> dict:
    cfg: dict = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                 "zero_allow_untested_optimizer": True,
                 "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 0.01}},
                 "checkpoint": {"tag_validation": "FAIL"}}
    if fastckpt is not None:
        cfg["fastckpt"] = fastckpt
    cfg.update(extra)
    return cfg


def engine(stage: int, fastckpt: dict | None, seed: int = 0, width: int = WIDTH, use_fastckpt_initialize: bool = True,
           **extra: object):
    """A DeepSpeedEngine over a fresh model (Adam as a client optimizer, WarmupLR from the config)."""
    model = make_model(seed, width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    init = initialize if use_fastckpt_initialize else deepspeed.initialize
    eng, _, _, _ = init(model=model, optimizer=opt, config=ds_config(stage, fastckpt, **extra))
    return eng


def train(eng, first: int, last: int) -> None:
    """Steps ``first``..``last`` (inclusive); each step's batch depends on the step and rank only."""
    for step in range(first, last + 1):
        g = torch.Generator().manual_seed(1000 * step + eng.global_rank)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
        loss = torch.nn.functional.mse_loss(eng(x), y)
        eng.backward(loss)
        eng.step()


def two_tags(eng, d: str) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Train and save tag t0, train on and save t1, destroy the engine; every rank then meets.
    Returns t0's full weights (what a fallback load of t0 must give back)."""
    from deepspeed import comm as dist

    train(eng, 1, 1)
    eng.save_checkpoint(d, "t0")
    t0 = full_weights(eng)
    train(eng, 2, 2)
    eng.save_checkpoint(d, "t1")
    eng.destroy()
    dist.barrier()
    return t0


def full_weights(eng) -> dict[str, torch.Tensor]:
    """Every parameter, whole (gathered under ZeRO-3), cloned."""
    params = list(eng.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().clone() for n, p in eng.module.named_parameters()}


def frozen(obj: object) -> object:
    """A copy of a state dict that later training cannot change (tensors cloned)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((k, frozen(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(frozen(v) for v in obj)
    return copy.deepcopy(obj)
