"""Save/restore benchmark: fastckpt against its peers and the hardware, one disk, one run.

Run (from the repository root, with the project's venv):

    python benchmarks/save_bench.py --size 1GiB [--dir DIR] [--repeat 3] [--warmup 1] [--json OUT]
    python benchmarks/save_bench.py --small 100000            # many tiny tensors (issue #9, item 9)
    python benchmarks/save_bench.py --sizes 64MiB,256MiB,1GiB,4GiB --plot scaling.png   # the curve
    python benchmarks/save_bench.py --local-dir /nvme0/b --local-dir /nvme1/b --files 4  # striping

The state is a flat dict of float32 tensors totalling --size (a small transformer's weights
plus Adam's two moments, mixed sizes); with --small N it is N four-element tensors. Every
variant saves it into a fresh temporary folder under --dir (default: ../bench_tmp beside the
repository, the disk under test; not /tmp, which may be tmpfs and refuse O_DIRECT), which is
removed afterwards. Variants are interleaved (A, B, C, A, B, C, ...) for --warmup + --repeat
rounds; the warm-up rounds are discarded and the tables show medians of the rest. fastckpt runs
with default settings (one Checkpointer for the whole run: its staging buffer and layout are
reused from round to round, as in training).

What each number means (all wall-clock seconds from time.perf_counter):
  blocked     how long the caller was stuck: `save` / `async_save` / `save_checkpoint` returns.
  durable     until the bytes are on disk: fastckpt `handle.wait()` returns (with --local-dir:
              replicated to --dir; "local durable" is the burst-buffer copy); torch.save
              including flush + fsync; DCP `future.result()` (DCP fsyncs by default);
              Lightning after `teardown()` (its writer thread is done) plus an fsync that we
              add, because Lightning itself never fsyncs.
  restore     reading back after dropping the page cache (best effort: drop_caches and
              POSIX_FADV_DONTNEED), checksum verification included for fastckpt. A restore
              faster than 1.5x fio's O_DIRECT read is flagged "cached?": the drop probably did
              not work and the number is not a disk read. fastckpt also restores a second time,
              into the tensors its first restore made (`load(..., into=...)`: memory that exists,
              as a resumed job's built model), printed below the table and judged against fio.
  cached      a restore of a file that is in the page cache, twice: in this process
              (fastckpt: after reading it once through the cache; torch.load: its second load,
              which reuses the heap its first load freed), and in a new process that loads
              it once (`_load_once.py`: what a restarted job pays; imports not counted).
              fastckpt's `load(..., mmap=True)` of the cached file is printed below the table.
  memcpy      `dst.copy_(src)` into reused, already-touched buffers, one per tensor: the floor
              for blocking (states over 1 GiB: every tensor into one buffer of the largest
              one's size, so that a 4 GiB state leaves memory for the rest; with tensors of
              hundreds of MB that flatters the floor little).
  fio         O_DIRECT sequential write (with a final fsync) and read of the same size in the
              same folder, bs=1M, libaio, iodepth=16: the device limit.
  memory      the process's resident memory after fastckpt's first save, above what it was
              before it (the state was already there), against its staging buffers.
GB/s are decimal (1e9 B/s). After each table, fastckpt's numbers are checked against the
issues' targets (#16, #9 item 9), each marked PASS or MISS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402
import _save_report as R  # noqa: E402
from _save_variants import VARIANTS, Ctx  # noqa: E402

FLAT_FLOOR_ABOVE = 1 << 30


def small_state(n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(4, generator=gen) for i in range(n)}


def init_process_group(tmp: Path) -> None:
    # DCP's async_save plans through the default process group: a world of one, gloo, in-process
    store = dist.FileStore(str(tmp / "pg_store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def enabled_variants(ctx: Ctx, names: tuple[str, ...]) -> dict:
    chosen = {}
    for name in names:
        fn = VARIANTS[name][1]
        if name == "fio" and not c.fio_available():
            print("fio not found: skipping the device-limit rows; install it with "
                  "`apt-get update && apt-get install -y fio`", file=sys.stderr)
            continue
        if name == "fastckpt":
            try:
                ctx.checkpointer = c.import_fastckpt()(local_dir=list(ctx.local_dirs) or None)
            except ImportError as e:
                print(f"fastckpt is not importable ({e}): skipping its rows", file=sys.stderr)
                continue
        if name == "lightning":
            try:
                import lightning.pytorch  # noqa: F401
            except ImportError:
                print("lightning is not installed: skipping its row", file=sys.stderr)
                continue
        chosen[name] = fn
    return chosen


def rounds(ctx: Ctx, chosen: dict, tmp: Path, repeat: int, warmup: int, tag: str = "") -> tuple[dict, dict]:
    """Run the chosen variants interleaved; (measured runs per variant, errors per variant)."""
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    errors: dict[str, str] = {}
    chosen = dict(chosen)
    for r in range(warmup + repeat):
        label = f"{tag}warm-up" if r < warmup else f"{tag}round {r - warmup + 1}/{repeat}"
        for name, fn in list(chosen.items()):
            d = tmp / f"{name}_{r}"
            d.mkdir()
            try:
                res = fn(ctx, d)
            except Exception:  # one broken variant must not hide the others' numbers
                errors[name] = traceback.format_exc()
                print(f"{name} failed, dropped from the run:\n{errors[name]}", file=sys.stderr)
                del chosen[name]
                continue
            finally:
                shutil.rmtree(d, ignore_errors=True)
            if r >= warmup:
                runs[name].append(res)
            shown = " ".join(f"{k} {v:.3f}" for k, v in res.items() if isinstance(v, float))
            extra = "" if res.get("verified", True) else " NOT VERIFIED: restored state differs"
            print(f"{label} {name}: {shown}{extra}", file=sys.stderr)
    return runs, errors


def describe(tmp: Path, nbytes: int, n: int, dropped: bool) -> dict:
    mnt, fstype = c.mount_of(tmp)
    fio_version = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip() \
        if c.fio_available() else None
    print(f"state: {n} tensors, {nbytes / 2**30:.3f} GiB; dir {tmp} on {mnt} ({fstype}); {os.cpu_count()} CPUs; "
          f"torch {torch.__version__}; fio {fio_version}; drop_caches {'accepted' if dropped else 'refused'}",
          file=sys.stderr)
    if fstype in ("tmpfs", "ramfs", "overlay"):
        print(f"warning: {tmp} is on {fstype}: this does not measure a disk; use --dir", file=sys.stderr)
    return {"dir": str(tmp), "mount": mnt, "fstype": fstype, "drop_caches_accepted": dropped, "cpus": os.cpu_count(),
            "torch": torch.__version__, "fio": fio_version}


def run(args: argparse.Namespace, tmp: Path) -> dict:
    sizes = [c.parse_size(s) for s in args.sizes.split(",")] if args.sizes else [c.parse_size(args.size)]
    mode = "small" if args.small else "scaling" if args.sizes else "compare"
    # fastckpt first: its RSS growth is measured at its first save, before torch.load's heap (100,000
    # tensors' worth in --small) stays behind in the process
    names = {"small": ("fastckpt", "torch"), "scaling": ("memcpy", "fio", "fastckpt"),
             "compare": tuple(VARIANTS)}[mode]
    res: dict = {"mode": mode, "repeat": args.repeat, "warmup": args.warmup, "local_dirs": args.local_dir,
                 "sections": []}
    init_process_group(tmp)
    ck = None
    try:
        for nbytes in sizes:
            state = small_state(args.small) if args.small else c.make_state(nbytes)
            nbytes = c.state_bytes(state)
            ctx = Ctx(state=state, nbytes=nbytes, local_dirs=tuple(args.local_dir),
                      files=max(args.files, len(args.local_dir) or 1), cached=mode != "scaling")
            if "memcpy" in names and nbytes > FLAT_FLOOR_ABOVE:  # memory: one reused buffer, the largest tensor's size
                ctx.memcpy_dst = {"*": torch.zeros(max(v.numel() for v in state.values()))}
            elif "memcpy" in names:  # one destination per tensor, as a snapshot has
                ctx.memcpy_dst = {k: torch.empty_like(v).fill_(0.0) for k, v in state.items()}  # touched
            res.update(describe(tmp, nbytes, len(state), c.drop_cache(tmp)))
            chosen = enabled_variants(ctx, names)
            ck = ctx.checkpointer
            ctx.rss_before = c.rss_bytes()
            runs, errors = rounds(ctx, chosen, tmp, args.repeat, args.warmup,
                                  tag=f"{nbytes / 2**20:.0f} MiB " if mode == "scaling" else "")
            staging = sum(ck._staging.capacities() + ck._staging.capacities(pinned=True)) if ck else None
            dirs = [vars(s) | {"bandwidth_Bps": s.bandwidth_Bps} for s in ck.stats().local_dirs] if ck else []
            if ck is not None:
                ck.close()
            med = {name: R.medians(rs) for name, rs in runs.items() if rs}
            res["sections"].append({"size_bytes": nbytes, "tensors": len(state), "runs": runs, "medians": med,
                                    "errors": errors, "staging_bytes": staging, "local_dir_stats": dirs,
                                    "targets": R.targets(med, mode, staging, len(args.local_dir) > 0)})
            del state, ctx, chosen
    finally:
        dist.destroy_process_group()
    res["loadavg_5min"] = os.getloadavg()[1]  # 5-minute average, about the length of a run
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1GiB", help="state size, e.g. 1GiB, 512MiB (default 1GiB)")
    p.add_argument("--sizes", help="comma-separated sizes: the scaling curve (memcpy, fio, fastckpt only)")
    p.add_argument("--small", type=int, default=0, help="a state of this many four-element tensors instead")
    p.add_argument("--local-dir", action="append", default=[],
                   help="fastckpt's burst buffer; repeat for striped drives (durable is then at --dir)")
    p.add_argument("--files", type=int, default=1, help="fastckpt saves the state as this many files")
    p.add_argument("--dir", type=Path, default=c.REPO.parent / "bench_tmp",
                   help="where to write (a temp folder is made and removed inside it)")
    p.add_argument("--repeat", type=int, default=3, help="measured rounds (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="discarded rounds first (default 1)")
    p.add_argument("--json", type=Path, help="also write the raw numbers here")
    p.add_argument("--plot", type=Path, help="with --sizes: draw the curve into this PNG")
    args = p.parse_args(argv)
    if args.repeat < 1 or args.warmup < 0 or args.files < 1:
        p.error("--repeat and --files must be >= 1 and --warmup >= 0")
    made_dir = not args.dir.exists()
    args.dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="save_bench_", dir=args.dir))
    try:
        res = run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in args.local_dir:  # only fastckpt's copies of this run's files
            mirror = os.path.join(d, str(tmp).lstrip(os.sep))
            shutil.rmtree(mirror, ignore_errors=True)
            while os.path.dirname(mirror).startswith(d.rstrip(os.sep) + os.sep):
                mirror = os.path.dirname(mirror)
                try:
                    os.rmdir(mirror)
                except OSError:
                    break
        if made_dir and not any(args.dir.iterdir()):
            args.dir.rmdir()
    print(R.report(res))
    if args.plot and res["mode"] == "scaling":
        R.plot(res, args.plot)
        print(f"\nplot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2, default=str))
    return 1 if any(s["errors"] for s in res["sections"]) else 0


if __name__ == "__main__":
    sys.exit(main())
