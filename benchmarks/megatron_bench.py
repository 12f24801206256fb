"""Megatron benchmark: one sharded state on 2 ranks, saved and loaded by each Megatron option and by fastckpt.

Run (from the repository root, with the project's venv; it starts itself under torchrun):

    python benchmarks/megatron_bench.py [--size 1GiB] [--repeat 3] [--warmup 1] [--dir DIR] [--json OUT]

The state is ``--size`` bytes in total (float32; a transformer's weights and Adam's two
moments, ``_common.make_state``), split across the 2 ranks along axis 0 like tensor-parallel
weights: each rank holds half of every tensor, as megatron ``ShardedTensor``s. Variants:

  torch             Megatron-LM ``--ckpt-format torch``: each rank ``torch.save``s its shards. Megatron-LM
                    does not fsync; *durable* adds the fsync that makes the bytes durable.
  torch_dcp         Megatron-LM ``--ckpt-format torch_dcp``: ``torch.distributed.checkpoint.save`` of the
                    shards as DTensors (its FileSystemWriter fsyncs). Megatron-LM refuses --async-save for it.
  dcp_async         ``torch.distributed.checkpoint.async_save`` of the same DTensors: not a Megatron-LM option,
                    shown as the torch-native async reference.
  torch_dist        megatron-core's own strategy (Megatron-LM's default format), synchronous. It calls
                    ``torch.cuda.synchronize`` and puts flags on ``torch.cuda.current_device()``, which raise
                    on a CPU-only torch: for these rows (marked *) those two calls are stood in on the CPU.
  torch_dist_async  the same through megatron's AsyncCallsQueue (a forked writer), also marked *.
  fastckpt          ``("fastckpt", 1)``, synchronous.
  fastckpt_async    ``("fastckpt", 1)`` with ``async_sharded_save=True``; *durable* is the group's commit
                    (every rank's files fsynced, the manifest published), then ``execute_sync`` finalizes.
  fastckpt_async_overlap  the same with ``Checkpointer(overlap_write=True)``: the writer follows the
                    snapshot's copy instead of starting after it.

*blocked*: seconds until the save call returned (for torch_dist_async: until the queue had
scheduled it); *durable*: until the bytes were fsynced (for async variants: from the call);
*load*: loading the same layout on both ranks after dropping the page cache. Each number is the
slower rank's, median over ``--repeat`` rounds after ``--warmup`` discarded ones; variants are
interleaved, rotated each round. The targets compare fastckpt_async with the best Megatron option
that runs here as shipped (torch, torch_dcp); the torch_dist rows are compared too, for reference.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import drop_cache, fmt, make_state, median, parse_size  # noqa: E402

VARIANTS = ("torch", "torch_dcp", "dcp_async", "torch_dist", "torch_dist_async", "fastckpt", "fastckpt_async",
            "fastckpt_async_overlap")
SHIPPED = ("torch", "torch_dcp")  # the Megatron options that run on CPU torch as they are
STOOD_IN = ("torch_dist", "torch_dist_async")
LOADS = {"torch": "torch", "torch_dcp": "torch_dcp", "torch_dist": "torch_dist", "fastckpt": "fastckpt"}


@contextlib.contextmanager
def cuda_calls_on_cpu():
    """torch_dist and the AsyncCallsQueue call torch.cuda.synchronize() and place flags on
    torch.cuda.current_device(); on a CPU-only torch both raise. Stand them in on the CPU."""
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize, torch.cuda.current_device = (lambda *a, **k: None), (lambda: "cpu")
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Bench:
    """One rank's side: the state, and one save+load per variant."""

    def __init__(self, nbytes: int, rank: int, world: int) -> None:
        from megatron.core.dist_checkpointing import ShardedTensor
        from torch.distributed.device_mesh import init_device_mesh

        self.rank, self.world = rank, world
        self.local = make_state(nbytes // world, seed=rank)  # this rank's half of every tensor
        self.sharded = {k: ShardedTensor.from_rank_offsets(k, t, (0, rank, world)) for k, t in self.local.items()}
        self.mesh = init_device_mesh("cpu", (world,))
        import fastckpt
        from fastckpt.integrations import megatron as fm

        self.cks = {"fastckpt": fastckpt.Checkpointer(),
                    "fastckpt_async_overlap": fastckpt.Checkpointer(overlap_write=True)}
        self.cks["fastckpt_async"] = self.cks["fastckpt"]
        self.register = lambda variant: fm.register(self.cks[variant])[0]

    def dtensors(self, fill: bool = True) -> dict:
        from torch.distributed.tensor import DTensor, Shard

        return {k: DTensor.from_local(t if fill else torch.empty_like(t), self.mesh, [Shard(0)], run_check=False)
                for k, t in self.local.items()}

    def request(self) -> dict:
        from megatron.core.dist_checkpointing import ShardedTensor

        return {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(t), (0, self.rank, self.world))
                for k, t in self.local.items()}

    # ------------------------------------------------------------------ saves
    def save(self, variant: str, d: str) -> tuple[float, float]:
        """(blocked, durable) seconds on this rank."""
        from megatron.core import dist_checkpointing as dc

        t0 = time.monotonic()
        if variant == "torch":
            path = os.path.join(d, f"mp_rank_{self.rank:02d}", "model_optim_rng.pt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(self.local, path)
            blocked = time.monotonic() - t0
            fsync_tree(os.path.dirname(path))
            return blocked, time.monotonic() - t0
        if variant in ("torch_dcp", "dcp_async"):
            import torch.distributed.checkpoint as dcp

            state, writer = self.dtensors(), dcp.FileSystemWriter(d)
            if variant == "torch_dcp":
                dcp.save(state, storage_writer=writer)
                return time.monotonic() - t0, time.monotonic() - t0
            fut = dcp.async_save(state, storage_writer=writer)
            blocked = time.monotonic() - t0
            fut.result()
            return blocked, time.monotonic() - t0
        if variant in STOOD_IN:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            with cuda_calls_on_cpu():
                if variant == "torch_dist":
                    dc.save(dict(self.sharded), d)
                    return time.monotonic() - t0, time.monotonic() - t0
                queue = AsyncCallsQueue()
                queue.schedule_async_request(dc.save(dict(self.sharded), d, async_sharded_save=True))
                blocked = time.monotonic() - t0
                queue.maybe_finalize_async_calls(blocking=True)
                queue.close()
                return blocked, time.monotonic() - t0
        strategy = self.register(variant)
        t0 = time.monotonic()
        if variant == "fastckpt":
            dc.save(dict(self.sharded), d, ("fastckpt", 1))
            return time.monotonic() - t0, time.monotonic() - t0
        request = dc.save(dict(self.sharded), d, ("fastckpt", 1), async_sharded_save=True)
        blocked = time.monotonic() - t0
        strategy.last_save.handle.wait()  # rank 0's resolves when it publishes the manifest: every rank durable
        durable = time.monotonic() - t0
        request.execute_sync()
        return blocked, durable

    # ------------------------------------------------------------------ loads
    def load(self, variant: str, d: str) -> float:
        from megatron.core import dist_checkpointing as dc

        t0 = time.monotonic()
        if variant == "torch":
            got = torch.load(os.path.join(d, f"mp_rank_{self.rank:02d}", "model_optim_rng.pt"), weights_only=True)
        elif variant == "torch_dcp":
            import torch.distributed.checkpoint as dcp

            state = self.dtensors(fill=False)
            dcp.load(state, checkpoint_id=d)
            got = {k: v.to_local() for k, v in state.items()}
        else:
            if variant == "fastckpt":
                self.register(variant)
            with cuda_calls_on_cpu() if variant == "torch_dist" else contextlib.nullcontext():
                got = dc.load(self.request(), d)
        seconds = time.monotonic() - t0
        bad = [k for k, t in self.local.items() if not torch.equal(got[k], t)]
        if bad:
            raise SystemExit(f"[rank {self.rank}] {variant}: loaded tensors differ from the saved ones: {bad[:3]}")
        return seconds


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    bench = Bench(parse_size(args.size), rank, world)
    rows: dict[str, dict[str, list[float]]] = {v: {"blocked": [], "durable": [], "load": []} for v in VARIANTS}
    for rnd in range(args.warmup + args.repeat):
        order = VARIANTS[rnd % len(VARIANTS):] + VARIANTS[: rnd % len(VARIANTS)]
        for variant in order:
            d = os.path.join(args.dir, f"r{rnd}-{variant}", "iter_0000001")
            if rank == 0:
                os.makedirs(d)
            dist.barrier()
            blocked, durable = bench.save(variant, d)
            dist.barrier()
            load = None
            if variant in LOADS:
                if rank == 0:
                    drop_cache(Path(d))
                dist.barrier()
                load = bench.load(variant, d)
            times: list = [None] * world
            dist.all_gather_object(times, (blocked, durable, load))
            if rnd >= args.warmup:
                for i, key in enumerate(("blocked", "durable", "load")):
                    if times[0][i] is not None:
                        rows[variant][key].append(max(t[i] for t in times))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(os.path.dirname(d))
                print(f"round {rnd} {variant}: blocked {max(t[0] for t in times):.3f} s, durable "
                      f"{max(t[1] for t in times):.3f} s"
                      + (f", load {max(t[2] for t in times):.3f} s" if load else ""),
                      flush=True)
    for ck in set(bench.cks.values()):
        ck.close()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({v: {k: median(xs) for k, xs in r.items()} for v, r in rows.items()}, f)
    dist.destroy_process_group()


def report(res: dict, args: argparse.Namespace) -> dict:
    print(f"\n{args.size} over 2 ranks, median of {args.repeat} (after {args.warmup} warm-up), "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs\n")
    print("| variant | blocked s | durable s | load s |\n|---|---:|---:|---:|")
    for v in VARIANTS:
        r = res[v]
        name = v + (" *" if v in STOOD_IN else "")
        print(f"| {name} | {fmt(r['blocked'])} | {fmt(r['durable'])} | {fmt(r['load'] if v in LOADS else None)} |")
    out = {}
    pools = (("the best Megatron option that runs here (torch, torch_dcp)", SHIPPED),
             ("torch_dist * (CUDA calls stood in)", STOOD_IN))
    for fast_name in ("fastckpt_async", "fastckpt_async_overlap"):
        fast = res[fast_name]
        for label, pool in pools:
            rb = fast["blocked"] / min(res[v]["blocked"] for v in pool)
            rd = fast["durable"] / min(res[v]["durable"] for v in pool)
            print(f"\n{fast_name} vs {label}: blocked {rb:.2f} x ({'PASS' if rb <= 0.5 else 'MISS'}, target <= 0.5), "
                  f"durable {rd:.2f} x ({'PASS' if rd <= 0.5 else 'MISS'}, target <= 0.5)")
            out[f"{fast_name} vs {label}"] = {"blocked_ratio": rb, "durable_ratio": rd}
    best_load = min(res[v]["load"] for v in SHIPPED)
    print(f"fastckpt load vs the best shipped Megatron load: {res['fastckpt']['load'] / best_load:.2f} x")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dir", help="where checkpoints are written (default: a temporary directory)")
    ap.add_argument("--json", help="also write the medians and ratios here")
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    base = args.dir or tempfile.mkdtemp(prefix="megatron-bench-")
    os.makedirs(base, exist_ok=True)
    out = os.path.join(base, "medians.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--size", args.size, "--repeat", str(args.repeat), "--warmup", str(args.warmup), "--dir", base,
           "--out", out]
    subprocess.run(cmd, check=True)
    with open(out) as f:
        res = json.load(f)
    ratios = report(res, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"medians": res, "ratios": ratios, "size": args.size, "repeat": args.repeat}, f, indent=1)
    if not args.dir:
        shutil.rmtree(base)


if __name__ == "__main__":
    main()
