"""The workers of ``fastckpt bench``: each writes or reads one file in fixed-size blocks.

The bytes move the way fastckpt moves them: ``FileOps`` for every call, page-aligned
buffers from ``alloc_aligned``, ``pwrite_all`` for writes, O_DIRECT (4096-byte alignment)
unless the filesystem refuses it, one fsync per file at the end (timed, like fio's
``end_fsync``). With GDS, kvikio moves the bytes between GPU memory and the file instead.

Every block starts with 16 bytes naming its worker and index; the rest is the same random
bytes for all blocks of a worker, so ``verify`` checks each block read with one comparison of
the stamp and one xxh3 of the body.

Workers run as threads or as processes. All of a phase's workers open their files first, meet
at a barrier (ready), and start together when the caller says go (after the other nodes are
ready too); ``stop`` ends them early (Ctrl-C). Results come back as
``WorkerResult``; a failure is re-raised in the caller with its original type.
"""

from __future__ import annotations

import errno
import math
import multiprocessing as mp
import os
import signal
import struct
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import xxhash

from ..format.align import ALIGN
from ..io.engine import alloc_aligned
from ..io.ops import FileOps, pread_exact, pwrite_all
from ._signals import die_with_parent
from .bench_job import Job, WorkerResult, block_order, pattern

_O_DIRECT = getattr(os, "O_DIRECT", 0)
STAMP = struct.Struct("<QQ")
START_TIMEOUT_S = 300.0  # a worker that cannot open its file within this breaks the barrier


def _open(ops: FileOps, job: Job) -> tuple[int, bool, str | None]:
    flags = (os.O_WRONLY | os.O_CREAT) if job.op == "write" else os.O_RDONLY
    if job.direct and _O_DIRECT:
        try:
            return ops.open(job.path, flags | _O_DIRECT), True, None
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            reason = f"the filesystem refused O_DIRECT ({errno.errorcode.get(exc.errno, exc.errno)})"
    else:
        reason = "--buffered" if _O_DIRECT else "O_DIRECT is not available on this OS"
    return ops.open(job.path, flags), False, reason


def run_posix(job: Job, progress: Callable[[int], None], stop: threading.Event,
              start: Callable[[], None]) -> WorkerResult:
    """Move one file's blocks with FileOps; ``start()`` waits at the phase's barrier."""
    ops = FileOps()
    body = pattern(job)
    body_digest = xxhash.xxh3_64_intdigest(body[STAMP.size:])
    buf = alloc_aligned(job.block_bytes)
    view = memoryview(buf)[: job.block_bytes]
    view[:] = body
    fd, direct, reason = _open(ops, job)
    lat = array("d")
    moved = checked = bad = 0
    try:
        if job.op == "read" and not direct:  # buffered (asked, or O_DIRECT refused): from storage, not memory
            drop_cache(job.path)
        nxt = block_order(job, stop)
        start()
        t0 = time.perf_counter()
        while (i := nxt()) is not None:
            if i == 0 and moved:  # another pass (--duration): as the first, never what it left behind
                fd = _next_pass(ops, job, fd, direct)
            off = i * job.block_bytes
            s = time.perf_counter()
            if job.op == "write":
                STAMP.pack_into(view, 0, job.worker, i)
                pwrite_all(ops, fd, view, off, job.path)
            else:
                pread_exact(ops, fd, view, off, len(view), job.path)
            lat.append(time.perf_counter() - s)
            if job.op == "read" and job.verify:
                checked += 1
                good = STAMP.unpack_from(view, 0) == (job.worker, i) and \
                    xxhash.xxh3_64_intdigest(view[STAMP.size:]) == body_digest
                bad += not good
            moved += job.block_bytes
            progress(job.block_bytes)
        if job.op == "write":
            ops.fsync(fd)
        seconds = time.perf_counter() - t0
    finally:
        ops.close(fd)
        view.release()
    return WorkerResult(job.op, job.rank, job.worker, job.path, moved, seconds, lat, direct, reason, checked, bad)


