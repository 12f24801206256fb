"""One rank of the torchrun restart test (``tests/integration/test_group_restart.py``).

Run by ``torchrun --nproc-per-node=2 --max-restarts=1 ... _restart_worker.py --root DIR``. The
workers are clients of the agent's TCPStore, which outlives the first run (torch 2.13's
``_create_c10d_store`` adds no per-restart prefix), so whatever the first run left in it is
still there when the second run commits.

First run: rank 0 makes its Checkpointer, saves into ``DIR/run0`` and commits; rank 1 waits
until rank 0's commit is under way, then SIGKILLs itself before it makes a Checkpointer (a
rank lost to the OOM killer while loading, say). The agent tears rank 0 down and restarts both.

Second run: both ranks save into ``DIR/step1`` and commit, and write what they saw to
``DIR/results/rank{R}.json``: whether the commit completed, how long it took, and the error.

``TORCHELASTIC_RESTART_COUNT`` tells the worker which run it is in (and prefixes the process
group's keys, see below); fastckpt never reads it. fastckpt gets the agent's store itself
(``store=``): what ``Checkpointer()`` would use under a plain ``init_process_group("gloo")``, but
gloo in torch 2.13 may fail to start a restarted run on the stale keys of the first one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import time
import traceback

import torch
import torch.distributed as dist

import fastckpt

SIGNAL_KEY = "fastckpt-test/rank0-committing"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--timeout", type=float, required=True)
    args = ap.parse_args()
    rank, run = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    # The agent's store, as torchrun's env:// rendezvous connects to it (no prefix of any run).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    # gloo's connectFullMesh reads the peers' addresses from the store, and in a restarted run may
    # read the first run's (pytorch#135712: "Connection refused"): the process group, and only it,
    # gets a prefix per run. fastckpt is given the agent's store itself, keys of the dead run and all.
    dist.init_process_group("gloo", store=dist.PrefixStore(f"test-run{run}", store), rank=rank,
                            world_size=int(os.environ["WORLD_SIZE"]))
    state = {"w": torch.arange(256, dtype=torch.int64) + 1000 * run + rank, "run": run, "rank": rank}
    if run == 0:
        if rank == 1:
            store.wait([SIGNAL_KEY])
            os.kill(os.getpid(), signal.SIGKILL)
        ck = fastckpt.Checkpointer(store=store, commit_timeout_s=args.timeout, overhead_budget=0.99)
        group = f"{args.root}/run0"
        ck.save(state, f"{group}/rank{rank}.pt", group=group)
        handle = ck.commit(group, step=0)
        store.set(SIGNAL_KEY, "1")
        handle.wait(args.timeout + 60)  # the agent ends this process once rank 1 is gone
        return
    ck = fastckpt.Checkpointer(store=store, commit_timeout_s=args.timeout, overhead_budget=0.99)
    group = f"{args.root}/step1"
    ck.save(state, f"{group}/rank{rank}.pt", group=group)
    t0 = time.monotonic()
    result = {"rank": rank, "run": run}
    try:
        rec = ck.commit(group, step=1).wait(args.timeout + 60)
        result.update(committed=True, bytes=rec.bytes)
    except Exception as exc:  # noqa: BLE001 (reported to the test, which fails on it)
        result.update(committed=False, error="".join(traceback.format_exception_only(exc)))
    result["commit_s"] = time.monotonic() - t0
    ck.close()
    os.makedirs(f"{args.root}/results", exist_ok=True)
    with open(f"{args.root}/results/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
