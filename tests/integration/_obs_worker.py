"""One rank of the multi-rank observability tests (``tests/integration/test_obs_multirank.py``).

Run by ``torchrun --nproc_per_node=2 _obs_worker.py --root DIR --metrics-port P`` (gloo over
127.0.0.1). Each rank saves its shard of steps 1..3 into the group ``DIR/ckpt/step{N}`` through
a burst buffer, with its own event log and a Prometheus exporter (on P + LOCAL_RANK), commits
each step, then scrapes its own endpoint over HTTP and writes what it saw to
``DIR/rank{R}.json``: the exposition text, its endpoint's URL and the SaveRecords.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import urllib.request

import torch
import torch.distributed as dist

import fastckpt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--metrics-port", type=int, required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = args.root
    records = []
    log = os.path.join(root, f"events-rank{rank}.jsonl")
    with fastckpt.Checkpointer(local_dir=os.path.join(root, "bb"), event_log=log,
                               metrics_port=args.metrics_port, replicate_policy="all") as ck:
        for step in (1, 2, 3):
            group = os.path.join(root, "ckpt", f"step{step}")
            state = {"w": torch.full((64 * 1024,), float(rank * 10 + step)), "step": step}
            h = ck.save(state, os.path.join(group, f"rank{rank}.pt"), group=group)
            ck.commit(group, step=step).wait()
            records.append(dataclasses.asdict(h.wait()))
        with urllib.request.urlopen(ck.metrics_url, timeout=10) as resp:
            text = resp.read().decode()
        out = {"url": ck.metrics_url, "text": text, "records": records, "stats": dataclasses.asdict(ck.stats())}
        with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        dist.barrier()  # both endpoints were up together
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
