"""One rank of the randomized kill test (``tests/integration/test_group_kills.py``).

Started by the test in a process of its own (forked from a forkserver that has torch and
fastckpt imported, so a restart costs milliseconds), as one of 2 ranks of one "launch": it
resumes from ``start`` (loading and checking its own file of that step), then saves and commits
``steps`` more steps, ``ROOT/step{N}/rank{R}.pt``, reporting each commit that completed on its
pipe: ``("durable", rank, step, launch)``. A load that returns the wrong tensors is reported as
``("bad-load", rank, step, repr)``. The test SIGKILLs both ranks at a random moment, or (``die_rank``)
one rank kills itself before it makes its Checkpointer while the other's first commit is under way.
"""

from __future__ import annotations

import datetime
import os
import signal
from dataclasses import dataclass

import torch

import fastckpt

TIMEOUT_S = 20.0
ELEMENTS = 4096


@dataclass(frozen=True)
class Launch:
    root: str
    launch: int
    start: int
    steps: int
    local_dir: str | None
    store_port: int | None  # a TCPStore the test hosts, as torchrun's agent would
    storage_options: dict | None = None  # the S3 endpoint, when ``root`` is an s3:// URL
    launch_prefix: bool = True  # False: every launch uses the store's keys as they are (a long-lived store)
    die_rank: int | None = None  # this rank SIGKILLs itself before making its Checkpointer, once the
    #                              other rank's first commit is under way (needs a store)


def state(step: int, rank: int, launch: int) -> dict:
    return {"w": torch.arange(ELEMENTS, dtype=torch.int64) * (step + 1) + rank * 7 + launch * 1_000_003,
            "step": step, "rank": rank, "launch": launch}


def matches(got: object, step: int, rank: int) -> bool:
    """Whether ``got`` is a whole file of ``step`` saved by ``rank`` (of any launch)."""
    if not isinstance(got, dict) or got.get("step") != step or got.get("rank") != rank:
        return False
    return torch.equal(got["w"], state(step, rank, int(got["launch"]))["w"])


def _die_key(job: Launch) -> str:
    return f"kill-test/launch{job.launch}/committing"


def run_rank(rank: int, job: Launch, events: object) -> None:
    store = None
    if job.store_port is not None:
        import torch.distributed as dist

        client = dist.TCPStore("127.0.0.1", job.store_port, 2, False, timeout=datetime.timedelta(seconds=60))
        # with launch_prefix, each launch sees keys of its own (as a store made anew per restart);
        # without, the keys of killed launches stay (torchrun's agent store, a TCPStore the user keeps)
        store = dist.PrefixStore(f"launch{job.launch}", client) if job.launch_prefix else client
        if job.die_rank == rank:
            store.wait([_die_key(job)])
            os.kill(os.getpid(), signal.SIGKILL)
    ck = fastckpt.Checkpointer(rank=rank, world_size=2, store=store, local_dir=job.local_dir, io_threads=1,
                               commit_timeout_s=TIMEOUT_S, overhead_budget=0.99, odirect=False,
                               keep_local=2 if job.local_dir else None, storage_options=job.storage_options)
    if job.start:
        path = f"{job.root}/step{job.start}/rank{rank}.pt"
        try:
            got = ck.load(path)
            if not matches(got, job.start, rank):
                events.send(("bad-load", rank, job.start, repr(got)[:200]))
        except Exception as exc:  # noqa: BLE001 (reported to the test, which fails on it)
            events.send(("bad-load", rank, job.start, repr(exc)))
    for step in range(job.start + 1, job.start + 1 + job.steps):
        group = f"{job.root}/step{step}"
        ck.save(state(step, rank, job.launch), f"{group}/rank{rank}.pt", group=group)
        handle = ck.commit(group, step=step)
        if job.die_rank is not None and step == job.start + 1:
            store.set(_die_key(job), "1")
        handle.wait(TIMEOUT_S + 30)
        events.send(("durable", rank, step, job.launch))
    ck.close()
    events.send(("done", rank, job.start + job.steps, job.launch))
