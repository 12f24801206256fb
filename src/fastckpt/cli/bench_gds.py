"""``fastckpt bench --gds``: one worker's blocks between GPU memory and its file with kvikio."""

from __future__ import annotations

import errno
import os
import threading
import time
from array import array
from collections.abc import Callable

from .bench_job import Job, WorkerResult, block_order, pattern


def run_gds(job: Job, progress: Callable[[int], None], stop: threading.Event,
            start: Callable[[], None]) -> WorkerResult:
    """Move one file's blocks between GPU memory and the file with kvikio (GPUDirect Storage).

    The caller has checked that GDS is usable (not kvikio's compat mode). Blocks carry no
    stamp here (a GPU-side stamp would add a copy per block); ``verify`` compares each block
    read with the pattern written, on the GPU.
    """
    import kvikio
    import torch

    dev = torch.device("cuda", job.device)
    want = torch.frombuffer(bytearray(pattern(job)), dtype=torch.uint8).to(dev)
    buf = want.clone() if job.op == "write" else torch.empty_like(want)
    lat = array("d")
    moved = checked = bad = 0
    f = kvikio.CuFile(job.path, "w" if job.op == "write" else "r")
    try:
        nxt = block_order(job, stop)
        start()
        t0 = time.perf_counter()
        while (i := nxt()) is not None:
            off = i * job.block_bytes
            s = time.perf_counter()
            io = f.pwrite if job.op == "write" else f.pread
            n = io(buf, job.block_bytes, off).get()
            if n != job.block_bytes:
                raise OSError(errno.EIO, f"kvikio moved {n} of {job.block_bytes} bytes at {off} of {job.path}")
            lat.append(time.perf_counter() - s)
            if job.op == "read" and job.verify:
                checked += 1
                bad += not bool(torch.equal(buf, want))
            moved += job.block_bytes
            progress(job.block_bytes)
    finally:
        f.close()
    if job.op == "write":
        fd = os.open(job.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    seconds = time.perf_counter() - t0
    return WorkerResult(job.op, job.rank, job.worker, job.path, moved, seconds, lat, True, None, checked, bad)
