"""Reusable staging buffers: the snapshot's destination, laid out exactly like the file.

One buffer holds one file image (metadata and storages at their file offsets, copied there by
``save.snapshot``), so the background writer sends it to disk in large aligned chunks with no
further copy. Buffers are
reused across saves: in steady state the pool holds one copy of the state per staging buffer
(``staging_buffers``, 1 by default), plus a little headroom (``capacity_for``). CPU buffers are
page-aligned anonymous memory; buffers for CUDA states are pinned host memory, filled by
non-blocking copies on a side stream.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..format.align import ALIGN
from ..io.engine import alloc_aligned

log = logging.getLogger("fastckpt")
T = TypeVar("T")


@dataclass(eq=False)
class StagingBuffer:
    capacity: int
    pinned: bool
    tensor: torch.Tensor  # uint8, the whole buffer
    view: memoryview
    keepalive: object = None
    owner: object = None
    #: ``Segments.serial`` of the metadata at its file offsets here (0: none): set by the
    #: snapshot that copied it, so the next snapshot of the same layout skips that copy
    holds: int = 0
    lease: Lease | None = None  # the save that holds it now (``acquire`` to ``release``)


@dataclass(eq=False)
class Lease:
    """One save's hold on a staging buffer. The saving thread has it from ``acquire`` until its writer
    job is queued; a Ctrl-C (KeyboardInterrupt) can land at any bytecode in between, also inside an
    executor's ``submit`` after the job was queued, so who has it then is settled here, under the
    pool's lock: the writer job takes it on as it starts (``StagingPool.taken``), the saving thread
    on an exception gives it back unless that happened (``give_back``), and a job of a save whose
    lease was given back does nothing (a lazy copy under way keeps the buffer until it ends: ``lent``)."""

    buffer: StagingBuffer
    taken: bool = False  # the writer job has it (or is queued, ``Saver._submit``): it releases the buffer
    given_back: bool = False
    lenders: int = 0  # lazy copies into the buffer running now


def _new_buffer(capacity: int, pinned: bool) -> StagingBuffer:
    if pinned:
        t = torch.empty(capacity + ALIGN, dtype=torch.uint8, pin_memory=True)
        shift = (-t.data_ptr()) % ALIGN
        t = t[shift : shift + capacity]
        return StagingBuffer(capacity, True, t, memoryview(t.numpy()).cast("B"), None)
    # Fault every page in now, so the first snapshot does not. Not with MAP_POPULATE: Python's
    # mmap() holds the GIL while the kernel populates (measured: every other thread stalled
    # 110 ms for 304 MB, which made a background reservation block the training thread). A
    # torch write to one byte per page releases the GIL, and took 77 ms for the same buffer.
    mem = alloc_aligned(capacity)
    whole = torch.frombuffer(mem, dtype=torch.uint8)
    whole[:: mmap.PAGESIZE].zero_()
    return StagingBuffer(capacity, False, whole[:capacity], memoryview(mem)[:capacity], mem)


#: Spare room each new buffer gets beyond the request: a fraction of it, at least ``HEADROOM_MIN``
#: bytes. A checkpoint that grows a little between saves (Lightning's ModelCheckpoint adds its
#: top-k list, an optimizer gains a step counter) then reuses the buffer instead of allocating and
#: prefaulting a new one on the training thread. Memory: at most 1/64 (1.6 %) + 1 MiB per buffer.
HEADROOM_FRACTION = 1 / 64
HEADROOM_MIN = 1 << 20


def capacity_for(nbytes: int) -> int:
    """The capacity a new buffer for ``nbytes`` gets: the request plus headroom, page-aligned."""
    room = max(HEADROOM_MIN, int(nbytes * HEADROOM_FRACTION))
    return (nbytes + room + ALIGN - 1) // ALIGN * ALIGN


class StagingPool:
    """Buffers keyed by capacity, each owned by at most one in-flight checkpoint.

    ``acquire`` (training thread) takes the smallest idle buffer that fits, preferring one that
    holds the metadata of the layout being saved (``holds``: a file of 100,000 tensors then skips
    inflating and copying 27 MB of it; files of equal size, a group's shards, may otherwise swap
    buffers from save to save). If none is idle, a
    reservation in progress (``reserve``) is waited for and adopted. Otherwise, while fewer than
    ``max_buffers`` buffers are busy, whatever their size (not counting those the same group
    already holds: each file of a group needs its own), a new one is allocated with headroom
    (``capacity_for``), and the idle ones too small for it are freed; at the limit the save
    waits for a buffer held by an older checkpoint (or, with ``wait=False``, gets None so the
    caller can skip): that is the backpressure that keeps memory at ``max_buffers`` copies of
    the state, also while the state grows. ``release`` (writer thread) hands a buffer back;
    so does ``give_back`` (the saving thread, raising before a writer had it: ``Lease``).
    ``reserve`` (any thread) allocates buffers ahead of time on a background thread.
    """

    def __init__(self, max_buffers: int = 1) -> None:
        self._cv = threading.Condition()
        self._buffers: list[StagingBuffer] = []
        self._pending: list[tuple[int, bool]] = []  # reservations being allocated: (capacity, pinned)
        self._fillers: list[threading.Thread] = []  # their threads, joined by close()
        self._closed = False
        self.max_buffers = max_buffers
        self.busy_waited_s = 0.0  # seconds acquire waited for a buffer that older checkpoints held

    def capacities(self, pinned: bool = False) -> list[int]:
        """The capacities of the buffers held now (for tests and reports)."""
        with self._cv:
            return sorted(b.capacity for b in self._buffers if b.pinned == pinned)

    def acquire(self, nbytes: int, owner: object, pinned: bool, wait: bool, holds: int = 0) -> StagingBuffer | None:
        need = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        buf: StagingBuffer | None = None
        try:
            with self._cv:
                while True:
                    fits = [b for b in self._buffers if b.capacity >= need and b.pinned == pinned]
                    idle = [b for b in fits if b.owner is None]
                    if idle:
                        buf = min(idle, key=lambda b: (not holds or b.holds != holds, b.capacity))
                        buf.owner, buf.lease = owner, Lease(buf)
                        return buf
                    if any(p == pinned for _, p in self._pending):
                        self._cv.wait()  # a reservation is being allocated: adopt it (or see it was too small)
                        continue
                    if self._busy(pinned, but=owner) < self.max_buffers:
                        break
                    if not wait:
                        return None
                    t0 = time.monotonic()
                    self._cv.wait()
                    self.busy_waited_s += time.monotonic() - t0  # backpressure: the overhead advice tells it apart
                self._drop_idle_smaller(need, pinned)
            new = _new_buffer(capacity_for(need), pinned)
            new.owner, new.lease = owner, Lease(new)
            with self._cv:
                buf = new
                self._buffers.append(buf)
            return buf
        except BaseException:  # a Ctrl-C after the buffer was this owner's, before the caller has it: back it goes
            with self._cv:
                if buf is not None and buf.owner is owner and buf in self._buffers:
                    self.release(buf)
            raise

    def _busy(self, pinned: bool, but: object = None) -> int:
        """Buffers of this kind held by checkpoints other than ``but``, whatever their size (lock
        held): a larger save must not get one more copy of the state while they are written."""
        # != : a group is named by equal strings
        return sum(b.owner is not None and b.owner != but and b.pinned == pinned for b in self._buffers)

    def _drop_idle_smaller(self, need: int, pinned: bool) -> None:
        """Idle buffers too small for ``need`` would never serve again: free them (lock held)."""
        for b in [b for b in self._buffers if b.owner is None and b.capacity < need and b.pinned == pinned]:
            self._buffers.remove(b)

    def reserve(self, nbytes: int, pinned: bool) -> Future:
        """Allocate (and prefault) up to ``max_buffers`` buffers for checkpoints of ``nbytes``
        on a background thread, so the first saves find them ready instead of allocating on
        the training thread. Buffers that already fit count, and so do busy ones (the bound);
        a save that arrives meanwhile waits for the reservation rather than allocating a second
        copy.

        Returns:
            A Future that resolves (to the number of buffers allocated) when they are in the
            pool, or holds the allocation's error; the save that needs the memory then tries to
            allocate it itself, and raises there.
        """
        cap = capacity_for((nbytes + ALIGN - 1) // ALIGN * ALIGN)
        fut: Future = Future()
        with self._cv:
            have = sum((b.capacity >= cap or b.owner is not None) and b.pinned == pinned for b in self._buffers)
            n = self.max_buffers - have - sum(p == pinned for _, p in self._pending)
            if self._closed or n <= 0:
                fut.set_result(0)
                return fut
            self._pending.extend([(cap, pinned)] * n)
        # not a daemon: the interpreter waits for it at exit instead of killing it inside torch
        t = threading.Thread(target=self._fill, args=(cap, pinned, n, fut), name="fastckpt-reserve")
        with self._cv:
            self._fillers = [f for f in self._fillers if f.is_alive()] + [t]
        t.start()
        return fut

    def _fill(self, cap: int, pinned: bool, n: int, fut: Future) -> None:
        done = 0
        try:
            for _ in range(n):
                with self._cv:
                    if self._closed:  # closed meanwhile: allocate no more
                        for _ in range(n - done):
                            self._pending.remove((cap, pinned))
                        self._cv.notify_all()
                        break
                buf = _new_buffer(cap, pinned)
                with self._cv:
                    self._pending.remove((cap, pinned))
                    if not self._closed:
                        self._drop_idle_smaller(cap, pinned)
                        self._buffers.append(buf)
                    self._cv.notify_all()
                done += 1
        except BaseException as exc:  # noqa: BLE001 (handed to the Future; the save allocates and raises itself)
            with self._cv:
                for _ in range(n - done):
                    self._pending.remove((cap, pinned))
                self._cv.notify_all()
            log.warning("fastckpt: reserving %d staging buffer(s) of %d bytes failed: %r; the next save "
                        "allocates its own", n - done, cap, exc)
            fut.set_exception(exc)
            return
        fut.set_result(done)

    def release(self, buf: StagingBuffer) -> None:
        with self._cv:
            buf.owner = buf.lease = None
            if self._closed:
                self._buffers.remove(buf)
            self._cv.notify_all()

    def taken(self, lease: Lease) -> bool:
        """The writer job of ``lease``'s save starts (writer thread): True, and it releases the buffer
        once written; False if the saving thread gave it back first, and the job does nothing."""
        with self._cv:
            lease.taken = not lease.given_back
            return lease.taken

    def lent(self, lease: Lease, copy: Callable[[], T]) -> T:
        """Run ``copy`` (a lazy save's, into ``lease``'s buffer, on the snapshot thread) unless the buffer
        was given back first; given back meanwhile, it goes back to the pool once ``copy`` ended."""
        with self._cv:
            if lease.given_back:
                raise CancelledError("the save was interrupted before its copy started")
            lease.lenders += 1
        try:
            return copy()
        finally:
            with self._cv:
                lease.lenders -= 1
                if lease.given_back and not lease.lenders:
                    self.release(lease.buffer)

    def give_back(self, lease: Lease) -> None:
        """The saving thread raised (a Ctrl-C, say) before its writer job had the buffer: it goes back
        to the pool, now or once a lazy copy into it ended; a job of that save that starts later does
        nothing. Once the writer job has it, the writer releases it."""
        with self._cv:
            if lease.taken or lease.given_back:
                return
            lease.given_back = True
            if not lease.lenders:
                self.release(lease.buffer)

    def close(self) -> None:
        """Drop the idle buffers (busy ones go when released), after any reservation still
        allocating has stopped: no thread of the pool outlives ``close`` (a framework's teardown
        may check that none of fastckpt's threads is left). Freeing a prefaulted buffer costs
        about 60 ms per GB here, on the caller's thread."""
        with self._cv:
            self._closed = True  # a reservation thread stops after its current buffer
            fillers, self._fillers = self._fillers, []
        for t in fillers:
            t.join()
        with self._cv:
            idle = [b for b in self._buffers if b.owner is None]
            self._buffers = [b for b in self._buffers if b.owner is not None]
        idle.clear()
