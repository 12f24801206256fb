"""One call on an s3:// URL: fastckpt.latest and fastckpt.load of a small checkpoint, each through a
fresh target as every such call makes, with botocore's parsed data shared across sessions (the
default) and without (each session parsing it again, as before), against one boto3 GET on a
client made once. SeaweedFS on 127.0.0.1; variants interleaved, medians.

    .venv/bin/python benchmarks/s3_call_bench.py --repeat 15
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fastckpt  # noqa: E402
from fastckpt.storage import fsspec as fsspec_target  # noqa: E402

import _s3  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=15)
    args = p.parse_args()
    shared = fsspec_target.share_loader
    with tempfile.TemporaryDirectory() as tmp, _s3.seaweed(Path(tmp) / "weed") as server:
        bucket, opts = server.make_bucket(), server.storage_options()
        run = f"s3://{bucket}/run"
        with fastckpt.Checkpointer(storage_options=opts, local_dir=str(Path(tmp) / "nvme"), overhead_budget=0.99) as ck:
            ck.save({"w": torch.ones(1024)}, f"{run}/step1/model.pt", group=f"{run}/step1")
            ck.commit(f"{run}/step1", step=1).wait(60)
        boto = _s3.client(server, plain=True)
        calls = {
            "boto3 get_object (one client)": lambda: boto.get_object(Bucket=bucket, Key="run/latest")["Body"].read(),
            "fastckpt.latest": lambda: fastckpt.latest(run, storage_options=opts),
            "fastckpt.load (4 KiB)": lambda: fastckpt.load(f"{run}/step1/model.pt", storage_options=opts),
        }
        times: dict[str, list[float]] = {}
        for _ in range(args.repeat + 1):  # the first round warms imports and connections: dropped
            for sharing in (True, False):
                fsspec_target.share_loader = shared if sharing else (lambda session: None)
                for name, call in calls.items():
                    if name.startswith("boto3") and not sharing:
                        continue
                    t0 = time.perf_counter()
                    call()
                    times.setdefault(f"{name}{'' if sharing else ', loader not shared'}", []).append(
                        time.perf_counter() - t0)
        fsspec_target.share_loader = shared
    print(f"| call | median s | min s | max s |  (rounds: {args.repeat}, first dropped)")
    print("|---|---:|---:|---:|")
    for name, ts in times.items():
        ts = ts[1:]
        print(f"| {name} | {statistics.median(ts):.4f} | {min(ts):.4f} | {max(ts):.4f} |")


if __name__ == "__main__":
    main()
