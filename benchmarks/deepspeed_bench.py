"""DeepSpeed benchmark: the same ZeRO-2 training run with each checkpoint engine, in one invocation.

Run (from the repository root, with the project's venv; 2 CPU processes per variant):

    python benchmarks/deepspeed_bench.py [--steps 40] [--every 5] [--width 2048] [--depth 4] [--repeat 1]
                                         [--dir DIR] [--json OUT] [--variants a,b,...]

Each variant is one ``torchrun --nproc-per-node 2`` launch of this script (``--worker``): the
same MLP, AdamW, data and schedule, a ``save_checkpoint`` every ``--every`` steps.

  none               no checkpoints: the baseline the overheads are taken of
  deepspeed          DeepSpeed's default engine (TorchCheckpointEngine: torch.save on the training
                     thread, no fsync)
  ds-python          ``"checkpoint": {"writer": {"type": "python"}}``: DeepSpeed's buffered writer,
                     synchronous
  ds-python-decoupled  DeepSpeed's async option: the same writer in a separate process
                     (``"decoupled": true``), committed at a later step
  ds-fast            ``"writer": {"type": "fast"}``: DeepSpeed's async_io writer
  ds-fast-decoupled  the same, decoupled
  fastckpt           the "fastckpt" section, no burst buffer (direct tier)
  fastckpt-nvme      the "fastckpt" section with local_dir (a burst buffer on the same disk here)
  fastckpt-lazy      the "fastckpt" section with "lazy_snapshot": true (no burst buffer): the copy
                     runs beside the next step's forward and backward; its stall adds the wait of
                     that step's optimizer step for the copy (the fence)
DeepSpeed 0.19.8's writer options need an ``mpu`` (without one, engine creation fails with
"'UniversalParallelInfo' object has no attribute 'dp_rank'") and the CROSS_SIZE/CROSS_RANK
variables its own launcher sets: the ds-* variants get a data-parallel-only ``DataParallelMPU``
and both variables. A variant that fails is listed with its error.

Columns, per checkpoint unless said otherwise (medians over the run's checkpoints):
  stall      seconds inside ``engine.save_checkpoint`` on rank 0 (the training thread blocked)
  durable    save_checkpoint called -> every rank's files fsynced and published. DeepSpeed's
             engines never fsync: for ``deepspeed`` the benchmark fsyncs the tag's files right
             after the call and adds that (outside the stall and the overhead); for the
             decoupled engines it is not measured (the writer process reports nothing).
             fastckpt's comes from its report to DeepSpeed's monitor (the CSV monitor here).
  overhead   (wall - the "none" wall) / the "none" wall, for the whole run; with --repeat, the
             fastest round of each (variants interleaved, each round rotated by one)
  blocked %  a run's total stall / the "none" wall: the figure that holds on a noisy machine
Target (issue #11): fastckpt's stall <= 0.2 x the default engine's.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ["none", "deepspeed", "ds-python", "ds-python-decoupled", "ds-fast", "ds-fast-decoupled", "fastckpt",
            "fastckpt-nvme", "fastckpt-lazy"]
WRITERS = {"ds-python": {"type": "python"}, "ds-python-decoupled": {"type": "python", "decoupled": True},
           "ds-fast": {"type": "fast"}, "ds-fast-decoupled": {"type": "fast", "decoupled": True}}


def variant_config(name: str, root: Path) -> dict:
    """The DeepSpeed config of one variant (the part that differs)."""
    cfg: dict = {}
    if name in WRITERS:
        cfg["checkpoint"] = {"writer": WRITERS[name]}
    if name == "fastckpt":
        cfg["fastckpt"] = {"overhead_budget": 0.5}
    if name == "fastckpt-nvme":
        cfg["fastckpt"] = {"local_dir": str(root / "nvme"), "overhead_budget": 0.5, "keep_local": 2}
    if name == "fastckpt-lazy":
        cfg["fastckpt"] = {"overhead_budget": 0.5, "lazy_snapshot": True}
    if name.startswith("fastckpt"):
        cfg["csv_monitor"] = {"enabled": True, "output_path": str(root / "csv"), "job_name": name}
    return cfg


# ----------------------------------------------------------------------------- worker (torchrun)
class DataParallelMPU:
    """The model-parallel unit DeepSpeed's writer options require: data parallel only."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.dp = dist.new_group(list(range(self.world)))
        self.mp = [dist.new_group([r]) for r in range(self.world)][self.rank]  # every rank creates every group

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_model_parallel_group(self):  # noqa: ANN201
        return self.mp

    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_world_size(self) -> int:
        return self.world

    def get_data_parallel_rank(self) -> int:
        return self.rank

    def get_data_parallel_group(self):  # noqa: ANN201
        return self.dp

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(range(self.world))


