"""Save/restore benchmark: fastckpt against its peers and the hardware, one disk, one run.

Run (from the repository root, with the project's venv):

    python benchmarks/save_bench.py --size 1GiB [--dir DIR] [--repeat 3] [--warmup 1] [--json OUT]

The state is a flat dict of float32 tensors totalling --size (a small transformer's weights
plus Adam's two moments, mixed sizes). Every variant saves it into a fresh temporary folder
under --dir (default: ../bench_tmp beside the repository, the disk under test; not /tmp, which
may be tmpfs and refuse O_DIRECT), which is removed afterwards. Variants are interleaved
(A, B, C, A, B, C, ...) for --warmup + --repeat rounds; the warm-up rounds are discarded and the
table shows medians of the rest.

What each number means (all wall-clock seconds from time.perf_counter):
  blocked     how long the caller was stuck: `save` / `async_save` / `save_checkpoint` returns.
  durable     until the bytes are on disk: fastckpt `handle.wait()` returns; torch.save
              including flush + fsync; DCP `future.result()` (DCP fsyncs by default);
              Lightning after `teardown()` (its writer thread is done) plus an fsync that we
              add, because Lightning itself never fsyncs.
  restore     reading back after dropping the page cache (best effort: drop_caches and
              POSIX_FADV_DONTNEED). A restore faster than 1.5x fio's O_DIRECT read is flagged
              "cached?": the drop probably did not work and the number is not a disk read.
  memcpy      `dst.copy_(src)` into reused, already-touched buffers: the floor for blocking.
  fio         O_DIRECT sequential write (with a final fsync) and read of the same size in the
              same folder, bs=1M, libaio, iodepth=16: the device limit.
GB/s are decimal (1e9 B/s). After the table, fastckpt's numbers are checked against the
issue's targets, each marked PASS or MISS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

CACHED_FACTOR = 1.5  # restore faster than this times fio's O_DIRECT read: "cached?"


@dataclass
class Ctx:
    state: dict[str, torch.Tensor]
    nbytes: int
    memcpy_dst: dict[str, torch.Tensor] = field(default_factory=dict)
    checkpointer: object | None = None  # fastckpt.Checkpointer, reused across rounds


def bench_memcpy(ctx: Ctx, d: Path) -> dict:
    t0 = time.perf_counter()
    for k, src in ctx.state.items():
        ctx.memcpy_dst[k].copy_(src)
    return {"blocked_s": time.perf_counter() - t0}


def bench_fio(ctx: Ctx, d: Path) -> dict:
    path = d / "fio.dat"
    write_s = c.fio_seconds(path, ctx.nbytes, "write")
    c.drop_cache(path)
    return {"durable_s": write_s, "restore_s": c.fio_seconds(path, ctx.nbytes, "read")}


def bench_fastckpt(ctx: Ctx, d: Path) -> dict:
    path = str(d / "fastckpt.pt")
    t0 = time.perf_counter()
    handle = ctx.checkpointer.save(ctx.state, path)
    t1 = time.perf_counter()
    rec = handle.wait()
    t2 = time.perf_counter()
    c.drop_cache(d)
    t3 = time.perf_counter()
    obj = ctx.checkpointer.load(path)
    t4 = time.perf_counter()
    fields = ("blocked_s", "durable_s", "write_s", "bytes", "tier", "odirect")
    record = {k: getattr(rec, k, None) for k in fields}
    return {"blocked_s": t1 - t0, "durable_s": t2 - t0, "restore_s": t4 - t3,
            "verified": isinstance(obj, dict) and c.same_state(ctx.state, obj), "record": record}


def bench_torch(ctx: Ctx, d: Path) -> dict:
    path = d / "torch.pt"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(ctx.state, f)
        f.flush()
        os.fsync(f.fileno())
    t1 = time.perf_counter()
    c.drop_cache(path)
    t2 = time.perf_counter()
    obj = torch.load(path, weights_only=True)
    t3 = time.perf_counter()
    return {"blocked_s": t1 - t0, "durable_s": t1 - t0, "restore_s": t3 - t2,
            "verified": c.same_state(ctx.state, obj)}


def bench_dcp(ctx: Ctx, d: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    ckdir = d / "dcp"
    # defaults as shipped: sync_files=True (fsync per file), thread_count=1
    writer = dcp.FileSystemWriter(str(ckdir))
    t0 = time.perf_counter()
    resp = dcp.async_save(ctx.state, storage_writer=writer)
    t1 = time.perf_counter()
    getattr(resp, "upload_completion", resp).result()
    t2 = time.perf_counter()
    # DCP loads in place: the destination is allocated (lazily) before the clock starts
    dest = {k: torch.empty_like(v) for k, v in ctx.state.items()}
    c.drop_cache(ckdir)
    t3 = time.perf_counter()
    dcp.load(dest, checkpoint_id=str(ckdir))
    t4 = time.perf_counter()
    return {"blocked_s": t1 - t0, "durable_s": t2 - t0, "restore_s": t4 - t3,
            "verified": c.same_state(ctx.state, dest)}


def bench_lightning(ctx: Ctx, d: Path) -> dict:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    path = d / "lightning.ckpt"
    cio = AsyncCheckpointIO(TorchCheckpointIO())
    t0 = time.perf_counter()
    cio.save_checkpoint(ctx.state, path)
    t1 = time.perf_counter()
    cio.teardown()  # waits for the writer thread
    t2 = time.perf_counter()
    c.fsync_path(path)  # Lightning does not fsync; added to compare like with like
    t3 = time.perf_counter()
    return {"blocked_s": t1 - t0, "written_s": t2 - t0, "durable_s": t3 - t0}


VARIANTS = {  # name -> (label in the table, function)
    "memcpy": ("memcpy floor (reused buffer)", bench_memcpy),
    "fio": ("fio O_DIRECT (device limit)", bench_fio),
    "fastckpt": ("fastckpt (direct tier)", bench_fastckpt),
    "torch": ("torch.save+fsync / torch.load", bench_torch),
    "dcp": ("DCP async_save / dcp.load", bench_dcp),
    "lightning": ("Lightning AsyncCheckpointIO (+fsync)", bench_lightning),
}


def medians(runs: list[dict]) -> dict:
    keys = ("blocked_s", "durable_s", "written_s", "restore_s")
    return {k: c.median([r.get(k) for r in runs]) for k in keys}


def table(nbytes: int, runs: dict[str, list[dict]], med: dict[str, dict]) -> str:
    fio_read = med.get("fio", {}).get("restore_s")
    lines = ["| variant | blocked s | durable/total s | restore s | save GB/s | restore GB/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, (label, _) in VARIANTS.items():
        if name not in med:
            continue
        m = med[name]
        save = m["durable_s"] or m["blocked_s"]  # memcpy: the copy rate
        restore = c.fmt(m["restore_s"])
        if fio_read and name != "fio" and m["restore_s"]:
            n = sum(1 for r in runs[name] if r.get("restore_s") and
                    r["restore_s"] * CACHED_FACTOR < fio_read)
            if n:
                restore += f" cached? ({n}/{len(runs[name])})"
        lines.append(f"| {label} | {c.fmt(m['blocked_s'])} | {c.fmt(m['durable_s'])} | {restore} "
                     f"| {c.fmt(save and nbytes / save / c.GB, '.2f')} "
                     f"| {c.fmt(m['restore_s'] and nbytes / m['restore_s'] / c.GB, '.2f')} |")
    return "\n".join(lines)


def targets(med: dict[str, dict]) -> list[dict]:
    """fastckpt's medians against the issue's targets, one dict per target."""
    get = lambda v, k: med.get(v, {}).get(k)  # noqa: E731
    fc_b, fc_d, fc_r = (get("fastckpt", k) for k in ("blocked_s", "durable_s", "restore_s"))
    # each ratio is fastckpt / base, to stay <= bound; the read-bandwidth one is base / fastckpt
    # time (= fastckpt GB/s / fio GB/s), to stay >= bound
    specs = [("blocked <= 1.1 x memcpy floor", fc_b, get("memcpy", "blocked_s"), "<=", 1.10),
             ("blocked <= DCP async_save blocked", fc_b, get("dcp", "blocked_s"), "<=", 1.00),
             ("durable <= 1.25 x fio O_DIRECT write", fc_d, get("fio", "durable_s"), "<=", 1.25),
             ("durable <= 0.5 x DCP async_save total", fc_d, get("dcp", "durable_s"), "<=", 0.50),
             ("restore <= torch.load", fc_r, get("torch", "restore_s"), "<=", 1.00),
             ("restore GB/s >= 80 % of fio O_DIRECT read", fc_r, get("fio", "restore_s"), ">=", 0.80)]
    out = []
    for what, value, base, op, bound in specs:
        if value is None or base is None:
            out.append({"target": what, "ratio": None, "op": op, "bound": bound, "result": "n/a"})
            continue
        ratio = base / value if op == ">=" else value / base
        ok = ratio >= bound if op == ">=" else ratio <= bound
        out.append({"target": what, "value_s": value, "base_s": base, "ratio": ratio, "op": op,
                    "bound": bound, "result": "PASS" if ok else "MISS"})
    return out


def init_process_group(tmp: Path) -> None:
    # DCP's async_save plans through the default process group: a world of one, gloo, in-process
    store = dist.FileStore(str(tmp / "pg_store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def enabled_variants(ctx: Ctx) -> dict:
    chosen = {}
    for name, (_, fn) in VARIANTS.items():
        if name == "fio" and not c.fio_available():
            print("fio not found: skipping the device-limit rows; install it with "
                  "`apt-get update && apt-get install -y fio`", file=sys.stderr)
            continue
        if name == "fastckpt":
            try:
                ctx.checkpointer = c.import_fastckpt()()
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


def run(args: argparse.Namespace, tmp: Path) -> dict:
    nbytes = c.parse_size(args.size)
    state = c.make_state(nbytes)
    ctx = Ctx(state=state, nbytes=nbytes)
    ctx.memcpy_dst = {k: torch.empty_like(v).fill_(0.0) for k, v in state.items()}  # touched
    mnt, fstype = c.mount_of(tmp)
    dropped = c.drop_cache(tmp)
    fio_version = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip() \
        if c.fio_available() else None
    print(f"state: {len(state)} float32 tensors, {nbytes / 2**30:.3f} GiB; dir {tmp} on {mnt} "
          f"({fstype}); {os.cpu_count()} CPUs; torch {torch.__version__}; fio {fio_version}; "
          f"drop_caches {'accepted' if dropped else 'refused (fadvise only)'}", file=sys.stderr)
    if fstype in ("tmpfs", "ramfs", "overlay"):
        print(f"warning: {tmp} is on {fstype}: this does not measure a disk; use --dir", file=sys.stderr)

    init_process_group(tmp)
    chosen = enabled_variants(ctx)
    rounds = args.warmup + args.repeat
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    errors: dict[str, str] = {}
    try:
        for r in range(rounds):
            tag = "warm-up" if r < args.warmup else f"round {r - args.warmup + 1}/{args.repeat}"
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
                if r >= args.warmup:
                    runs[name].append(res)
                shown = " ".join(f"{k} {v:.3f}" for k, v in res.items() if isinstance(v, float))
                extra = "" if res.get("verified", True) else " NOT VERIFIED: restored state differs"
                print(f"{tag} {name}: {shown}{extra}", file=sys.stderr)
    finally:
        if ctx.checkpointer is not None:
            ctx.checkpointer.close()
        dist.destroy_process_group()
    med = {name: medians(rs) for name, rs in runs.items() if rs}
    load = os.getloadavg()[1]  # 5-minute average, about the length of a run
    return {"loadavg_5min": load, "size_bytes": nbytes, "tensors": len(state), "dir": str(tmp), "mount": mnt,
            "fstype": fstype, "drop_caches_accepted": dropped, "cpus": os.cpu_count(),
            "torch": torch.__version__, "fio": fio_version, "repeat": args.repeat,
            "warmup": args.warmup, "runs": runs, "medians": med, "errors": errors,
            "targets": targets(med)}


def report(res: dict) -> str:
    lines = [f"## save/restore, {res['size_bytes'] / 2**30:.3f} GiB fp32 ({res['tensors']} tensors), "
             f"median of {res['repeat']}, {res['fstype']} at {res['mount']}, {res['cpus']} CPUs", "",
             table(res["size_bytes"], res["runs"], res["medians"]), ""]
    if res["loadavg_5min"] > 0.5 * res["cpus"]:  # others' work shows up in every column
        lines.append(f"warning: the machine was busy (5-min load average {res['loadavg_5min']:.2f} on "
                     f"{res['cpus']} CPUs): numbers are noisy; rerun on an idle machine.")
    recs = [r["record"] for r in res["runs"].get("fastckpt", [])]
    if recs:  # what fastckpt says about itself, to check against what the clock said
        own = {k: c.median([r[k] for r in recs if isinstance(r[k], (int, float))])
               for k in ("blocked_s", "durable_s", "write_s")}
        lines.append(f"fastckpt's own SaveRecord (medians): blocked {c.fmt(own['blocked_s'])} s, "
                     f"durable {c.fmt(own['durable_s'])} s, write {c.fmt(own['write_s'])} s, "
                     f"tier {recs[-1]['tier']}, O_DIRECT {recs[-1]['odirect']}, bytes {recs[-1]['bytes']}; "
                     f"restored state equal to the saved one: "
                     f"{all(r['verified'] for r in res['runs']['fastckpt'])}.")
    lt = res["medians"].get("lightning")
    if lt:
        lines.append(f"Lightning does not fsync: written (teardown returned) after "
                     f"{c.fmt(lt['written_s'])} s; the durable column adds our fsync.")
    lines += ["torch.save is synchronous: blocked = durable, flush + fsync included.",
              "DCP: FileSystemWriter defaults (fsync on, 1 IO thread); it stages CPU tensors into "
              "freshly allocated buffers on every call; dcp.load reads into preallocated tensors."]
    if not res["drop_caches_accepted"]:
        lines.append("drop_caches was refused: restores relied on POSIX_FADV_DONTNEED only.")
    lines += ["", "### fastckpt against the targets", "",
              "| target | ratio | bound | result |", "|---|---:|---:|---|"]
    for t in res["targets"]:
        lines.append(f"| {t['target']} | {c.fmt(t['ratio'], '.2f')} | {t['op']} {t['bound']:.2f} "
                     f"| {t['result']} |")
    for name, err in res["errors"].items():
        lines.append(f"\n{name} FAILED: {err.strip().splitlines()[-1]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1GiB", help="state size, e.g. 1GiB, 512MiB (default 1GiB)")
    p.add_argument("--dir", type=Path, default=c.REPO.parent / "bench_tmp",
                   help="where to write (a temp folder is made and removed inside it)")
    p.add_argument("--repeat", type=int, default=3, help="measured rounds (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="discarded rounds first (default 1)")
    p.add_argument("--json", type=Path, help="also write the raw numbers here")
    args = p.parse_args(argv)
    if args.repeat < 1 or args.warmup < 0:
        p.error("--repeat must be >= 1 and --warmup >= 0")
    made_dir = not args.dir.exists()
    args.dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="save_bench_", dir=args.dir))
    try:
        res = run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if made_dir and not any(args.dir.iterdir()):
            args.dir.rmdir()
    print(report(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2, default=str))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
