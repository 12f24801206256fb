"""Worker for the Megatron tests: run on 2 ranks with torchrun, or on 1 rank as a plain script.

Usage: [torchrun --nproc_per_node 2] _megatron_worker.py SCENARIO DIR OUT_JSON

Scenarios (each rank writes OUT_JSON.<rank>):
  loop    2 ranks. Saves iterations 1, 2, 3... (async, then execute_sync) and prints
          ``durable N``; at the moment named by $KILL_AT in iteration 3 (``write``: rank 1 in
          the middle of its tensor file; ``manifest``: rank 0 about to publish the manifest;
          ``tracker``: rank 0 about to move the tracker) it prints ``GATE`` and stops there
          until the test SIGKILLs it.
  cuda    2 ranks on 2 GPUs (NCCL): an async save of CUDA tensors through megatron's AsyncCallsQueue
          as it ships, loaded back resharded onto CUDA.
  verify  1 rank. For each directory in DIR (separated by os.pathsep): what the tracker says,
          what ``sync_tracker`` makes of it, what ``fastckpt.latest`` says, and whether that
          iteration loads with exactly its step's values.
  save    2 ranks. iter 1: synchronous save; iter 2: async save run by megatron's AsyncCallsQueue
          (its forked child waits for our commit); iter 3: async save finished by execute_sync.
          The tensors are changed right after each async save returns: the checkpoint must hold
          the values of the save call. Then iter 2 is loaded with the saved layout and iter 3
          resharded along other axes; iter 4 fails on rank 1 (ENOSPC), which both ranks report;
          iter 5 holds a tensor rank 1 cannot save, which both ranks report without hanging.
  resave  1 rank. Commits iteration 100, then saves into it again (megatron rewrites common.pt
          in place before our strategy runs): one the strategy refuses, one that succeeds, one
          whose write fails (ENOSPC); prints ``REPORT <json>`` with what iteration 100 loaded
          after each, then a fourth save stops at its first tensor write (``GATE``) until the
          test SIGKILLs it.
  failures  2 ranks. Saves that fail on one rank: into a committed iteration (rank 1's file), at
          rank 0's metadata.json (after the index exchange), at rank 0's tracker (after the
          commit); what each rank raised, how long it took, and what then loads.
  resave_check  1 rank, after ``resave`` was killed: loading iteration 100 as it is, then with
          its metadata.json also torn (a kill in megatron's finalize), after ``sync_tracker``.
  load    1 rank. Loads iter 2 and 3 whole; then the error cases: another global shape, another
          object layout, a flipped byte, an uncommitted checkpoint.
The state (``make_state``) is a function of the step, the rank and a layout name, so any
process can rebuild the expected global tensors (``global_tensors``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
import traceback
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")

# 128 MiB of float32 by default: each rank's half spans several 16 MiB checksum blocks
BIG = tuple(int(n) for n in os.environ.get("MEGATRON_TEST_BIG", "4096,8192").split(","))


def global_tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(64, 96, generator=g),
        "big": torch.arange(BIG[0] * BIG[1], dtype=torch.float32).reshape(BIG) * step,
        "grid": torch.randint(-1000, 1000, (8, 12), generator=g, dtype=torch.int64),
        "stack": torch.randn(2, 5, 6, generator=g).to(torch.bfloat16),
        "tview": torch.randn(6, 10, generator=g),
        "ln": torch.full((7,), float(step)),
    }


def _rows(t: torch.Tensor, axis: int, r: int, n: int) -> torch.Tensor:
    return t.chunk(n, dim=axis)[r]


def make_state(step: int, rank: int, world: int, layout: str) -> dict:
    """A Megatron-like sharded state dict. ``save``: w split on axis 1, big on axis 1, grid 2x2
    (two blocks per rank), stack along a prepended axis, tview as a transposed view, ln
    replicated (rank 0 holds the main replica), one object per rank and a replicated one.
    ``reshard``: the same tensors split along the other axes. ``full``: whole tensors."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    g = global_tensors(step)
    st = ShardedTensor.from_rank_offsets
    objs = {"rank_obj": ShardedObject("rank_obj", {"rank": rank, "step": step}, (world,), (rank,), replica_id=0),
            "shared_obj": ShardedObject("shared_obj", [step, "shared"], (1,), (0,), replica_id=rank)}
    common = {"iteration": step, "args": {"lr": 0.5, "name": "tiny-gpt"}}
    if layout == "full":
        sd = {k: st(k, v.clone()) for k, v in g.items() if k not in ("stack",)}
        sd["stack"] = [st("stack", g["stack"][i].clone(), (0, i, 2), prepend_axis_num=1) for i in range(2)]
        return {**sd, **common}
    if layout == "save":
        tv = _rows(g["tview"], 0, rank, world).t().contiguous().t()  # a non-contiguous (transposed) view
        sd = {"w": st("w", _rows(g["w"], 1, rank, world).clone(), (1, rank, world)),
              "big": st("big", _rows(g["big"], 1, rank, world).clone(), (1, rank, world)),
              "grid": [st("grid", _rows(_rows(g["grid"], 0, rank, 2), 1, j, 2).clone(), (0, rank, 2), (1, j, 2))
                       for j in range(2)],
              "stack": st("stack", g["stack"][rank].clone(), (0, rank, world), prepend_axis_num=1),
              "tview": st("tview", tv, (0, rank, world)),
              "ln": st("ln", g["ln"].clone(), replica_id=rank)}
    else:  # reshard
        sd = {"w": st("w", _rows(g["w"], 0, rank, world).clone(), (0, rank, world)),
              "big": st("big", _rows(g["big"], 0, rank, world).clone(), (0, rank, world)),
              "grid": st("grid", _rows(g["grid"], 1, rank, world).clone(), (1, rank, world)),
              "stack": st("stack", g["stack"][:, :, rank * 3:(rank + 1) * 3].clone(), (2, rank, world)),
              "tview": st("tview", _rows(g["tview"], 1, rank, world).clone(), (1, rank, world)),
              "ln": st("ln", g["ln"].clone(), replica_id=rank)}
    return {**sd, **objs, **common}


