"""One rank of the multi-process group tests (``tests/integration/test_groups.py``).

Run by ``torchrun --nproc_per_node=2 ... _group_worker.py --root DIR --scenario all`` (or, for
the SIGKILL case, started once per rank by the test with RANK/WORLD_SIZE/MASTER_* set and
``--scenario kill``). The process group is gloo over 127.0.0.1. Each rank writes what it saw
to ``DIR/results/rank{R}.json`` (rewritten after each scenario, so a rank that dies on purpose
leaves its record behind); the test checks the files on disk against ``expected_*`` below.

Scenarios (one directory each under ``DIR``):
  a  both ranks save a model and an optimizer shard into ``a/global_step{N}`` for N = 1..3,
     mutating the tensors right after ``save`` returns, and commit each step.
  c  a rank that saved nothing still commits: rank 1 saves nothing into ``c/global_step1``,
     rank 0 saves nothing into ``c/global_step2``.
  r  one tag ``r/last`` saved and committed at steps 1..7 (a file ``r{rank}.pt`` holding its step);
     after step 1 rank 1 alone commits it again with nothing saved (a retry on that rank) while
     rank 0 goes on to step 2; at steps 6 and 7 rank 1 has nothing new to save. Each rank records
     every commit's outcome and, once published, the step each file of the manifest was saved at.
  b  step 1 commits on both ranks; at step 2 rank 1 makes its files durable, then dies
     before ``commit`` (``os._exit(0)`` under torchrun, whose agent would tear rank 0 down
     on a failed rank, or SIGKILL with ``--scenario kill``). Rank 0's commit must raise
     CommitTimeoutError naming rank 1 within ``--timeout`` seconds.

A profiler installed on every thread but the main one records calls into torch.distributed
that run collectives (or any other ProcessGroup operation); fastckpt's worker threads must
make none. A positive control (one all_reduce from a helper thread on both ranks, before the
Checkpointer exists) proves the spy sees such calls.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

import fastckpt

STEPS = (1, 2, 3)
_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")
# Python-level entry points in distributed_c10d that talk to other ranks.
COLLECTIVES = frozenset({
    "all_gather", "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object", "all_reduce",
    "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast",
    "broadcast_object_list", "gather", "gather_object", "irecv", "isend", "monitored_barrier", "new_group",
    "new_subgroups", "recv", "recv_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "scatter", "scatter_object_list", "send", "send_object_list", "_all_gather_base", "_reduce_scatter_base",
    "init_process_group", "destroy_process_group",
})
# ProcessGroup (pybind11) methods that talk to other ranks, for callers that bypass the above.
PG_COLLECTIVES = frozenset({
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
    "_allgather_base", "all_gather_single", "all_gather_single_coalesced", "alltoall", "alltoall_base",
    "all_to_all_single", "barrier", "broadcast", "gather", "monitored_barrier", "recv", "recv_anysource",
    "reduce", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "scatter", "send",
})


def expected_model(rank: int, step: int) -> dict:
    """The model shard rank ``rank`` saves at ``step``: integer tensors, exact to compare."""
    w = torch.arange(65536, dtype=torch.int64) * (step + 1) + rank * 1_000_000
    return {"w": w, "w_view": w[100:200], "b": torch.full((7,), rank * 100 + step, dtype=torch.int32),
            "step": step, "rank": rank}


def expected_optim(rank: int, step: int) -> dict:
    return {"state": {0: {"exp_avg": torch.arange(1000, dtype=torch.int16) + rank + step,
                          "step": torch.tensor(step)}},
            "param_groups": [{"lr": 0.1, "params": [0]}]}


def shard_names(rank: int) -> tuple[str, str]:
    return f"model_rank{rank}.pt", f"optim_rank{rank}.pt"


class CollectiveSpy:
    """Records torch.distributed collectives made on any thread other than the main one."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []  # [thread name, what]
        self._lock = threading.Lock()

    def install(self) -> None:
        threading.setprofile(self._profile)  # every thread started from now on

    def _record(self, what: str) -> None:
        with self._lock:
            self.calls.append([threading.current_thread().name, what])

    def _profile(self, frame, event: str, arg) -> None:  # noqa: ANN001 (profiler protocol)
        if event == "call":
            code = frame.f_code
            if code.co_name in COLLECTIVES and code.co_filename.endswith(_C10D_FILE):
                self._record(f"distributed_c10d.{code.co_name}")
        elif event == "c_call":
            # A bound pybind11 method reports its function record as __self__, not the group.
            owner = type(getattr(arg, "__self__", None)).__name__
            if owner.startswith("pybind11") and getattr(arg, "__name__", "") in PG_COLLECTIVES:
                self._record(f"ProcessGroup.{arg.__name__}")

    def take(self) -> list[list[str]]:
        with self._lock:
            out, self.calls = self.calls, []
        return out


def spy_control(spy: CollectiveSpy) -> list[list[str]]:
    """Both ranks run collectives on a helper thread (both entry points); the spy must see them."""
    t = torch.ones(1)

    def collectives() -> None:
        dist.all_reduce(t)
        dist.group.WORLD.barrier().wait()

    th = threading.Thread(target=collectives, name="spy-control")
    th.start()
    th.join()
    if t.item() != dist.get_world_size():
        raise RuntimeError(f"control all_reduce returned {t.item()}")
    return spy.take()


