"""Reusable staging buffers: the snapshot's destination, laid out exactly like the file.

One buffer holds one file image (metadata and storages at their file offsets), so the
background writer sends it to disk in large aligned chunks with no further copy. Buffers are
reused across saves: in steady state the pool holds one copy of the state. CPU buffers are
page-aligned anonymous memory; buffers for CUDA states are pinned host memory, filled by
non-blocking copies on a side stream.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .format import ALIGN, FileLayout
from .io.engine import alloc_aligned

_ids = itertools.count()


@dataclass(eq=False)
class StagingBuffer:
    capacity: int
    pinned: bool
    tensor: torch.Tensor  # uint8, the whole buffer
    view: memoryview
    keepalive: object = None
    owner: object = None
    id: int = field(default_factory=lambda: next(_ids))


def _new_buffer(capacity: int, pinned: bool) -> StagingBuffer:
    if pinned:
        t = torch.empty(capacity + ALIGN, dtype=torch.uint8, pin_memory=True)
        shift = (-t.data_ptr()) % ALIGN
        t = t[shift : shift + capacity]
        return StagingBuffer(capacity, True, t, memoryview(t.numpy()).cast("B"), None)
    mem = alloc_aligned(capacity, populate=True)
    t = torch.frombuffer(mem, dtype=torch.uint8)[:capacity]
    return StagingBuffer(capacity, False, t, memoryview(mem)[:capacity], mem)


class StagingPool:
    """Buffers keyed by capacity, each owned by at most one in-flight checkpoint.

    ``acquire`` (training thread) takes the smallest idle buffer that fits. If none is idle but
    a buffer that would fit is held by an older checkpoint, the save waits for it (or, with
    ``wait=False``, gets None so the caller can skip): that is the backpressure that keeps
    memory at one copy of the state. Only when no buffer could ever serve the request is a new
    one allocated. ``release`` (writer thread) hands a buffer back.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._buffers: list[StagingBuffer] = []
        self._closed = False

    @property
    def total_bytes(self) -> int:
        with self._cv:
            return sum(b.capacity for b in self._buffers)

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
                if not any(b.owner != owner for b in fits):  # == : a group is named by equal strings
                    break
                if not wait:
                    return None
                self._cv.wait()
            # Drop idle buffers too small for this size that no one uses, then allocate.
            smaller = [b for b in self._buffers if b.owner is None and b.capacity < need and b.pinned == pinned]
            for b in smaller:
                self._buffers.remove(b)
        buf = _new_buffer(need, pinned)
        buf.owner = owner
        with self._cv:
            self._buffers.append(buf)
        return buf

    def release(self, buf: StagingBuffer) -> None:
        with self._cv:
            buf.owner = None
            if self._closed:
                self._buffers.remove(buf)
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._buffers = [b for b in self._buffers if b.owner is not None]


@dataclass
class Snapshot:
    """A filled staging buffer; ``ready`` is set once device copies have landed."""

    buffer: StagingBuffer
    layout: FileLayout
    cuda_event: object = None
    progress: Progress | None = None

    def wait_ready(self) -> None:
        if self.cuda_event is not None:
            self.cuda_event.synchronize()


class Progress:
    """How far a CPU snapshot has filled its buffer, so the writer can start behind it.

    The training thread calls ``advance`` after each storage (storages lie in increasing
    offset order, and the metadata between them is copied first) and ``finish`` at the end,
    with the exception if the copy failed; writer threads call ``wait_for(end)``.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._upto = 0
        self._done = False
        self._error: BaseException | None = None

    def advance(self, upto: int) -> None:
        with self._cv:
            self._upto = upto
            self._cv.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        with self._cv:
            self._done, self._error = True, error
            self._cv.notify_all()

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


def snapshot(layout: FileLayout, buf: StagingBuffer, progress: Progress | None = None) -> Snapshot:
    """Copy the metadata and every storage into ``buf`` at their file offsets.

    CPU storages are copied before this returns. CUDA storages are copied on a side stream;
    the caller's current stream is made to wait for that copy, so later kernels cannot change
    the bytes being saved, while the CPU returns at once.
    """
    view, dst = buf.view, buf.tensor
    for off, data in layout.segments:
        view[off : off + len(data)] = data
    storages = layout.storages
    if progress is not None:
        progress.advance(storages[0].offset if storages else layout.data_size)
    streams: dict[torch.device, object] = {}
    for rec in layout.storages:
        if rec.nbytes == 0:
            continue
        st = rec.storage
        src = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
        target = dst[rec.offset : rec.offset + rec.nbytes]
        if st.device.type == "cuda":
            stream = streams.get(st.device)
            if stream is None:
                stream = torch.cuda.Stream(st.device)
                stream.wait_stream(torch.cuda.current_stream(st.device))
                streams[st.device] = stream
            with torch.cuda.stream(stream):
                target.copy_(src, non_blocking=True)
            src.record_stream(stream)
        else:
            target.copy_(src)
            if progress is not None:
                progress.advance(rec.offset + rec.nbytes)
    event = None
    for device, stream in streams.items():
        event = torch.cuda.Event()
        event.record(stream)
        torch.cuda.current_stream(device).wait_event(event)
    if len(streams) > 1:  # one event per stream is needed only to order the writer
        torch.cuda.synchronize()
        event = None
    if progress is not None:
        progress.finish()
    return Snapshot(buf, layout, event, progress)


@dataclass
class LazySnapshot:
    """A snapshot still being copied on the snapshot thread (``Checkpointer.save(lazy=True)``).

    Quacks like ``Snapshot`` for the writer: ``wait_ready`` waits for the copy (re-raising its
    failure) and then for its device copies; ``buffer`` is released by the writer either way.
    """

    future: Future
    layout: FileLayout
    buffer: StagingBuffer

    def wait_ready(self) -> None:
        self.future.result().wait_ready()