def expected(sd: dict, step: int) -> dict:
    """What loading ``sd`` must return: the saved step's values in ``sd``'s boxes."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace

    g = global_tensors(step)

    def cut(sh: object) -> object:
        if isinstance(sh, ShardedObject):
            return sh.data
        if not isinstance(sh, ShardedTensor):
            return sh
        box = tuple(slice(o, o + n) for o, n in zip(sh.global_offset, (1,) * sh.prepend_axis_num + sh.local_shape))
        return g[sh.key][box].reshape(sh.local_shape)

    return dict_list_map_outplace(cut, sd)


def without_data(sd: dict) -> dict:
    """The same request with fresh (garbage) tensors, so a load must really fill them."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace

    def empty(sh: object) -> object:
        if isinstance(sh, ShardedTensor):
            return ShardedTensor(**{**sh.__dict__, "data": torch.full_like(sh.data, 7)})
        if isinstance(sh, ShardedObject):
            return sh.without_data()
        return sh

    return dict_list_map_outplace(empty, sd)


def same(got: object, want: object) -> bool:
    if isinstance(want, dict):
        return isinstance(got, dict) and all(k in got and same(got[k], v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(same(a, b) for a, b in zip(got, want))
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    return got == want


def mutate(sd: dict) -> None:
    """Training goes on: change every tensor in place."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    for sh in nested_values(sd):
        if isinstance(sh, ShardedTensor):
            sh.data.add_(1)


@contextlib.contextmanager
def cuda_calls_on_cpu():
    """megatron-core 0.16.1's AsyncCallsQueue calls torch.cuda.synchronize() before it forks its
    worker and all-reduces its "done" flags on torch.cuda.current_device(); a CPU-only torch
    raises on both. For this test only they run on the CPU (the all-reduce then goes through
    gloo); nothing of fastckpt's is replaced."""
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize, torch.cuda.current_device = (lambda *a, **k: None), (lambda: "cpu")
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


def _error(fn) -> dict | None:  # noqa: ANN001
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 (reported to the test)
        return {"type": type(exc).__name__, "message": str(exc), "mro": [c.__name__ for c in type(exc).__mro__]}
    return None


def scenario_save(d: str, rank: int, world: int) -> dict:
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    import fastckpt
    from fastckpt.integrations import megatron as fm
    from fastckpt.testing import Fault, FaultyOps

    ops = FaultyOps()
    ck = fastckpt.Checkpointer(ops=ops, commit_timeout_s=10.0)
    save, load = fm.register(ck)
    out: dict = {}

    def it(n: int) -> str:  # megatron wants the directory made by rank 0 before a save
        path = os.path.join(d, f"iter_{n:07d}")
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        return path

    sd = make_state(1, rank, world, "save")
    dc.save(sd, it(1), ("fastckpt", 1))
    out["tracker_after_sync"] = fm.read_tracker(d)

    sd = make_state(2, rank, world, "save")
    with cuda_calls_on_cpu():
        queue = AsyncCallsQueue()
        queue.schedule_async_request(dc.save(sd, it(2), ("fastckpt", 1), async_sharded_save=True))
        out["blocked_s_2"] = save.last_save.blocked_s
        mutate(sd)
        out["finalized"] = queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
    out["tracker_after_queue"] = fm.read_tracker(d)

    sd = make_state(3, rank, world, "save")
    request = dc.save(sd, it(3), ("fastckpt", 1), async_sharded_save=True)
    mutate(sd)
    request.execute_sync()
    out["tracker_after_execute_sync"] = fm.read_tracker(d)
    out["durable_s_3"] = save.last_save.handle.wait().durable_s

    want = make_state(2, rank, world, "save")
    got = dc.load(without_data(want), it(2))
    out["same_layout_equal"] = same(got, expected(want, 2))
    want = make_state(2, rank, world, "save")  # tview saved as a transposed view, asked for contiguous
    want["tview"] = ShardedTensor(**{**want["tview"].__dict__, "data": want["tview"].data.contiguous()})
    got = dc.load(without_data(want), it(2))
    out["contiguous_request"] = [same(got, expected(want, 2)), got["tview"].is_contiguous()]
    want = make_state(3, rank, world, "reshard")
    got = dc.load(without_data(want), it(3))
    out["reshard_equal"] = same(got, expected(want, 3))
    out["reshard_report"] = load.last_load.__dict__
    out["file_sizes"] = {n: os.path.getsize(os.path.join(it(3), n)) for n in os.listdir(it(3))
                         if not n.startswith(".")}
    out["latest"] = fastckpt.latest(d)
    index = ck.load(os.path.join(it(3), fm.INDEX_FILE))
    out["index_counts"] = {k: sum(t["key"] == k for t in index["tensors"]) for k in ("ln", "grid", "big", "stack")}

    ops.inject(Fault("pwrite", errno.ENOSPC, path_contains=f"iter_0000004{os.sep}fastckpt-rank00001"))
    sd = make_state(4, rank, world, "save")
    out["failed_save"] = _error(lambda: dc.save(sd, it(4), ("fastckpt", 1)))
    out["tracker_after_failure"] = fm.read_tracker(d)

    class Odd(torch.Tensor):  # a tensor subclass (like FP8's) that fastckpt refuses, on rank 1 only
        pass

    sd = make_state(5, rank, world, "save")
    if rank == 1:
        sd["w"].data = sd["w"].data.as_subclass(Odd)
    out["refused_save"] = _error(lambda: dc.save(sd, it(5), ("fastckpt", 1)))
    out["close"] = _error(ck.close)
    return out


def scenario_load(d: str, rank: int, world: int) -> dict:
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    from fastckpt.integrations import megatron as fm

    _, load = fm.register()
    out: dict = {}
    it = lambda n: os.path.join(d, f"iter_{n:07d}")  # noqa: E731
    for step in (2, 3):
        want = make_state(step, 0, 1, "full")
        out[f"full_equal_{step}"] = same(dc.load(without_data(want), it(step)), expected(want, step))
        out[f"report_{step}"] = load.last_load.__dict__
    wrong = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64, 100))}
    out["shape_error"] = _error(lambda: dc.load(wrong, it(2)))
    objs = {"rank_obj": ShardedObject("rank_obj", None, (3,), (0,))}
    out["object_error"] = _error(lambda: dc.load(objs, it(2), validate_access_integrity=False))

    bad = os.path.join(d, "corrupt", "iter_0000003")
    shutil.copytree(it(3), bad)
    victim = os.path.join(bad, "fastckpt-rank00001.pt")
    with open(victim, "r+b") as f:  # a byte in the middle of rank 1's "big" shard
        f.seek(os.path.getsize(victim) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    want = make_state(3, 0, 1, "full")
    out["corrupt_error"] = _error(lambda: dc.load(without_data(want), bad))
    out["corrupt_file"] = victim

    out["swapped_error"] = _swapped_mid_load(d, it(2), it(3))
    out["common_swapped"] = _swapped_after_common(d, it(2), it(3))
    out["common_cases"] = _common_loader_cases(os.path.join(d, "common-cases"))

    lost = os.path.join(d, "lost", "iter_0000003")
    shutil.copytree(it(3), lost)
    os.unlink(os.path.join(lost, "fastckpt-rank00001.pt"))  # a rank's tensor file deleted after the commit
    out["lost_error"] = _error(lambda: dc.load(without_data(want), lost))

    half = os.path.join(d, "incomplete", "iter_0000003")
    shutil.copytree(it(3), half)
    os.unlink(os.path.join(half, "fastckpt-manifest.json"))
    out["incomplete_error"] = _error(lambda: dc.load(without_data(want), half))
    return out


def _swapped_mid_load(d: str, older: str, newer: str) -> dict | None:
    """Load iteration 3 while another save of it is swapped in (a directory exchange, as a re-save
    publishes) after the first tensor block was read: the error ``dc.load`` raises, if any."""
    from megatron.core import dist_checkpointing as dc

    import fastckpt
    from fastckpt.integrations import megatron as fm
    from fastckpt.io.ops import FileOps
    from fastckpt.testing import FaultyOps

    here, other = os.path.join(d, "swap", "iter_0000003"), os.path.join(d, "swap-other", "iter_0000003")
    shutil.copytree(newer, here)
    shutil.copytree(older, other)  # another save of the tag (iteration 2's values): a re-save swapped in
    swapped = []

    def hook(op: str, path: str) -> None:
        if op == "preadv" and os.path.basename(path).startswith("fastckpt-rank") and not swapped:
            swapped.append(path)
            FileOps().exchange(here, other)

    ops = FaultyOps(on_call=hook)
    fm.register(fastckpt.Checkpointer(ops=ops), ops=ops)
    try:
        return _error(lambda: dc.load(without_data(make_state(3, 0, 1, "full")), here))
    finally:
        fm.register()


def _swapped_after_common(d: str, older: str, newer: str) -> dict:
    """Load iteration 3 while another save of it (iteration 2's values) is swapped in right after
    megatron read common.pt: the error ``dc.load`` raises, or which save the common state and the
    tensors loaded are of."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import serialization

    from fastckpt.io.ops import FileOps

    here, other = os.path.join(d, "swap-common", "iter_0000003"), os.path.join(d, "swap-common-other", "iter_0000003")
    shutil.copytree(newer, here)
    shutil.copytree(older, other)
    real = serialization.load_preprocess

    def preprocess(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 (megatron calls it right after load_common)
        FileOps().exchange(here, other)
        return real(*args, **kwargs)

    got: dict = {}
    serialization.load_preprocess = preprocess
    try:
        error = _error(lambda: got.update(dc.load(without_data(make_state(3, 0, 1, "full")), here)))
    finally:
        serialization.load_preprocess = real
    return {"error": error, "common_iteration": got.get("iteration"),
            "tensor_step": float(got["ln"][0]) if "ln" in got else None}


def _common_loader_cases(d: str) -> dict:
    """What the common loader registered in megatron's place does (the diff review's cases):
    ``torch_dist``: an iteration saved with fastckpt, then again with megatron's torch_dist (its
    old manifest stays): what ``repair_checkpoint`` and ``sync_tracker`` (the patched load path)
    put back (nothing: it is megatron's save now) and what loads then; ``stale``:
    load_common_state_dict (as Megatron-LM does first), the iteration re-saved and swapped in,
    then a load with megatron's own common loader: the error, if any; ``two_calls``: a sharded
    load called twice in one load (objects, then tensors, as FullyParallelLoadStrategyWrapper
    does), a re-save swapped in between."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, merge
    from megatron.core.dist_checkpointing.strategies.base import LoadShardedStrategy
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    from fastckpt.integrations import megatron as fm
    from fastckpt.io.ops import FileOps

    _, base = fm.register()
    out: dict = {}
    td = os.path.join(d, "td", "iter_0000003")
    os.makedirs(td)
    dc.save(make_state(2, 0, 1, "full"), td, ("fastckpt", 1))
    with cuda_calls_on_cpu():  # megatron's torch_dist save calls torch.cuda
        dc.save(make_state(3, 0, 1, "full"), td, ("torch_dist", 1))
        out["put_back"] = fm.repair_checkpoint(td)
        fm.sync_tracker(os.path.dirname(td), load_iteration=3)
        from fastckpt.cli._discovery import checkpoint_files, homes
        out["verify_td"] = _error(lambda: checkpoint_files(homes(None), td))  # what `fastckpt verify` reads
        got: dict = {}
        out["torch_dist_error"] = _error(lambda: got.update(dc.load(without_data(make_state(3, 0, 1, "full")), td)))
    out["torch_dist"] = [got.get("iteration"), float(got["ln"][0]) if "ln" in got else None]

    def state(step: int) -> dict:
        return {**make_state(step, 0, 1, "full"), "rank_obj": ShardedObject("rank_obj", {"step": step}, (1,), (0,))}

    here, other = os.path.join(d, "a", "iter_0000003"), os.path.join(d, "b", "iter_0000003")
    for path, step in ((here, 3), (other, 2)):
        os.makedirs(path)
        dc.save(state(step), path, ("fastckpt", 1))
    dc.load_common_state_dict(here)
    FileOps().exchange(here, other)  # iteration 3 saved again and swapped in, well before the load
    theirs = TorchCommonLoadStrategy()
    out["stale_error"] = _error(lambda: dc.load(without_data(state(2)), here, common_strategy=theirs))
    FileOps().exchange(here, other)  # back: iteration 3's values at ``here``

    class TwoCalls(LoadShardedStrategy):
        def load(self, sharded_state_dict, checkpoint_dir):  # noqa: ANN001, ANN201
            objs, tensors = extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedObject))
            loaded = base.load(objs, checkpoint_dir)
            FileOps().exchange(here, other)  # swapped in between the two calls
            merge(loaded, base.load(tensors, checkpoint_dir))
            return loaded

        def load_tensors_metadata(self, checkpoint_dir):  # noqa: ANN001, ANN201
            return base.load_tensors_metadata(checkpoint_dir)

        def check_backend_compatibility(self, loaded_version):  # noqa: ANN001, ANN201
            return base.check_backend_compatibility(loaded_version)

        def check_version_compatibility(self, loaded_version):  # noqa: ANN001, ANN201
            return base.check_version_compatibility(loaded_version)

        @property
        def can_handle_sharded_objects(self) -> bool:
            return True

    out["two_calls_error"] = _error(lambda: dc.load(without_data(state(3)), here, sharded_strategy=TwoCalls()))
    return out


