"""GPU checks for the CUDA staging path and the GDS tier, in one short run (< 5 min).

Run on a machine with an NVIDIA GPU (the device tool runs it there):
    python benchmarks/gpu_check.py [--size 2GiB] [--dir /local_nvme/fastckpt-gpu]
It prints one line per check with PASS/FAIL and the numbers, and exits non-zero on a FAIL.
Checks: (1) CUDA state -> pinned staging on a side stream: round trip, and a kernel that
mutates the weights right after save() returns does not change the file; blocked time
against a plain D2H copy into pinned memory (the floor); (2) the tier auto picks, with its
reasons, and whether kvikio runs in compat mode; (3) if GDS is usable, a gds-tier save and a
verified load; (4) load with map_location="cuda".
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

import fastckpt
from fastckpt.save.tiers import gds_unavailable_reason

failures = 0


def check(name: str, ok: bool, detail: str) -> None:
    global failures
    failures += not ok
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)


def parse_size(s: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * m)
    return int(s)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here")
        return 0
    size = parse_size(args.size)
    root = tempfile.mkdtemp(prefix="fastckpt-gpu-", dir=args.dir)
    try:
        n = size // 4 // 8
        state = {f"layer{i}": torch.randn(n, device="cuda") for i in range(8)}
        ref = {k: v.cpu() for k, v in state.items()}
        floor_buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        flat = torch.cat([v.view(torch.uint8) for v in state.values()])
        for _ in range(2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            floor_buf[: flat.numel()].copy_(flat, non_blocking=True)
            torch.cuda.synchronize()
            floor = time.perf_counter() - t
        del flat
        with fastckpt.Checkpointer(tier="direct") as ck:
            for i in range(3):
                path = os.path.join(root, f"cuda{i}.pt")
                h = ck.save(state, path)
                for v in state.values():  # a kernel on the current stream right after return
                    v.add_(1.0)
                rec = h.wait()
                for v in state.values():
                    v.sub_(1.0)
            out = ck.load(path)
            same = all(torch.equal(out[k], ref[k]) for k in ref)
            check("cuda staging round trip, mutation after save", same,
                  f"blocked {rec.blocked_s * 1e3:.1f} ms (CPU returns before the copy lands), "
                  f"durable {rec.durable_s:.2f} s, D2H floor {floor * 1e3:.1f} ms for {size / 2**30:.1f} GiB")
            back = ck.load(path, map_location="cuda")
            check("load map_location=cuda", all(back[k].is_cuda and torch.equal(back[k].cpu(), ref[k]) for k in ref), "")
        why = gds_unavailable_reason(True)
        try:
            import kvikio.defaults

            compat = kvikio.defaults.is_compat_mode_preferred()
        except Exception as exc:  # noqa: BLE001
            compat = f"unknown ({exc!r})"
        print(f"INFO  gds: {'usable' if why is None else 'rejected: ' + why}; kvikio compat mode: {compat}")
        if why is None:
            with fastckpt.Checkpointer(tier="gds") as ck:
                path = os.path.join(root, "gds.pt")
                rec = ck.save(state, path).wait()
                out = ck.load(path)
                check("gds tier save + verified load", rec.tier == "gds" and all(torch.equal(out[k], ref[k]) for k in ref),
                      f"blocked {rec.blocked_s:.2f} s, durable {rec.durable_s:.2f} s, "
                      f"{rec.bytes / rec.blocked_s / 1e9:.2f} GB/s GPU->file")
        else:
            with fastckpt.Checkpointer(tier="auto") as ck:
                rec = ck.save(state, os.path.join(root, "auto.pt")).wait()
            check("auto tier falls back with a reason", rec.tier == "direct", f"tier={rec.tier}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
