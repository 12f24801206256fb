"""Lightning benchmark: the same training run with each CheckpointIO, in one invocation.

Run (from the repository root, with the project's venv):

    python benchmarks/lightning_bench.py [--steps 120] [--every 20] [--width 2048] [--depth 6]
                                         [--repeat 3] [--dir DIR] [--json OUT]

One ``Trainer.fit`` per variant, same model (an MLP, AdamW: weights are a third of each
checkpoint), same data, same ``ModelCheckpoint(every_n_train_steps=--every, save_top_k=2)``:

  none            no checkpoints (the baseline every fraction is taken of)
  torch           Lightning's TorchCheckpointIO (synchronous torch.save)
  async           Lightning's AsyncCheckpointIO around TorchCheckpointIO
  fastckpt        FastCkptIO (direct tier: straight to --dir, no burst buffer)
  fastckpt-lazy   FastCkptIO(lazy_snapshot=True)
  fastckpt-overlap  FastCkptIO(checkpointer=Checkpointer(overlap_write=True)): the writer starts
                  at the call and follows the copy (the default writes after it); its Checkpointer is closed
                  after the fit, outside the timing (FastCkptIO waits for a given one, not closes it)
  fastckpt-bb     FastCkptIO(local_dir=<--dir>/nvme): a burst buffer on the same disk, files
                  replicated to their paths in call order (replicate_in_order, FastCkptIO's default)
  fastckpt-bb-unordered  the same with Checkpointer(local_dir=..., replicate_policy="all",
                  replicate_in_order=False): what the ordering costs (it warns; not in the default run)

Variants are interleaved (none, torch, async, fastckpt, fastckpt-lazy, then the next round
rotated by one) for --warmup + --repeat rounds; warm-up rounds are discarded, tables show
medians of the rest.

  blocked    seconds the training thread spent inside the checkpoint plugin: its
             save_checkpoint and remove_checkpoint, its teardown (the final flush), and for
             FastCkptIO the work its callback does on the training thread (the lazy fence,
             handing metrics to the loggers, connecting, starting the staging reservation).
             Measured by wrapping those methods of the plugin object with perf_counter.
             Lightning's own dump_checkpoint (building the dict) is the same for every variant
             and is not counted.
  blocked %  blocked / the fastest "none" run (the least disturbed one: on a shared machine
             other jobs only ever add time): the figure that holds on a noisy machine.
  wall %     (median wall of the variant - fastest "none") / fastest "none"; noisy.
Lightning's plugins never fsync (their bytes may still be in the page cache when they return);
fastckpt's durable means fsynced. Both numbers are reported as measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("none", "torch", "async", "fastckpt", "fastckpt-lazy", "fastckpt-overlap")
EXTRA = ("fastckpt-bb", "fastckpt-bb-unordered")  # run with --variants


class Clock:
    """Sums the time spent in wrapped methods (the training thread calls them all)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.by_name: dict[str, float] = {}
        self.calls: dict[str, list[float]] = {}

    def wrap(self, obj: object, name: str) -> None:
        fn: Callable = getattr(obj, name)

        def timed(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.total += dt
                self.by_name[name] = self.by_name.get(name, 0.0) + dt
                self.calls.setdefault(name, []).append(dt)

        setattr(obj, name, timed)


def build(variant: str, clock: Clock, nvme: str) -> object | None:
    from lightning.fabric.plugins import TorchCheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from fastckpt import Checkpointer, FastCkptIO

    if variant == "none":
        return None
    if variant == "torch":
        io = TorchCheckpointIO()
    elif variant == "async":
        io = AsyncCheckpointIO(TorchCheckpointIO())
    else:
        if variant == "fastckpt-overlap":
            io = FastCkptIO(checkpointer=Checkpointer(overlap_write=True, replicate_policy="all"))
        elif variant == "fastckpt-bb":
            io = FastCkptIO(local_dir=nvme)
        elif variant == "fastckpt-bb-unordered":
            with warnings.catch_warnings():  # the warning this variant exists to measure against
                warnings.simplefilter("ignore")
                io = FastCkptIO(checkpointer=Checkpointer(local_dir=nvme, replicate_policy="all",
                                                          replicate_in_order=False))
        else:
            io = FastCkptIO(lazy_snapshot=variant == "fastckpt-lazy")
        for name in ("_fence", "_log_metrics", "_connect", "_install_deepspeed", "_reserve"):
            clock.wrap(io, name)
    for name in ("save_checkpoint", "remove_checkpoint", "teardown"):
        clock.wrap(io, name)
    return io


def run_once(variant: str, args: argparse.Namespace, root: str) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    sys.path.insert(0, str(REPO / "examples" / "lightning"))
    from train import MLP, data

    clock = Clock()
    nvme = tempfile.mkdtemp(prefix=f"lbench-nvme-{variant}-", dir=root)
    io = build(variant, clock, nvme)
    out = tempfile.mkdtemp(prefix=f"lbench-{variant}-", dir=root)
    callbacks = [] if variant == "none" else [
        ModelCheckpoint(dirpath=out, every_n_train_steps=args.every, save_top_k=2, monitor="step", mode="max")]
    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, plugins=[io] if io else None,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=variant != "none", callbacks=callbacks, num_sanity_val_steps=0)
    model = MLP(width=args.width, depth=args.depth)
    t0 = time.perf_counter()
    trainer.fit(model, data(n=64 * args.steps))  # one epoch, batch 64
    wall = time.perf_counter() - t0
    files = sorted(os.listdir(out))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in files) / max(1, len(files))
    shutil.rmtree(out, ignore_errors=True)
    stats = io.stats() if hasattr(io, "stats") else None
    if getattr(io, "_given", None) is not None:
        io._given.close()
    shutil.rmtree(nvme, ignore_errors=True)
    return {"variant": variant, "wall_s": wall, "blocked_s": clock.total, "parts": clock.by_name,
            "save_calls_ms": [round(1e3 * x, 1) for x in clock.calls.get("save_checkpoint", [])],
            "files": files, "ckpt_bytes": size,
            "fastckpt_overhead": stats.overhead if stats is not None else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and discarded")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--dir", default=str(REPO.parent / "bench_tmp"),
                    help="where checkpoints go (a real disk: /tmp may be tmpfs, which is RAM)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import logging

    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.utilities.rank_zero",
                 "lightning.fabric.utilities.registry", "fastckpt"):  # the alarm is not news here
        logging.getLogger(name).setLevel(logging.ERROR)
    os.makedirs(args.dir, exist_ok=True)
    variants = args.variants.split(",")
    if unknown := sorted(set(variants) - set(VARIANTS + EXTRA)):
        ap.error(f"unknown variant(s) {', '.join(unknown)}: pick from {', '.join(VARIANTS + EXTRA)}")
    if "none" not in variants:
        variants.insert(0, "none")

    runs: list[dict] = []
    for r in range(args.warmup + args.repeat):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            res = run_once(v, args, args.dir)
            if r >= args.warmup:
                runs.append(res)
            label = "warm-up" if r < args.warmup else f"round {r - args.warmup + 1}/{args.repeat}"
            print(f"{label} {v:>14}: wall {res['wall_s']:6.2f} s, blocked {res['blocked_s']:6.3f} s "
                  f"{ {k: round(x, 3) for k, x in res['parts'].items()} } saves (ms): {res['save_calls_ms']}",
                  flush=True)

    base = min(x["wall_s"] for x in runs if x["variant"] == "none")
    size = max(x["ckpt_bytes"] for x in runs)
    print(f"\n{args.steps} steps, a checkpoint every {args.every} ({args.steps // args.every} saves, "
          f"{size / 1e6:.0f} MB each); run without checkpoints: {base:.2f} s (fastest of {args.repeat})")
    print(f"{'variant':>14} {'blocked s':>10} {'blocked %':>10} {'wall s':>8} {'wall %':>8}")
    table = {}
    for v in variants:
        mine = [x for x in runs if x["variant"] == v]
        blocked = statistics.median(x["blocked_s"] for x in mine)
        wall = statistics.median(x["wall_s"] for x in mine)
        table[v] = {"blocked_s": blocked, "blocked_pct": 100 * blocked / base, "wall_s": wall,
                    "wall_pct": 100 * (wall - base) / base}
        pct, wall_pct = 100 * blocked / base, 100 * (wall - base) / base
        print(f"{v:>14} {blocked:>10.3f} {pct:>9.2f}% {wall:>8.2f} {wall_pct:>7.1f}%")

    for v in ("fastckpt", "fastckpt-lazy", "fastckpt-overlap"):  # issue #16's targets
        if v in table and "async" in table:
            b, a = table[v]["blocked_pct"], table["async"]["blocked_pct"]
            ok = b < 0.5 and b <= 0.25 * a
            print(f"target {v}: blocked {b:.2f}% < 0.5% and <= 0.25 x AsyncCheckpointIO's ({a:.2f}%; ratio "
                  f"{b / a:.2f}): {'PASS' if ok else 'MISS'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "table": table, "baseline_wall_s": base}, f, indent=1)


if __name__ == "__main__":
    main()