def scenario_loop(d: str, rank: int, world: int) -> dict:
    import threading

    from megatron.core import dist_checkpointing as dc

    import fastckpt
    from fastckpt.integrations import megatron as fm
    from fastckpt.io.atomic import final_path
    from fastckpt.testing import FaultyOps

    target, hold, trackers = os.environ["KILL_AT"], threading.Event(), []

    def hook(op: str, path: str) -> None:
        name = os.path.basename(final_path(path) or path)  # a temp file's name carries the name it gets
        if op == "replace" and name == fm.TRACKER:
            trackers.append(path)
        hit = {"write": op == "pwrite" and "iter_0000003" in path and name.startswith("fastckpt-rank00001"),
               "manifest": op == "replace" and "iter_0000003" in path and name == "fastckpt-manifest.json",
               "tracker": op == "replace" and name == fm.TRACKER and len(trackers) == 3}[target]
        if hit:
            print(f"GATE {target} rank={rank}", flush=True)
            hold.wait()  # until SIGKILL

    ops = FaultyOps(on_call=hook)
    fm.register(fastckpt.Checkpointer(ops=ops), ops=ops)
    for n in range(1, 6):
        path = os.path.join(d, f"iter_{n:07d}")
        if rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        sd = make_state(n, rank, world, "save")
        request = dc.save(sd, path, ("fastckpt", 1), async_sharded_save=True)
        mutate(sd)
        request.execute_sync()
        print(f"durable {n} rank={rank}", flush=True)
    return {"error": f"iteration 3 finished although KILL_AT={target} should have stopped it"}


