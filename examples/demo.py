"""`make demo`: a small CPU training loop that checkpoints through fastckpt.

Trains an MLP on synthetic data, saves model + optimizer + step every few steps into a local
directory (the embedded default: the direct tier), then prints one row per save and the
run's checkpoint overhead, and finally restores the newest checkpoint and checks it.

    python examples/demo.py [--dir demo_ckpt] [--steps 60] [--every 10] [--local-dir DIR]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time

import torch
from torch import nn

import fastckpt


def make_model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="demo_ckpt", help="where checkpoints end up (durable home)")
    ap.add_argument("--local-dir", default=None, help="optional burst buffer (nvme tier)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--width", type=int, default=1536)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    torch.manual_seed(0)
    model = make_model(args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, args.width), torch.randint(0, 10, (256,))
    handles = []
    t0 = time.perf_counter()
    with fastckpt.Checkpointer(local_dir=args.local_dir, event_log=os.path.join(args.dir, "events.jsonl")) as ck:
        for step in range(1, args.steps + 1):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % args.every == 0:
                state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
                handles.append(ck.save(state, f"{args.dir}/step-{step:05d}.pt"))
        records = [h.wait() for h in handles]
        wall = time.perf_counter() - t0
        stats = ck.stats()
        print(f"\n{'file':<20} {'blocked ms':>10} {'durable ms':>10} {'MB':>8} {'GB/s':>6}  tier")
        for r in records:
            print(f"{r.path.rsplit('/', 1)[-1]:<20} {r.blocked_s * 1e3:>10.1f} {r.durable_s * 1e3:>10.1f} "
                  f"{r.bytes / 1e6:>8.1f} {r.write_GBps:>6.2f}  {r.tier}{'' if r.odirect else ' (buffered)'}")
        print(f"\n{len(records)} saves in a {wall:.1f} s run: blocked {stats.blocked_s:.3f} s in total, "
              f"checkpoint overhead {stats.overhead:.2%} of wall time (budget {stats.overhead_budget:.0%}"
              f"{', EXCEEDED' if stats.over_budget else ''})")
        newest = fastckpt.latest(args.dir)
        t = time.perf_counter()
        restored = ck.load(newest)
        ok = all(torch.equal(restored["model"][k], v) for k, v in model.state_dict().items())
        print(f"restored {newest} in {(time.perf_counter() - t) * 1e3:.0f} ms "
              f"(step {restored['step']}, weights {'match' if ok else 'DIFFER'})")
        if not ok:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
