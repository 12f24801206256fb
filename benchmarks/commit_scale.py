"""Group commit at scale: W simulated ranks commit one checkpoint through a shared TCPStore
(and, for comparison, through marker files without a store), on a local directory and on S3.

Run (from the repository root, with the project's venv):

    python benchmarks/commit_scale.py [--worlds 8,64,256,1024] [--procs 4] [--rounds 3]
        [--warmup 1] [--backends local,s3] [--modes store,markers] [--markers-max local:256,s3:64]
        [--dir DIR] [--json OUT] [--plot PNG]

Ranks are real Checkpointers(rank=r, world_size=W, store=...), spread over --procs processes
(``_commit_ranks.py``), all clients of one TCPStore this script hosts (as torchrun's agent does).
A round: every rank saves an 8 KiB file into ``step{N}`` and commits right away; the round ends
when every handle resolved. Warm-up rounds are dropped (they open the store's connections);
tables show medians over --rounds. With --backends s3 the script starts its own SeaweedFS
server (tests/s3server.py) and saves through a burst buffer (local_dir) per process, as S3
saves must; everything it made is removed at the end.

Columns (per commit):
  publish_s  last rank's file durable -> rank 0 published the manifest and moved ``latest``
  resolve_s  last rank's file durable -> every rank's commit handle resolved
  commit_req storage requests of the commit protocol (markers, manifest, pointer, the check
             each rank makes at its first save into the group), by kind in the JSON
  all_req    every storage request, the data files' writes (and S3's size checks) included;
             target: <= 3 W + 10 with a store
  store_ops  TCPStore operations (waits included), store_kB the bytes of their keys and
             values, keys the distinct keys used (all deleted once the commit is known)
  cpu0_s     CPU seconds rank 0's committing thread used
Requests are counted at the Target seam (a wrapper around every Target fastckpt resolves);
on the local directory the data files are written through the FileOps seam instead, one per
rank, and are added. Simulated ranks share this machine's cores: latencies include the
scheduling of W ranks' threads on them, which real ranks on their own nodes would not pay.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing as mp
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _commit_ranks as R


def _spawn(ctx: mp.context.BaseContext, jobs: list[R.Job]) -> list[tuple[object, object]]:
    out = []
    for job in jobs:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=R.serve, args=(job, child), daemon=True)
        p.start()
        child.close()
        out.append((p, parent))
    for _, conn in out:
        kind, _ = conn.recv()
        if kind != "ready":
            raise RuntimeError(f"a rank process answered {kind!r}")
    return out


def _merge(parts: list[dict]) -> dict:
    out: dict[str, int] = {}
    for d in parts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _round(procs: list[tuple[object, object]], step: int, world: int, local: bool) -> dict:
    for _, conn in procs:
        conn.send(("round", step))
    res = [conn.recv()[1] for _, conn in procs]
    last_durable = max(r["last_durable"] for r in res)
    published = next(r["published"] for r in res if r["rank0_cpu_s"] is not None)
    targets = _merge([r["targets"] for r in res])
    home = {k.removeprefix("remote "): v for k, v in targets.items() if local or k.startswith("remote ")}
    data = sum(v for k, v in home.items() if k.endswith(" data")) + (world if local else 0)
    commit_req = sum(v for k, v in home.items() if not k.endswith(" data"))
    store = _merge([r["store"] for r in res])
    return {"publish_s": published - last_durable, "resolve_s": max(r["last_resolved"] for r in res) - last_durable,
            "commit_req": commit_req, "all_req": commit_req + data, "requests": home, "burst_buffer":
            {k: v for k, v in targets.items() if k not in home and not k.startswith("remote ")},
            "syscalls": _merge([r["ops"] for r in res]),
            "store_ops": sum(v for k, v in store.items() if k.startswith("store ") and k not in
                             ("store bytes", "store clone")),
            "store_kB": store.get("store bytes", 0) / 1e3, "store": store,
            "keys": len(set().union(*(r["keys"] for r in res))), "cpu0_s": next(r["rank0_cpu_s"] for r in res
                                                             if r["rank0_cpu_s"] is not None)}


def run_one(ctx: mp.context.BaseContext, args: argparse.Namespace, backend: str, mode: str, world: int,
            root: str, work: Path, storage_options: dict | None) -> dict:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=600)) \
        if mode == "store" else None
    n = min(args.procs, world)
    bounds = [world * i // n for i in range(n + 1)]
    run_root = f"{root}/{mode}-W{world}"
    jobs = [R.Job(bounds[i], bounds[i + 1], world, run_root, server.port if server else None,
                  str(work / f"bb{i}") if backend == "s3" else None, storage_options) for i in range(n)]
    procs = _spawn(ctx, jobs)
    try:
        rows = [_round(procs, step, world, backend == "local") for step in range(1, args.warmup + args.rounds + 1)]
    finally:
        for p, conn in procs:
            with contextlib.suppress(OSError, EOFError):
                conn.send(("stop", 0))
                conn.recv()
            p.join(60)
    rows = rows[args.warmup:]
    med = {k: statistics.median(r[k] for r in rows) for k in
           ("publish_s", "resolve_s", "commit_req", "all_req", "store_ops", "store_kB", "keys", "cpu0_s")}
    return {"backend": backend, "mode": mode, "world": world, **med, "rounds": rows}


def _table(results: list[dict]) -> str:
    head = f"{'backend':7} {'mode':7} {'W':>5} {'publish_s':>9} {'resolve_s':>9} {'commit_req':>10} {'all_req':>8} " \
           f"{'3W+10':>6} {'store_ops':>9} {'store_kB':>8} {'keys':>5} {'cpu0_s':>7}"
    lines = [head]
    for r in results:
        lines.append(f"{r['backend']:7} {r['mode']:7} {r['world']:>5} {r['publish_s']:9.3f} {r['resolve_s']:9.3f} "
                     f"{r['commit_req']:10.0f} {r['all_req']:8.0f} {3 * r['world'] + 10:6d} {r['store_ops']:9.0f} "
                     f"{r['store_kB']:8.1f} {r['keys']:5.0f} {r['cpu0_s']:7.3f}")
    return "\n".join(lines)


def plot(results: list[dict], out: str) -> None:
    """Publish latency and requests per commit against W, one line per backend and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for (backend, mode) in sorted({(r["backend"], r["mode"]) for r in results}):
        rs = sorted((r for r in results if (r["backend"], r["mode"]) == (backend, mode)), key=lambda r: r["world"])
        ws = [r["world"] for r in rs]
        label = f"{backend}, {'store' if mode == 'store' else 'no store (markers)'}"
        axes[0].plot(ws, [r["publish_s"] for r in rs], marker="o", label=label)
        axes[1].plot(ws, [r["all_req"] for r in rs], marker="o", label=label)
        axes[2].plot(ws, [r["cpu0_s"] for r in rs], marker="o", label=label)
    ws = sorted({r["world"] for r in results})
    axes[1].plot(ws, [3 * w + 10 for w in ws], "k--", label="3 W + 10")
    for ax, title in zip(axes, ("publish latency (s)", "storage requests per commit", "rank 0 CPU (s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks W")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--worlds", default="8,64,256,1024")
    p.add_argument("--procs", type=int, default=4, help="processes the simulated ranks are spread over")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--backends", default="local,s3")
    p.add_argument("--modes", default="store,markers", help="store: through a TCPStore; markers: without one")
    p.add_argument("--markers-max", default="local:256,s3:64",
                   help="the largest W the storage-marker fallback runs at, per backend (every rank polls the "
                        "storage: at 1,024 simulated ranks it overloads a small machine)")
    p.add_argument("--dir", default=None, help="a directory on a disk (default: a temporary one)")
    p.add_argument("--json", default=None, help="write every measurement here")
    p.add_argument("--plot", default=None, help="draw the growth curves into this PNG")
    args = p.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    markers_max = {b: int(w) for b, w in (item.split(":") for item in args.markers_max.split(","))}
    work = Path(tempfile.mkdtemp(prefix="commit-scale-", dir=args.dir))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "fastckpt", "_commit_ranks"])
    results: list[dict] = []
    try:
        for backend in args.backends.split(","):
            with _backend(backend, work) as (root, options):
                for mode in args.modes.split(","):
                    for world in worlds:
                        if mode == "markers" and world > markers_max.get(backend, world):
                            continue
                        t0 = time.monotonic()
                        results.append(run_one(ctx, args, backend, mode, world, root, work, options))
                        print(f"# {backend} {mode} W={world}: {time.monotonic() - t0:.0f} s", flush=True)
                        print(_table(results[-1:]).splitlines()[1], flush=True)
                        if args.json:  # after each, so that an interrupted run keeps what it measured
                            Path(args.json).write_text(json.dumps(results, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(_table(results))
    if args.plot:
        plot(results, args.plot)
    return 0


@contextlib.contextmanager
def _backend(backend: str, work: Path):  # yields (root, storage_options)
    if backend == "local":
        (work / "local").mkdir()
        yield str(work / "local"), None
        return
    import _s3

    with _s3.seaweed(work / "seaweedfs") as server:
        bucket = server.make_bucket()
        try:
            yield f"s3://{bucket}/run-{uuid.uuid4().hex[:8]}", server.storage_options()
        finally:
            _s3.delete_bucket(_s3.client(server), bucket)


if __name__ == "__main__":
    sys.exit(main())