def _iteration_100(d: str) -> tuple[str, dict, object]:
    """Iteration 100's directory, a save state of value ``v`` with a ``note`` in common.pt, and
    a function that loads it back as ``[w value, note]`` (or the error, as ``_error`` has it)."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedTensor

    path = os.path.join(d, "iter_0000100")
    os.makedirs(path, exist_ok=True)

    def state(v: float, note: str) -> dict:
        return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 4), v)), "iteration": 100, "note": note}

    def loaded() -> list | dict:
        got: dict = {}
        failed = _error(lambda: got.update(dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 4))},
                                                   path)))
        return failed or [got["w"][0, 0].item(), got["note"]]

    return path, state, loaded


def scenario_resave(d: str, rank: int, world: int) -> dict:
    import threading

    from megatron.core import dist_checkpointing as dc

    import fastckpt
    from fastckpt.integrations import megatron as fm
    from fastckpt.testing import Fault, FaultyOps

    armed, hold = threading.Event(), threading.Event()

    def hook(op: str, path: str) -> None:
        if armed.is_set() and op == "pwrite" and ".fastckpt-next" in path:
            print("GATE resave", flush=True)
            hold.wait()  # until SIGKILL

    ops = FaultyOps(on_call=hook)
    fm.register(fastckpt.Checkpointer(ops=ops, commit_timeout_s=10.0), ops=ops)
    path, state, loaded = _iteration_100(d)
    out: dict = {}
    dc.save(state(1.0, "first"), path, ("fastckpt", 1))
    out["first"] = loaded()

    class Odd(torch.Tensor):  # a tensor subclass (like FP8's) that fastckpt refuses
        pass

    bad = state(2.0, "refused")
    bad["w"].data = bad["w"].data.as_subclass(Odd)
    out["refused"] = _error(lambda: dc.save(bad, path, ("fastckpt", 1)))
    out["after_refused"] = loaded()
    dc.save(state(3.0, "second"), path, ("fastckpt", 1))
    out["second"] = loaded()
    # the re-save's shard (in the tag's re-save directory: the only save from here on)
    ops.inject(Fault("pwrite", errno.ENOSPC, path_contains=f"{os.sep}fastckpt-rank00000"))
    out["failed"] = _error(lambda: dc.save(state(4.0, "failed"), path, ("fastckpt", 1)))
    out["after_failed"] = loaded()
    out["tracker"] = fm.read_tracker(d)
    print("REPORT " + json.dumps(out, default=str), flush=True)
    # a fresh Checkpointer: the failed save's attempt at iteration 100 is still open in the first
    # one (it was never committed), and a later save into that group would join it
    fm.register(fastckpt.Checkpointer(ops=ops), ops=ops)
    armed.set()
    dc.save(state(5.0, "killed"), path, ("fastckpt", 1))
    return {"error": "the killed save finished"}


def scenario_failures(d: str, rank: int, world: int) -> dict:
    """2 ranks. Iteration 100 is committed; a save into it fails on rank 1 only (EIO on its
    file's fsync), and each rank loads 100 as soon as its error reaches it. Then iteration 200's
    metadata.json cannot be written (EIO on rank 0, after the index exchange), then iteration
    300's tracker cannot be written (ENOSPC on rank 0, after the commit): how long each rank's
    save took, and what it raised."""
    import time

    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedTensor

    import fastckpt
    from fastckpt.integrations import megatron as fm
    from fastckpt.testing import Fault, FaultyOps

    ops = FaultyOps()
    ck = fastckpt.Checkpointer(ops=ops, commit_timeout_s=120.0)
    fm.register(ck, ops=ops)
    path, _, _ = _iteration_100(d) if rank == 0 else (os.path.join(d, "iter_0000100"), None, None)
    dist.barrier()

    def state(v: float, note: str, it: int = 100) -> dict:
        return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 4), v), (0, rank, world)),
                "iteration": it, "note": note}

    def loaded(where: str) -> list | dict:
        got: dict = {}
        failed = _error(lambda: got.update(dc.load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 4), (0, rank, world))}, where)))
        return failed or [got["w"][0, 0].item(), got["note"]]

    def timed(fn) -> dict:  # noqa: ANN001
        t0 = time.monotonic()
        return dict(_error(fn) or {"type": None}, seconds=time.monotonic() - t0)

    out: dict = {}
    dc.save(state(1.0, "first"), path, ("fastckpt", 1))
    if rank == 1:
        ops.inject(Fault("fsync", errno.EIO, path_contains="fastckpt-rank00001"))
    out["resave"] = timed(lambda: dc.save(state(2.0, "failed"), path, ("fastckpt", 1)))
    out["after_resave"] = loaded(path)  # at once: before, rank 1 found common.pt not yet put back
    for n, (op, err, name) in {200: ("write_small", errno.EIO, "metadata.json"),
                               300: ("write_small", errno.ENOSPC, fm.TRACKER)}.items():
        where = os.path.join(d, f"iter_{n:07d}")
        if rank == 0:
            os.makedirs(where, exist_ok=True)
            ops.inject(Fault(op, err, path_contains=name))
        dist.barrier()
        out[str(n)] = timed(lambda n=n, where=where: dc.save(state(float(n), "new", n), where, ("fastckpt", 1)))
    dist.barrier()
    out["tracker"] = fm.read_tracker(d)
    out["latest"] = fastckpt.latest(d)
    dist.barrier()  # both read the tracker before either syncs it
    out["synced"] = fm.sync_tracker(d)
    out["after_sync"] = loaded(os.path.join(d, f"iter_{out['synced']:07d}"))
    out["close"] = _error(ck.close)
    return out


def scenario_resave_check(d: str, rank: int, world: int) -> dict:
    from click.testing import CliRunner

    from fastckpt.cli import cli
    from fastckpt.integrations import megatron as fm

    def verify() -> list[str]:  # the operator's check says what the loader says (it once said "intact")
        res = CliRunner().invoke(cli, ["verify", path])
        return [line.split(":")[0] for line in res.stderr.splitlines() if line.startswith("BAD ")] + [res.exit_code]

    path, _, loaded = _iteration_100(d)
    out = {"as_left": loaded(), "verify_as_left": verify()}
    with open(os.path.join(path, "metadata.json"), "w"):
        pass  # torn as a kill inside megatron's finalize leaves it (open(..., "w") truncates)
    out["torn_metadata"] = loaded()
    out["synced"] = fm.sync_tracker(d)
    out["after_sync"] = loaded()
    out["verify_after_sync"] = verify()
    out["repair_again"] = fm.repair_checkpoint(path)
    return out


def scenario_cuda(d: str, rank: int, world: int) -> dict:
    """GPU machines: the same save through megatron's AsyncCallsQueue as it ships (NCCL, CUDA
    tensors, no stand-ins), loaded back onto CUDA."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from fastckpt.integrations import megatron as fm

    def to_cuda(sh: object) -> object:
        if isinstance(sh, ShardedTensor):
            sh.data = sh.data.cuda()
        return sh

    path = os.path.join(d, "iter_0000001")
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    sd = dict_list_map_inplace(to_cuda, make_state(1, rank, world, "save"))
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dc.save(sd, path, ("fastckpt", 1), async_sharded_save=True))
    mutate(sd)
    finalized = queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    want = dict_list_map_inplace(to_cuda, make_state(1, rank, world, "reshard"))
    got = dc.load(without_data(want), path)
    on_cuda = all(t.is_cuda for t in got.values() if isinstance(t, torch.Tensor))
    got = dict_list_map_inplace(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, got)
    return {"finalized": finalized, "tracker": fm.read_tracker(d), "on_cuda": on_cuda,
            "equal": same(got, expected(make_state(1, rank, world, "reshard"), 1))}