def _next_pass(ops: FileOps, job: Job, fd: int, direct: bool) -> int:
    """Ready ``fd`` for another pass over the file (timed, like the pass): a write goes to a new
    file, as each checkpoint does (overwriting allocated blocks in place is faster than
    allocating them: the rate would be too high); a buffered read drops the pages the last pass
    cached. Returns the descriptor to go on with."""
    if job.op == "read":
        if not direct:
            drop_cache(job.path)
        return fd
    ops.fsync(fd)
    ops.unlink(job.path)
    new = _open(ops, job)[0]
    ops.close(fd)
    return new


def _run(job: Job, progress: Callable[[int], None], stop: threading.Event, barrier, go) -> WorkerResult:  # noqa: ANN001
    """Run one job; a failure before the start breaks the barrier, so nobody waits for us."""
    def start() -> None:
        barrier.wait(START_TIMEOUT_S)
        go.wait(START_TIMEOUT_S)

    try:
        if job.gds:
            from .bench_gds import run_gds

            return run_gds(job, progress, stop, start)
        return run_posix(job, progress, stop, start)
    except BaseException:
        barrier.abort()
        raise


class _Flag:
    """A flag shared with worker processes, without a lock: bench's workers may be killed at any
    moment (an OOM kill, SIGKILL), and one killed inside an ``mp.Event`` call leaves that event's
    lock held, so every later ``set`` or ``is_set`` (the parent stopping the other workers, the
    workers checking for it) waits forever. Waiting polls every 0.2 ms."""

    def __init__(self, ctx: mp.context.BaseContext) -> None:
        self._v = ctx.RawValue("b", 0)

    def set(self) -> None:
        self._v.value = 1

    def is_set(self) -> bool:
        return bool(self._v.value)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._v.value:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.0002)
        return True