def worker(args: argparse.Namespace) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    from fastckpt.integrations.deepspeed import initialize

    root = Path(args.dir)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(256, args.width), torch.nn.GELU()]
    for _ in range(args.depth - 1):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 1))
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 2}, **variant_config(args.variant, root)}
    mpu = None
    if args.variant in WRITERS:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        mpu = DataParallelMPU()
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=config, mpu=mpu)
    save_dir = root / "ckpt" / args.variant
    stalls, fsyncs, fences = [], [], []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        g = torch.Generator().manual_seed(step * 10 + engine.global_rank)
        x = torch.randn(8, 256, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), x.mean(dim=1, keepdim=True))
        engine.backward(loss)
        engine.step()
        if args.variant == "fastckpt-lazy" and len(fences) < len(stalls):  # this step fenced the last save
            fences.append(next(p.fence_s or 0.0 for p in engine.checkpoint_engine.pending
                               if p.tag == f"step{step - 1}"))
        if args.variant != "none" and step % args.every == 0:
            s0 = time.perf_counter()
            engine.save_checkpoint(str(save_dir), tag=f"step{step}")
            stalls.append(time.perf_counter() - s0)
            if args.variant == "deepspeed":  # durable only once fsynced: time it, outside the stall
                f0 = time.perf_counter()
                for p in (save_dir / f"step{step}").iterdir():
                    fd = os.open(p, os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
                fsyncs.append(time.perf_counter() - f0)
    train_wall = time.perf_counter() - t0
    stalls = [s + f for s, f in zip(stalls, fences + [0.0] * (len(stalls) - len(fences)))]  # the last: no step after
    f0 = time.perf_counter()
    engine.destroy()  # fastckpt: flushes; the others: nothing pending on this thread
    flush_s = time.perf_counter() - f0
    wall = train_wall - sum(fsyncs)
    torch.distributed.barrier()  # then a clean exit: gloo can abort a rank whose peer exited first
    torch.distributed.destroy_process_group()
    if engine.global_rank == 0:
        durable = [s + f for s, f in zip(stalls, fsyncs)] if fsyncs else _fastckpt_durable(root, args.variant)
        size = sum(p.stat().st_size for p in (save_dir / f"step{args.steps}").iterdir()) if stalls else 0
        out = {"variant": args.variant, "wall_s": wall, "flush_s": flush_s, "stalls": stalls, "durable": durable,
               "checkpoint_bytes": size, "fences": fences}
        Path(args.result).write_text(json.dumps(out))


def _fastckpt_durable(root: Path, variant: str) -> list[float]:
    path = root / "csv" / variant / "Checkpoint_fastckpt_durable_s.csv"
    if not path.exists():
        return []
    with open(path) as f:
        return [float(row[1]) for row in list(csv.reader(f))[1:]]


# ----------------------------------------------------------------------------- driver
def run_variant(name: str, args: argparse.Namespace, root: Path) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    result = root / f"{name}.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CROSS_SIZE="1", CROSS_RANK="0",
               TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions")))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, "--worker",
           "--variant", name, "--dir", str(root), "--result", str(result), "--steps", str(args.steps),
           "--every", str(args.every), "--width", str(args.width), "--depth", str(args.depth)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=args.variant_timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        output, _ = proc.communicate()
        errors = [line.removeprefix("[rank0]: ") for line in output.splitlines() if "Error: " in line]
        why = f" (after {errors[-1][:120]})" if errors else ""
        return {"variant": name, "error": f"hung: killed after {args.variant_timeout:.0f} s{why}"}
    if proc.returncode != 0 or not result.exists():
        out = output.splitlines()
        err = [line.removeprefix("[rank0]: ") for line in out if re.match(r"\[rank0\]: \w+(Error|Exception): ", line)]
        return {"variant": name, "error": (err[-1] if err else f"exit {proc.returncode}")[:200], "tail": out[-20:]}
    return json.loads(result.read_text())


def _kill_tree(pid: int) -> None:
    """SIGKILL the launcher and everything below it: torchrun puts each worker in a session of
    its own, and a decoupled writer process hangs off a worker."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _combine(name: str, results: list[dict]) -> dict:
    """One row from a variant's rounds: every checkpoint's numbers, the least disturbed wall
    (on a shared machine other jobs only ever add time)."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[0] if results else {"variant": name, "error": "not run"}
    failed = [r["error"] for r in results if "error" in r]
    results = ok
    return {"variant": name, "failed_rounds": failed, "wall_s": min(r["wall_s"] for r in results),
            "walls": [r["wall_s"] for r in results],
            "stalls": [x for r in results for x in r["stalls"]], "durable": [x for r in results for x in r["durable"]],
            "checkpoint_bytes": results[0]["checkpoint_bytes"], "flush_s": [r["flush_s"] for r in results]}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir, removed)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeat", type=int, default=1, help="rounds; walls are the fastest round's")
    p.add_argument("--variant-timeout", type=float, default=240.0, help="seconds before a variant counts as hung")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    names = args.variants.split(",")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for i in range(args.repeat):  # interleaved, each round rotated by one
            for name in names[i % len(names):] + names[: i % len(names)]:
                if not (runs[name] and "error" in runs[name][0]):  # one that cannot run is not retried
                    runs[name].append(run_variant(name, args, Path(tmp) / f"round{i}"))
    rows = [_combine(name, runs[name]) for name in names]
    base = next((r["wall_s"] for r in rows if r["variant"] == "none" and "wall_s" in r), None)
    ref = next((_median(r["stalls"]) for r in rows if r["variant"] == "deepspeed" and "stalls" in r), None)
    print(f"ZeRO-2, 2 CPU processes, {args.steps} steps, a checkpoint every {args.every} "
          f"(width {args.width}, depth {args.depth}), {args.repeat} round(s)")
    print(f"{'variant':<22}{'ckpt MB':>9}{'stall s':>9}{'x default':>10}{'durable s':>11}{'overhead':>10}"
          f"{'blocked %':>10}  note")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<22}{'':>59}  does not run here: {r['error']}")
            continue
        stall = _median(r["stalls"])
        over = None if base is None else (r["wall_s"] - base) / base
        blocked = None if base is None or not r["stalls"] else sum(r["stalls"]) / len(r["walls"]) / base
        ratio = None if ref is None or stall is None else stall / ref
        note = "durable = stall + fsync" if r["variant"] == "deepspeed" else ""
        if r["failed_rounds"]:
            note += f" ({len(r['failed_rounds'])} round(s) failed: {r['failed_rounds'][0][:60]})"
        print(f"{r['variant']:<22}{r['checkpoint_bytes'] / 1e6:>9.0f}{_fmt(stall):>9}{_fmt(ratio, '.2f'):>10}"
              f"{_fmt(_median(r['durable'])):>11}{_fmt(over, '.1%'):>10}{_fmt(blocked, '.1%'):>10}  {note}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
