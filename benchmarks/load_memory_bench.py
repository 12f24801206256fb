"""What a load keeps resident: after loading, after dropping part of the state, after dropping it.

Run (from the repository root, with the project's venv):

    python benchmarks/load_memory_bench.py [--size 1GiB] [--dir DIR]

The state is save_bench's: a small transformer's float32 weights ("model.*", a third of the
bytes) and Adam's two moments ("optim.*"). It is saved once by fastckpt and once by
torch.save under --dir (default ../bench_tmp, removed afterwards). Each variant then runs in
a fresh process, which reads its file through the page cache first and measures its own
resident memory (VmRSS) above what it was before the load:

  loaded      right after the load returned;
  kept model  after dropping every "optim.*" tensor (a job that keeps the weights, or an
              optimizer that copied its states elsewhere), garbage collected;
  dropped     after dropping the rest as well.

Target (fastckpt): "kept model" <= the model's bytes + 5 % + 16 MiB, as torch.load's would be
if the allocator gave freed memory back; printed as PASS or MISS. MB are decimal (1e6 B).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402
from _save_variants import warm  # noqa: E402

VARIANTS = ("fastckpt", "fastckpt mmap=True", "torch.load", "torch.load mmap=True")
MiB = 1 << 20


def child(variant: str, path: str) -> dict:
    """One variant's numbers, measured in this (fresh) process."""
    warm([path])
    ck = c.import_fastckpt()() if variant.startswith("fastckpt") else None
    mapped = variant.endswith("mmap=True")
    gc.collect()
    base = c.rss_bytes()
    t0 = time.perf_counter()
    state = ck.load(path, mmap=mapped) if ck else torch.load(path, mmap=mapped, weights_only=True)
    seconds = time.perf_counter() - t0
    loaded = c.rss_bytes() - base
    for name in [n for n in state if n.startswith("optim.")]:
        del state[name]
    gc.collect()
    kept = c.rss_bytes() - base
    model = c.state_bytes(state)
    del state
    gc.collect()
    return {"seconds": seconds, "loaded": loaded, "kept": kept, "dropped": c.rss_bytes() - base, "model": model}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1GiB")
    p.add_argument("--dir", default=str(c.REPO.parent / "bench_tmp"))
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "PATH"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        state = c.make_state(c.parse_size(args.size))
        files = {"fastckpt": tmp / "fastckpt.pt", "torch.load": tmp / "torch.pt"}
        with c.import_fastckpt()() as ck:
            ck.save(state, str(files["fastckpt"])).wait()
        torch.save(state, files["torch.load"])
        total = c.state_bytes(state)
        del state
        rows = {}
        for v in VARIANTS:
            path = files["fastckpt" if v.startswith("fastckpt") else "torch.load"]
            out = subprocess.run([sys.executable, __file__, "--child", v, str(path)], check=True,
                                 capture_output=True, text=True).stdout
            rows[v] = json.loads(out.strip().splitlines()[-1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"state {total / 1e6:.0f} MB, model {rows['fastckpt']['model'] / 1e6:.0f} MB; resident MB above "
          "the process before the load:")
    print("| variant | load s | loaded MB | kept model MB | dropped MB |")
    print("|---|---:|---:|---:|---:|")
    for v, r in rows.items():
        mb = [f"{r[k] / 1e6:.0f}" for k in ("loaded", "kept", "dropped")]
        print(f"| {v} | {r['seconds']:.3f} | {' | '.join(mb)} |")
    for v in ("fastckpt", "fastckpt mmap=True"):
        r = rows[v]
        bound = r["model"] * 1.05 + 16 * MiB
        print(f"{v}: kept model {r['kept'] / 1e6:.0f} MB <= {bound / 1e6:.0f} MB (model + 5 % + 16 MiB): "
              f"{'PASS' if r['kept'] <= bound else 'MISS'}")


if __name__ == "__main__":
    main()