class Phase:
    """One phase (all workers of this process doing one op) on threads or processes.

    Use: ``phase.launch()`` (workers open their files), ``phase.ready()`` (returns once all
    have), ``phase.go()`` (releases them; returns the start time), ``phase.poll()`` (bytes so
    far) until ``phase.done()``, then ``phase.results()``. ``phase.stop()`` ends the workers
    early; always call ``close()``.
    """

    def __init__(self, jobs: Sequence[Job], engine: str) -> None:
        if engine not in ("threads", "processes"):
            raise ValueError(f"engine={engine!r} must be 'threads' or 'processes'")
        self.jobs, self.engine = list(jobs), engine
        n = len(self.jobs)
        if engine == "threads":
            self._stop, self._go = threading.Event(), threading.Event()
            self._barrier = threading.Barrier(n + 1)
            self._counts = [0] * n
            self._pool = ThreadPoolExecutor(n, thread_name_prefix="fastckpt-bench")
        else:
            ctx = mp.get_context("spawn")  # no fork of a process that already runs threads
            self._stop, self._go = _Flag(ctx), _Flag(ctx)
            self._barrier = ctx.Barrier(n + 1)
            self._counts = ctx.Array("q", n, lock=False)
            self._queue = ctx.Queue()
            self._procs = [ctx.Process(target=_process_main, daemon=True,
                                       args=(j, k, self._counts, self._stop, self._barrier, self._go, self._queue))
                           for k, j in enumerate(self.jobs)]
        self._futures: list = []
        self._results: dict[int, WorkerResult | BaseException] = {}

    def launch(self) -> None:
        if self.engine == "threads":
            def one(k: int, job: Job) -> WorkerResult:
                def progress(n: int) -> None:
                    self._counts[k] += n
                return _run(job, progress, self._stop, self._barrier, self._go)
            self._futures = [self._pool.submit(one, k, j) for k, j in enumerate(self.jobs)]
        else:
            for p in self._procs:
                p.start()

    def ready(self) -> None:
        """Wait until every worker has opened its file and allocated its buffer."""
        try:
            self._barrier.wait(START_TIMEOUT_S)
        except threading.BrokenBarrierError:
            self.results()  # a worker failed before the start: raise its error
            raise

    def go(self) -> float:
        """Release the workers together; the phase's clock starts now."""
        t0 = time.perf_counter()
        self._go.set()
        return t0

    def poll(self) -> int:
        return sum(self._counts)

    def done(self, timeout_s: float = 0.2) -> bool:
        if self.engine == "threads":
            pending = wait_futures(self._futures, timeout_s, return_when=FIRST_EXCEPTION).not_done
            if any(f.done() and f.exception() is not None for f in self._futures):
                return True
            return not pending
        self._drain(timeout_s)
        failed = any(isinstance(r, BaseException) for r in self._results.values())
        return failed or len(self._results) == len(self.jobs) or \
            any(not p.is_alive() and p.exitcode not in (0, None) for p in self._procs)

    def _drain(self, timeout_s: float) -> None:
        import queue as _queue

        try:
            k, outcome = self._queue.get(timeout=timeout_s)
        except _queue.Empty:
            return
        if isinstance(outcome, BaseException):
            self._stop.set()
        self._results[k] = outcome

    def results(self) -> list[WorkerResult]:
        """Each worker's result, once all have ended. When one failed, the others are stopped and
        its error is raised: the cause, not the BrokenBarrierError that its failure before the
        start gave the workers waiting there."""
        if self.engine == "threads":
            if any(f.done() and f.exception() is not None for f in self._futures):
                self._stop.set()
            wait_futures(self._futures, START_TIMEOUT_S)
            self._results = {k: f.exception() or f.result() for k, f in enumerate(self._futures) if f.done()}
        while len(self._results) < len(self.jobs):
            if self.engine == "threads" or (all(not p.is_alive() for p in self._procs) and self._queue.empty()):
                ended = sorted(set(range(len(self.jobs))) - set(self._results))
                raise RuntimeError(f"bench workers {ended} did not end within {START_TIMEOUT_S:.0f} s (is the "
                                   "storage hung?)" if self.engine == "threads" else f"bench workers {ended} ended "
                                   f"without a result (exit codes {[self._procs[k].exitcode for k in ended]})")
            if any(not p.is_alive() and p.exitcode not in (0, None) for p in self._procs):
                self._stop.set()  # one died without a word: the others need not finish their files
            self._drain(0.2)
        errors = [r for r in self._results.values() if isinstance(r, BaseException)]
        if errors:  # the cause first; a BrokenBarrierError only when that is all there is
            raise min(errors, key=lambda e: isinstance(e, threading.BrokenBarrierError))
        return [self._results[k] for k in range(len(self.jobs))]

    def stop(self) -> None:
        self._stop.set()
        if not self._go.is_set():  # workers still waiting to start see ``stop`` and end at once; once
            self._go.set()  # started, the barrier is behind them (its lock may be a dead worker's)
            self._barrier.abort()

    def close(self) -> None:
        self.stop()
        if self.engine == "threads":
            self._pool.shutdown(wait=True)
            return
        for p in self._procs:
            if p.pid is not None:
                p.join(10)
                if p.is_alive():
                    p.terminate()
                    p.join()


def _process_main(job: Job, k: int, counts, stop, barrier, go, results) -> None:  # noqa: ANN001 (mp proxies)
    """A worker process: Ctrl-C goes to the parent, which stops us through ``stop``; a parent killed
    with SIGKILL cannot, and ``daemon=True`` only acts at its clean exit: we die with it."""
    die_with_parent(mp.parent_process().pid)  # type: ignore[union-attr]  (always set in a child)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def progress(n: int) -> None:
        counts[k] += n

    try:
        results.put((k, _run(job, progress, stop, barrier, go)))
    except BaseException as exc:  # noqa: BLE001 (sent to the parent, which raises it)
        results.put((k, exc))


def drop_cache(path: str) -> None:
    """Evict a written file's pages so a buffered read comes from storage, not memory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50, p99 and max of ``values`` (nearest rank), None when empty."""
    if not values:
        return {"p50_s": None, "p99_s": None, "max_s": None}
    s = sorted(values)

    def rank(q: float) -> float:
        return s[max(0, math.ceil(q * len(s)) - 1)]

    return {"p50_s": rank(0.50), "p99_s": rank(0.99), "max_s": s[-1]}


__all__ = ["ALIGN", "Job", "Phase", "WorkerResult", "drop_cache", "pattern", "percentiles"]