class Worker:
    def __init__(self, root: str, rank: int, world: int, timeout_s: float) -> None:
        self.root, self.rank, self.world = root, rank, world
        self.ck = fastckpt.Checkpointer(commit_timeout_s=timeout_s, overhead_budget=0.99)
        self.result: dict = {"rank": rank, "world_size": world, "pid": os.getpid(),
                             "ck_rank": self.ck.rank, "ck_world_size": self.ck.world_size}

    def dump(self) -> None:
        d = os.path.join(self.root, "results")
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f".rank{self.rank}.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.result, f, indent=1, sort_keys=True)
        os.replace(tmp, os.path.join(d, f"rank{self.rank}.json"))

    def save_shards(self, group: str, step: int) -> list[fastckpt.SaveHandle]:
        model, optim = expected_model(self.rank, step), expected_optim(self.rank, step)
        m_name, o_name = shard_names(self.rank)
        handles = [self.ck.save(model, os.path.join(group, m_name), group=group),
                   self.ck.save(optim, os.path.join(group, o_name), group=group)]
        # The snapshot is taken by save(): training may change the tensors at once.
        model["w"].add_(7)
        optim["state"][0]["exp_avg"].mul_(3)
        return handles

    def train_step(self) -> None:
        """A collective on the main thread while fastckpt works in the background."""
        t = torch.full((4,), float(self.rank))
        dist.all_reduce(t)
        if t[0].item() != sum(range(self.world)):
            raise RuntimeError(f"all_reduce returned {t.tolist()}")

    def scenario_a(self) -> dict:
        parent = os.path.join(self.root, "a")
        commits = []
        for step in STEPS:
            group = os.path.join(parent, f"global_step{step}")
            self.save_shards(group, step)
            self.train_step()
            commits.append(self.ck.commit(group, step=step))
        records = [h.wait(timeout=60) for h in commits]
        self.ck.wait()
        return {"groups": [r.path for r in records], "bytes": [r.bytes for r in records]}

    def scenario_c(self) -> dict:
        parent = os.path.join(self.root, "c")
        out = {}
        for step, silent_rank in ((1, 1), (2, 0)):
            group = os.path.join(parent, f"global_step{step}")
            if self.rank != silent_rank:
                self.save_shards(group, step)
            rec = self.ck.commit(group, step=step).wait(timeout=60)
            out[str(step)] = {"saved_nothing": self.rank == silent_rank, "bytes": rec.bytes}
        return out

    def scenario_r(self) -> list[dict]:
        group, out = os.path.join(self.root, "r", "last"), []
        plan = [(1, True), (1, False), *((s, True) for s in range(2, 6)), (6, False), (7, False)] \
            if self.rank == 1 else [(s, True) for s in range(1, 8)]
        for step, saves in plan:
            if saves:
                self.ck.save({"step": step}, os.path.join(group, f"r{self.rank}.pt"), group=group)
            try:
                self.ck.commit(group, step=step).wait(timeout=60)
            except fastckpt.FastCkptError as exc:
                out.append({"step": step, "error": f"{type(exc).__name__}: {exc}"})
                continue
            with open(os.path.join(group, "fastckpt-manifest.json"), encoding="utf-8") as f:
                m = json.load(f)
            out.append({"step": step, "published": m["step"],
                        "files": {n: fastckpt.load(os.path.join(group, n))["step"] for n in sorted(m["files"])}})
        return out

    def scenario_b(self, die: str, timeout_s: float) -> dict:
        parent = os.path.join(self.root, "b")
        g1, g2 = (os.path.join(parent, f"global_step{s}") for s in (1, 2))
        self.save_shards(g1, 1)
        self.ck.commit(g1, step=1).wait(timeout=60)
        handles = self.save_shards(g2, 2)
        if self.rank == 1:
            for h in handles:
                h.wait(timeout=60)  # its files are durable; only the commit is missing
            self.result["b"] = {"died": die}
            self.result["bg_collectives"] = spy.take()
            self.dump()
            sys.stdout.flush()
            sys.stderr.flush()
            if die == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(0)
        t0 = time.monotonic()
        handle = self.ck.commit(g2, step=2)
        out: dict = {"timeout_s": timeout_s}
        try:
            handle.wait(timeout=timeout_s + 60)
            out["error"] = None
        except fastckpt.CommitTimeoutError as exc:
            out["error"] = type(exc).__name__
            out["message"] = str(exc)
        out["elapsed_s"] = time.monotonic() - t0
        return out

    def close(self) -> None:
        self.ck.close()
        for t in threading.enumerate():  # close() hands idle staging memory to a thread that unmaps it and ends
            if t.name == "fastckpt-free":
                t.join(30)
        self.result["fastckpt_threads_after_close"] = [
            t.name for t in threading.enumerate() if t.name.startswith("fastckpt")]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--scenario", choices=("all", "kill"), required=True)
    p.add_argument("--timeout", type=float, default=5.0)
    args = p.parse_args()

    spy.install()
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    w = Worker(args.root, rank, world, args.timeout)
    w.result["spy_control"] = spy_control(spy)
    if args.scenario == "all":
        w.result["a"] = w.scenario_a()
        w.result["c"] = w.scenario_c()
        w.result["r"] = w.scenario_r()
        w.dump()
        w.result["b"] = w.scenario_b("exit", args.timeout)
    else:
        w.result["b"] = w.scenario_b("kill", args.timeout)
    w.close()  # only rank 0 gets here: rank 1 died in scenario b
    w.result["bg_collectives"] = spy.take()
    w.dump()
    dist.destroy_process_group()
    return 0


spy = CollectiveSpy()

if __name__ == "__main__":
    sys.exit(main())
