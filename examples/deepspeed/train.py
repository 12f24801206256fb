"""DeepSpeed (ZeRO-2) + fastckpt on the CPU: 2 processes, a checkpoint every N steps.

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/deepspeed/train.py \
        --config examples/deepspeed/ds_config.json --save-dir /tmp/fastckpt-example/ckpt

(or ``DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/deepspeed/train.py ...``)

The one fastckpt line is the import of ``initialize``; the ``"fastckpt"`` section of
ds_config.json does the rest. Run it twice: the second run resumes from the newest complete
checkpoint (``engine.load_checkpoint(save_dir)``). Rank 0 prints one line per checkpoint (the
integration logs it through DeepSpeed's logger, shown here at INFO) and the overhead at the end.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
from deepspeed.utils import logger as ds_logger

from fastckpt.integrations.deepspeed import initialize  # instead of: from deepspeed import initialize


def show_fastckpt_lines() -> None:
    """DeepSpeed logs at WARNING by default; let fastckpt's INFO lines through, not DeepSpeed's."""
    ds_logger.setLevel(logging.INFO)
    for handler in ds_logger.handlers:
        handler.setLevel(logging.INFO)
        handler.addFilter(lambda r: r.levelno >= logging.WARNING or r.getMessage().startswith("fastckpt:"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json"))
    p.add_argument("--save-dir", default="/tmp/fastckpt-example/ckpt")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    args = p.parse_args()
    show_fastckpt_lines()

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, args.width), torch.nn.GELU()]
    for _ in range(2):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1))
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=args.config)

    path, client_state = engine.load_checkpoint(args.save_dir)  # the newest complete tag, if any
    if engine.global_rank == 0:
        print(f"resumed from {path} at step {engine.global_steps}" if path else "starting from scratch")

    t0 = time.monotonic()
    while engine.global_steps < (client_state or {}).get("step", 0) + args.steps:
        g = torch.Generator().manual_seed(engine.global_steps * 10 + engine.global_rank)
        x = torch.randn(16, 64, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), x.sum(dim=1, keepdim=True).tanh())
        engine.backward(loss)
        engine.step()
        if engine.global_steps % args.every == 0:
            # returns after the snapshot
            engine.save_checkpoint(args.save_dir, client_state={"step": engine.global_steps})
    wall = time.monotonic() - t0
    stats = engine.checkpoint_engine.checkpointer.stats()
    engine.destroy()  # waits until every checkpoint is durable
    if engine.global_rank == 0:
        print(f"{args.steps} steps in {wall:.1f} s; {stats.saves} files saved, training blocked "
              f"{stats.blocked_s:.3f} s by snapshots ({stats.overhead:.2%} of wall time, budget "
              f"{stats.overhead_budget:.0%}); latest -> {open(os.path.join(args.save_dir, 'latest')).read()}")


if __name__ == "__main__":
    main()
