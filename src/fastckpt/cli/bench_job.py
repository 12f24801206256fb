"""What a ``fastckpt bench`` worker is given and returns, and the order it moves blocks in."""

from __future__ import annotations

import random
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Job:
    """One worker's assignment for one phase (``op`` is "write" or "read")."""

    op: str
    rank: int
    worker: int
    path: str
    file_bytes: int
    block_bytes: int
    direct: bool
    duration_s: float | None = None
    verify: bool = False
    gds: bool = False
    device: int = 0


@dataclass(frozen=True)
class WorkerResult:
    """What one worker did: bytes moved, its own seconds (first block to fsync done), one
    latency per block in seconds, whether O_DIRECT was honoured (and why not), and for reads
    with ``verify`` the blocks checked and the bad ones."""

    op: str
    rank: int
    worker: int
    path: str
    bytes: int
    seconds: float
    latencies_s: array
    odirect: bool
    odirect_reason: str | None
    checked_blocks: int = 0
    bad_blocks: int = 0

    @property
    def Bps(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


_PATTERN_PIECE = 64 << 20  # randbytes takes at most 2**28 - 1 bytes at a time


def pattern(job: Job) -> bytes:
    """The body every block of this worker carries (random, reproducible)."""
    rnd, n = random.Random(f"fastckpt-bench/{job.rank}/{job.worker}"), job.block_bytes
    return b"".join(rnd.randbytes(min(_PATTERN_PIECE, n - o)) for o in range(0, n, _PATTERN_PIECE))


def block_order(job: Job, stop: threading.Event) -> Callable[[], int | None]:
    """The next block index to move: one pass over the file, or passes until ``duration_s``.

    A write's last pass runs to the end of the file (the phase may run past ``duration_s`` by
    up to one pass, and counts it): a checkpoint is a whole file, and the read phase that
    follows reads whole files. A read stops at the deadline, mid-pass."""
    n = job.file_bytes // job.block_bytes
    state = {"i": 0, "deadline": None}

    def nxt() -> int | None:
        i = state["i"]
        if state["deadline"] is None and job.duration_s is not None:
            state["deadline"] = time.perf_counter() + job.duration_s
        if stop.is_set() or (job.duration_s is None and i >= n):
            return None
        if job.duration_s is not None and time.perf_counter() >= state["deadline"] and \
                (job.op != "write" or i % n == 0):
            return None
        state["i"] = i + 1
        return i % n

    return nxt
