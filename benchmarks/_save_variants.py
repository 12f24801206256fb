"""The variants ``save_bench.py`` times: one function per way of saving, each run in a fresh
folder ``d`` and returning its seconds (see save_bench.py for what each number means)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import _common as c


@dataclass
class Ctx:
    state: dict[str, torch.Tensor]
    nbytes: int
    memcpy_dst: dict[str, torch.Tensor] = field(default_factory=dict)
    checkpointer: object | None = None  # fastckpt.Checkpointer, reused across rounds
    local_dirs: tuple[str, ...] = ()  # the burst buffer (striped when several)
    files: int = 1  # fastckpt saves the state as this many files (a group's shards)
    cached: bool = True  # also time a restore from the page cache
    rss_before: int = 0  # resident bytes before fastckpt's first save
    rss_growth: int | None = None  # after it: measured once, before other variants' loads fill the heap


def split(state: dict, n: int) -> list[dict]:
    """The state's entries dealt into ``n`` dicts of about equal bytes (largest first)."""
    parts: list[dict] = [{} for _ in range(n)]
    sizes = [0] * n
    for k, v in sorted(state.items(), key=lambda kv: -kv[1].nbytes):
        i = sizes.index(min(sizes))
        parts[i][k] = v
        sizes[i] += v.nbytes
    return parts


def warm(paths: list[str]) -> None:
    """Read files through the page cache, so the next read finds them there."""
    for p in paths:
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


def load_in_new_process(kind: str, path: str) -> float:
    """Seconds a fresh process took to load ``path`` from the page cache (``_load_once.py``)."""
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("_load_once.py")), kind, path],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def bench_memcpy(ctx: Ctx, d: Path) -> dict:
    flat = ctx.memcpy_dst.get("*")  # one buffer every tensor is copied into (states over 1 GiB)
    t0 = time.perf_counter()
    for k, src in ctx.state.items():
        (flat[: src.numel()].view_as(src) if flat is not None else ctx.memcpy_dst[k]).copy_(src)
    return {"blocked_s": time.perf_counter() - t0}


def bench_fio(ctx: Ctx, d: Path) -> dict:
    path = d / "fio.dat"
    write_s = c.fio_seconds(path, ctx.nbytes, "write")
    c.drop_cache(path)
    return {"durable_s": write_s, "restore_s": c.fio_seconds(path, ctx.nbytes, "read")}


def bench_fastckpt(ctx: Ctx, d: Path) -> dict:
    ck = ctx.checkpointer
    parts = split(ctx.state, ctx.files) if ctx.files > 1 else [ctx.state]
    paths = [str(d / f"fastckpt{i}.pt") for i in range(len(parts))]
    group = str(d) if len(parts) > 1 else None  # a group's files each get a staging buffer: saved at once
    t0 = time.perf_counter()
    handles = [ck.save(part, p, group=group) for part, p in zip(parts, paths)]  # type: ignore[attr-defined]
    t1 = time.perf_counter()
    if group is not None:
        ck.commit(group).wait()  # type: ignore[attr-defined]
    recs = [h.wait() for h in handles]
    t2 = time.perf_counter()
    if ctx.rss_growth is None:  # the state was there before: this is fastckpt's
        ctx.rss_growth = c.rss_bytes() - ctx.rss_before
    local = [ck.local_path(p) for p in paths]  # type: ignore[attr-defined]
    read_from = [lp if lp and os.path.exists(lp) else p for lp, p in zip(local, paths)]
    for p in read_from:
        c.drop_cache(Path(p))
    t3 = time.perf_counter()
    objs = [ck.load(p) for p in paths]  # type: ignore[attr-defined]
    t4 = time.perf_counter()
    same = all(isinstance(o, dict) and c.same_state(part, o) for part, o in zip(parts, objs))
    for p in read_from:  # again, into the tensors that restore made: a resume into its built model
        c.drop_cache(Path(p))
    t7 = time.perf_counter()
    into = [ck.load(p, into=o) for p, o in zip(paths, objs)]  # type: ignore[attr-defined]
    restore_into = time.perf_counter() - t7
    same = same and all(c.same_state(part, o) for part, o in zip(parts, into))
    del objs, into
    out = {"blocked_s": t1 - t0, "durable_s": t2 - t0, "restore_s": t4 - t3, "restore_into_s": restore_into,
           "verified": same,
           "file_bytes": sum(os.path.getsize(p) for p in read_from), "rss_growth_bytes": ctx.rss_growth,
           "record": {k: getattr(recs[0], k, None) for k in ("blocked_s", "durable_s", "write_s", "bytes", "tier",
                                                              "odirect")}}
    if ctx.local_dirs:
        out["local_durable_s"] = max(r.local_durable_s or 0.0 for r in recs)
    if ctx.cached:
        warm(read_from)
        t5 = time.perf_counter()
        objs = [ck.load(p) for p in paths]  # type: ignore[attr-defined]
        out["restore_cached_s"] = time.perf_counter() - t5
        del objs
        t6 = time.perf_counter()
        objs = [ck.load(p, mmap=True) for p in paths]  # type: ignore[attr-defined]
        out["restore_mmap_s"] = time.perf_counter() - t6
        del objs
        if len(read_from) == 1:
            out["restore_fresh_s"] = load_in_new_process("fastckpt", paths[0])
    return out


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
    out = {"blocked_s": t1 - t0, "durable_s": t1 - t0, "restore_s": t3 - t2,
           "verified": c.same_state(ctx.state, obj), "file_bytes": os.path.getsize(path)}
    del obj
    if ctx.cached:  # torch.load read it through the page cache: it is there now
        t4 = time.perf_counter()
        torch.load(path, weights_only=True)
        out["restore_cached_s"] = time.perf_counter() - t4
        out["restore_fresh_s"] = load_in_new_process("torch", str(path))
    return out


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
    "fastckpt": ("fastckpt (defaults)", bench_fastckpt),
    "torch": ("torch.save+fsync / torch.load", bench_torch),
    "dcp": ("DCP async_save / dcp.load", bench_dcp),
    "lightning": ("Lightning AsyncCheckpointIO (+fsync)", bench_lightning),
}
