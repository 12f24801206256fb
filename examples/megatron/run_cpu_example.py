"""Megatron-core + fastckpt on the CPU: a tensor-parallel GPT saved sync and async, loaded back.

    torchrun --nproc_per_node 2 examples/megatron/run_cpu_example.py [--dir DIR] [--hidden 256]

Builds megatron-core's GPTModel (local layer spec, no Transformer Engine) with tensor
parallelism 2 on gloo, saves its sharded state dict through fastckpt's ``("fastckpt", 1)``
strategy synchronously (iteration 1) and asynchronously (iteration 2: training goes on while
the files are written, then ``execute_sync`` finishes the request), loads iteration 2 back on
2 ranks, then on 1 rank with tensor parallelism 1 (resharded), and checks every tensor. Prints
each save's timings and the overhead fastckpt measured. Exits 0 when everything matched.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

import fastckpt  # noqa: E402
from fastckpt.integrations import megatron as fm  # noqa: E402


def build_model(tp: int, hidden: int, layers: int, seed: int):  # noqa: ANN201 (a GPTModel)
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=8,
                               use_cpu_initialization=True, pipeline_dtype=torch.float32)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=1024, max_sequence_length=256)


def sharded_state(model, iteration: int) -> dict:  # noqa: ANN001
    return {"model": model.sharded_state_dict(), "iteration": iteration}


def train_steps(model, n: int) -> None:  # noqa: ANN001
    """Stand-in for optimizer steps: every parameter changes in place."""
    with torch.no_grad():
        for _ in range(n):
            for p in model.parameters():
                p.mul_(0.999).add_(0.001)


def shards(model) -> dict[tuple[str, tuple[int, ...]], torch.Tensor]:  # noqa: ANN001
    """This rank's main-replica shards: (key, global offset) -> a copy of the values."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    return {(sh.key, tuple(sh.global_offset)): sh.data.detach().clone()
            for sh in nested_values(model.sharded_state_dict())
            if isinstance(sh, ShardedTensor) and is_main_replica(sh.replica_id)}


def check(model, want: dict, label: str, rank: int) -> None:  # noqa: ANN001
    """Every main-replica shard of ``model`` equals the expected values (global tensors sliced)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    n = 0
    for sh in nested_values(model.sharded_state_dict()):
        if not isinstance(sh, ShardedTensor):
            continue
        box = tuple(slice(o, o + s) for o, s in zip(sh.global_offset, (1,) * sh.prepend_axis_num + sh.local_shape))
        if not torch.equal(sh.data, want[sh.key][box].reshape(sh.local_shape)):
            raise SystemExit(f"[rank {rank}] {label}: {sh.key} differs from what was saved")
        n += 1
    print(f"[rank {rank}] {label}: {n} tensors equal to the saved ones", flush=True)


def assemble(parts: list[dict]) -> dict[str, torch.Tensor]:
    """Global tensors from every rank's shards (key, offset) -> values."""
    from megatron.core.dist_checkpointing import ShardedTensor  # noqa: F401 (megatron imported already)

    out: dict[str, torch.Tensor] = {}
    ends: dict[str, list[int]] = {}
    for part in parts:
        for (key, off), t in part.items():
            shape = [o + s for o, s in zip(off, (1,) * (len(off) - t.dim()) + tuple(t.shape))]
            ends[key] = [max(a, b) for a, b in zip(ends.get(key, shape), shape)]
    for key, shape in ends.items():
        out[key] = torch.empty(shape, dtype=next(t.dtype for p in parts for (k, _), t in p.items() if k == key))
    for part in parts:
        for (key, off), t in part.items():
            box = tuple(slice(o, o + s) for o, s in zip(off, (1,) * (len(off) - t.dim()) + tuple(t.shape)))
            out[key][box] = t.reshape(out[key][box].shape)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="where the checkpoints go (default: a temporary directory, removed at the end)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()

    from megatron.core import dist_checkpointing as dc

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit("run me with torchrun --nproc_per_node 2")
    save_dir = args.dir or (tempfile.mkdtemp(prefix="fastckpt-megatron-") if rank == 0 else None)
    holder = [save_dir]
    dist.broadcast_object_list(holder)
    save_dir = holder[0]

    ck = fastckpt.Checkpointer()  # created before training starts: the overhead counts from here
    save_strategy, load_strategy = fm.register(ck)
    model = build_model(2, args.hidden, args.layers, seed=1)

    def iteration_dir(n: int) -> str:
        path = os.path.join(save_dir, f"iter_{n:07d}")
        if rank == 0:
            os.makedirs(path, exist_ok=True)  # megatron wants it made by rank 0 first
        dist.barrier()
        return path

    # iteration 1: synchronous save
    path = iteration_dir(1)
    t0 = time.monotonic()
    dc.save(sharded_state(model, 1), path, ("fastckpt", 1))
    sync_s = time.monotonic() - t0
    print(f"[rank {rank}] sync save of iteration 1: {sync_s:.3f} s, {save_strategy.last_save.bytes / 1e6:.1f} MB "
          "from this rank", flush=True)

    # iteration 2: async save; training goes on while the files are written
    train_steps(model, 5)
    path = iteration_dir(2)
    saved_values = shards(model)
    t0 = time.monotonic()
    request = dc.save(sharded_state(model, 2), path, ("fastckpt", 1), async_sharded_save=True)
    blocked_s = time.monotonic() - t0
    train_steps(model, 5)  # changes every parameter: the checkpoint must not see this
    request.execute_sync()  # megatron's AsyncCallsQueue would run this part on a GPU machine
    durable_s = save_strategy.last_save.durable_s()
    print(f"[rank {rank}] async save of iteration 2: blocked {blocked_s:.3f} s, durable after {durable_s:.3f} s; "
          f"tracker names iteration {fm.read_tracker(save_dir)}", flush=True)

    parts: list = [None] * world
    dist.all_gather_object(parts, saved_values)
    want = assemble(parts)

    # load iteration 2 on 2 ranks into a differently initialised model
    fresh = build_model(2, args.hidden, args.layers, seed=2)
    state = dc.load(sharded_state(fresh, 2), path)
    fresh.load_state_dict(state["model"])
    check(fresh, want, "loaded on 2 ranks (TP 2)", rank)
    report = load_strategy.last_load
    print(f"[rank {rank}] load: {report.bytes_read / 1e6:.1f} MB read for {report.bytes_needed / 1e6:.1f} MB "
          f"needed from {report.files} files in {report.seconds:.3f} s", flush=True)
    stats = ck.stats()
    print(f"[rank {rank}] overhead: {stats.overhead:.2%} of wall time over {stats.saves} checkpoints saved "
          f"(budget 2%; blocked {stats.blocked_s:.3f} s)", flush=True)

    # iteration 2 again, resharded: one rank, tensor parallelism 1
    dist.barrier()
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if rank == 0:
        store_path = os.path.join(tempfile.mkdtemp(prefix="fastckpt-store-"), "store")
        store = dist.FileStore(store_path, 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        single = build_model(1, args.hidden, args.layers, seed=3)
        state = dc.load(sharded_state(single, 2), path)
        single.load_state_dict(state["model"])
        check(single, want, "loaded on 1 rank (TP 1, resharded)", rank)
        print(f"[rank 0] fastckpt.latest: {fastckpt.latest(save_dir)}", flush=True)
        dist.destroy_process_group()
        shutil.rmtree(os.path.dirname(store_path), ignore_errors=True)
    ck.close()
    if rank == 0:
        if args.dir is None:
            shutil.rmtree(save_dir)
        print("OK", flush=True)


if __name__ == "__main__":
    main()