def scenario_verify(dirs: str, rank: int, world: int) -> dict:
    from megatron.core import dist_checkpointing as dc

    import fastckpt
    from fastckpt.integrations import megatron as fm

    out = {}
    for d in dirs.split(os.pathsep):
        raw = fm.read_tracker(d)
        synced = fm.sync_tracker(d)
        latest = fastckpt.latest(d)
        want = make_state(synced, 0, 1, "full")
        got = dc.load(without_data(want), os.path.join(d, f"iter_{synced:07d}"))
        out[d] = {"raw": raw, "synced": synced, "latest": latest, "equal": same(got, expected(want, synced)),
                  "iter3": _error(lambda d=d: dc.load(without_data(make_state(3, 0, 1, "full")),
                                                      os.path.join(d, "iter_0000003")))}
    return out


def main() -> None:
    scenario, d, out_path = sys.argv[1:4]
    if "RANK" not in os.environ:  # one rank, without torchrun
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("PORT", "29533"))
    if scenario == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if scenario == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        out = {"save": scenario_save, "load": scenario_load, "loop": scenario_loop, "verify": scenario_verify,
               "cuda": scenario_cuda, "resave": scenario_resave, "failures": scenario_failures,
               "resave_check": scenario_resave_check}[scenario](d, rank, world)
    except BaseException:  # noqa: BLE001 (the test shows it)
        out = {"crash": traceback.format_exc()}
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(out, f, default=str)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
