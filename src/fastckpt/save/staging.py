"""Reusable staging buffers: the snapshot's destination, laid out exactly like the file.

One buffer holds one file image (metadata and storages at their file offsets), so the
background writer sends it to disk in large aligned chunks with no further copy. Buffers are
reused across saves: in steady state the pool holds one copy of the state per staging buffer
(``staging_buffers``, 1 by default), plus a little headroom (``capacity_for``). CPU buffers are
page-aligned anonymous memory; buffers for CUDA states are pinned host memory, filled by
non-blocking copies on a side stream.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ..format.layout import ALIGN, FileLayout
from ..io.engine import alloc_aligned

log = logging.getLogger("fastckpt")


@dataclass(eq=False)
class StagingBuffer:
    capacity: int
    pinned: bool
    tensor: torch.Tensor  # uint8, the whole buffer
    view: memoryview
    keepalive: object = None
    owner: object = None


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

    ``acquire`` (training thread) takes the smallest idle buffer that fits. If none is idle, a
    reservation in progress (``reserve``) is waited for and adopted. Otherwise, while fewer than
    ``max_buffers`` buffers that would fit exist (not counting those the same group already
    holds: each file of a group needs its own), a new one is allocated with headroom
    (``capacity_for``); at the limit the save waits for a buffer held by an older checkpoint
    (or, with ``wait=False``, gets None so the caller can skip): that is the backpressure that
    keeps memory at ``max_buffers`` copies of the state. ``release`` (writer thread) hands a
    buffer back. ``reserve`` (any thread) allocates buffers ahead of time on a background thread.
    """

    def __init__(self, max_buffers: int = 1) -> None:
        self._cv = threading.Condition()
        self._buffers: list[StagingBuffer] = []
        self._pending: list[tuple[int, bool]] = []  # reservations being allocated: (capacity, pinned)
        self._closed = False
        self.max_buffers = max_buffers

    def capacities(self, pinned: bool = False) -> list[int]:
        """The capacities of the buffers held now (for tests and reports)."""
        with self._cv:
            return sorted(b.capacity for b in self._buffers if b.pinned == pinned)

    def acquire(self, nbytes: int, owner: object, pinned: bool, wait: bool) -> StagingBuffer | None:
        need = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        with self._cv:
            while True:
                fits = [b for b in self._buffers if b.capacity >= need and b.pinned == pinned]
                idle = [b for b in fits if b.owner is None]
                if idle:
                    buf = min(idle, key=lambda b: b.capacity)
                    buf.owner = owner
                    return buf
                if any(p == pinned for _, p in self._pending):
                    self._cv.wait()  # a reservation is being allocated: adopt it (or see it was too small)
                    continue
                if sum(b.owner != owner for b in fits) < self.max_buffers:  # == : a group is named by equal strings
                    break
                if not wait:
                    return None
                self._cv.wait()
            self._drop_idle_smaller(need, pinned)
        buf = _new_buffer(capacity_for(need), pinned)
        buf.owner = owner
        with self._cv:
            self._buffers.append(buf)
        return buf

    def _drop_idle_smaller(self, need: int, pinned: bool) -> None:
        """Idle buffers too small for ``need`` would never serve again: free them (lock held)."""
        for b in [b for b in self._buffers if b.owner is None and b.capacity < need and b.pinned == pinned]:
            self._buffers.remove(b)

    def reserve(self, nbytes: int, pinned: bool) -> Future:
        """Allocate (and prefault) up to ``max_buffers`` buffers for checkpoints of ``nbytes``
        on a background thread, so the first saves find them ready instead of allocating on
        the training thread. Buffers that already fit count; a save that arrives meanwhile
        waits for the reservation rather than allocating a second copy.

        Returns:
            A Future that resolves (to the number of buffers allocated) when they are in the
            pool, or holds the allocation's error; the save that needs the memory then tries to
            allocate it itself, and raises there.
        """
        cap = capacity_for((nbytes + ALIGN - 1) // ALIGN * ALIGN)
        fut: Future = Future()
        with self._cv:
            have = sum(b.capacity >= cap and b.pinned == pinned for b in self._buffers)
            n = self.max_buffers - have - sum(p == pinned for _, p in self._pending)
            if self._closed or n <= 0:
                fut.set_result(0)
                return fut
            self._pending.extend([(cap, pinned)] * n)
        # not a daemon: the interpreter waits for it at exit instead of killing it inside torch
        threading.Thread(target=self._fill, args=(cap, pinned, n, fut), name="fastckpt-reserve").start()
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
            buf.owner = None
            if self._closed:
                self._buffers.remove(buf)
            self._cv.notify_all()

    def close(self) -> None:
        """Drop the idle buffers (busy ones go when released). Their memory is unmapped on a
        short-lived thread: freeing a prefaulted buffer costs about 60 ms per GB here, which
        the caller (e.g. a framework's teardown on the training thread) need not wait for."""
        with self._cv:
            self._closed = True
            idle = [b for b in self._buffers if b.owner is None]
            self._buffers = [b for b in self._buffers if b.owner is not None]
        # At interpreter exit (the Checkpointer's atexit flush; the main thread no longer counts
        # as alive) a thread started now would not be joined and could be killed inside torch's
        # deallocation: the buffers are freed here instead, when ``idle`` goes.
        if idle and threading.main_thread().is_alive():
            threading.Thread(target=idle.clear, name="fastckpt-free").start()


@dataclass
class Snapshot:
    """A filled staging buffer; ``ready`` is set once device copies have landed."""

    buffer: StagingBuffer
    layout: FileLayout
    cuda_event: object = None
    progress: Progress | None = None
    cuda_device: object = None  # the device whose side stream ``cuda_event`` was recorded on

    def order_before(self) -> None:
        """Make the caller's current CUDA stream wait (on the GPU, not the CPU) until the device
        copies have landed: later kernels, the optimizer step's, cannot change what is saved."""
        if self.cuda_event is not None:
            torch.cuda.current_stream(self.cuda_device).wait_event(self.cuda_event)

    def wait_ready(self) -> None:
        if self.cuda_event is not None:
            self.cuda_event.synchronize()


class Progress:
    """How far a CPU snapshot has filled its buffer, so the writer can start behind it.

    The training thread calls ``advance`` after each storage (storages lie in increasing
    offset order, and the metadata between them is copied first) and ``finish`` at the end,
    with the exception if the copy failed (or the time the caller was blocked); writer threads
    call ``wait_for(end)``.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._upto = 0
        self._done = False
        self._error: BaseException | None = None
        self.blocked_s = 0.0  # how long the caller was blocked: set by ``finish``

    def advance(self, upto: int) -> None:
        with self._cv:
            self._upto = upto
            self._cv.notify_all()

    def finish(self, error: BaseException | None = None, blocked_s: float = 0.0) -> None:
        with self._cv:
            self._done, self._error, self.blocked_s = True, error, blocked_s
            self._cv.notify_all()

    def copying(self) -> bool:
        """True until ``finish`` (the writer's hashing waits for the copy to end)."""
        return not self._done

    def wait_done(self) -> None:
        with self._cv:
            while not self._done:
                self._cv.wait()

    def wait_for(self, end: int) -> None:
        with self._cv:
            while not self._done and self._upto < end:
                self._cv.wait()
            if self._error is not None:
                raise self._error


#: Storages smaller than this are copied with one ``memmove`` each (no tensor objects: about
#: 0.3 us instead of 10 us per storage, which decides the stall for states of many small tensors).
SMALL_COPY_BYTES = 1 << 20
#: How far a copy runs ahead before it tells a writer that follows it (``Progress``).
ADVANCE_BYTES = 8 << 20
# Holds the GIL: 100,000 tiny copies releasing it would hand it to other threads each time.
_memmove = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes._memmove_addr)  # type: ignore[attr-defined]


def cuda_marks(layout: FileLayout) -> dict[torch.device, object] | None:
    """An event on each of the state's devices' current streams, recorded now (the training
    thread, at the call): a lazy snapshot's copies start after it, not after later kernels."""
    if not layout.cuda:
        return None
    marks = {}
    for rec in layout.storages:
        if rec.storage.is_cuda and rec.storage.device not in marks:
            marks[rec.storage.device] = torch.cuda.Event()
            marks[rec.storage.device].record(torch.cuda.current_stream(rec.storage.device))
    return marks


def snapshot(layout: FileLayout, buf: StagingBuffer, progress: Progress | None = None, *,
             after: dict[torch.device, object] | None = None, hold_stream: bool = True) -> Snapshot:
    """Copy the metadata and every storage into ``buf`` at their file offsets.

    CPU storages are copied before this returns (small ones by ``memmove``, large ones by
    torch, which copies with its intra-op threads). CUDA storages are copied on a side stream,
    after the work on the current stream so far (or after the events in ``after``:
    ``cuda_marks``); with ``hold_stream`` the current stream is made to wait for that copy, so
    later kernels cannot change the bytes being saved, while the CPU returns at once. Without
    it (a lazy snapshot, on the snapshot thread) forward and backward kernels run beside the
    copy, and ``Snapshot.order_before`` (``fence()``) orders the optimizer step after it.
    """
    view, dst = buf.view, buf.tensor
    for off, data in layout.segments:
        view[off : off + len(data)] = data
    storages = layout.storages
    told = storages[0].offset if storages else layout.data_size
    if progress is not None:
        progress.advance(told)
    streams: dict[torch.device, object] = {}
    base = dst.data_ptr()
    for rec in storages:
        n = rec.nbytes
        if n == 0:
            continue
        st = rec.storage
        if layout.cuda and st.is_cuda:
            stream = streams.get(st.device)
            if stream is None:
                stream = torch.cuda.Stream(st.device)
                if after is not None and st.device in after:
                    stream.wait_event(after[st.device])
                else:
                    stream.wait_stream(torch.cuda.current_stream(st.device))
                streams[st.device] = stream
            src = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
            with torch.cuda.stream(stream):
                dst[rec.offset : rec.offset + n].copy_(src, non_blocking=True)
            src.record_stream(stream)
            continue
        if n < SMALL_COPY_BYTES:
            _memmove(base + rec.offset, st.data_ptr(), n)
        else:
            dst[rec.offset : rec.offset + n].copy_(torch.empty(0, dtype=torch.uint8).set_(st))
        if progress is not None and rec.offset + n - told >= ADVANCE_BYTES:
            told = rec.offset + n
            progress.advance(told)
    event = device = None
    for device, stream in streams.items():
        event = torch.cuda.Event()
        event.record(stream)
        if hold_stream:
            torch.cuda.current_stream(device).wait_event(event)
    if len(streams) > 1:  # one event per stream is needed only to order the writer
        torch.cuda.synchronize()
        event = device = None
    if progress is not None:
        progress.advance(layout.data_size)  # the caller calls finish() with its blocked time
    return Snapshot(buf, layout, event, progress, device)


@dataclass
class LazySnapshot:
    """A snapshot still being copied on the snapshot thread (``Checkpointer.save(lazy=True)``).

    Quacks like ``Snapshot`` for the writer: ``wait_ready`` waits for the copy (re-raising its
    failure) and then for its device copies; ``buffer`` is released by the writer either way.
    """

    future: Future
    layout: FileLayout
    buffer: StagingBuffer
    progress: None = None  # the writer never runs behind a lazy copy: it waits for it whole

    def wait_ready(self) -> None:
        self.future.result().wait_ready()
