"""Snapshots: the state's bytes copied into a staging buffer at their file offsets.

``snapshot`` runs on the training thread (eager and overlapped saves) or the snapshot thread
(lazy saves); ``Progress`` tells a writer that follows an overlapped copy how far it got;
``Snapshot`` and ``LazySnapshot`` are what the writer receives (``save.writer``).
"""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..format.layout import FileLayout
from ..onesave import OneSave
from .staging import StagingBuffer


@dataclass(eq=False)
class Unfenced:
    """A lazy save that no ``fence()`` has taken yet. ``copy`` is None once the copy ended: its
    snapshot (which holds the state's storages) is let go and the save is counted; a CUDA copy
    keeps only ``cuda_events``, which the fence orders the next kernels after."""

    copy: Future | None
    t_call: float
    blocked: float
    nbytes: int
    cuda_events: dict = field(default_factory=dict)
    batch: OneSave | None = None  # the Checkpointer.one_save() it was made in: the monitor counts it there
    path: str = ""  # what its fence event names (``save.lazy``): the file, its tier, its call's wall time, its group
    tier: str = ""
    w_call: float = 0.0
    group: str | None = None


@dataclass
class Snapshot:
    """A filled staging buffer, whose device copies have landed once ``wait_ready`` returns."""

    buffer: StagingBuffer
    layout: FileLayout
    #: an event recorded after the copies of each device's side stream (a state may span GPUs)
    cuda_events: dict[torch.device, object] = field(default_factory=dict)
    progress: Progress | None = None

    def order_before(self) -> None:
        order_before(self.cuda_events)

    def wait_ready(self) -> None:
        for event in self.cuda_events.values():
            event.synchronize()


def order_before(cuda_events: dict[torch.device, object]) -> None:
    """Make each device's current CUDA stream wait (on the GPU, not the CPU) until the device
    copies that recorded ``cuda_events`` have landed: later kernels, the optimizer step's,
    cannot change what is saved."""
    for device, event in cuda_events.items():
        torch.cuda.current_stream(device).wait_event(event)


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


def _copy_wide(dst: torch.Tensor, off: int, st: torch.UntypedStorage, n: int) -> None:
    """Copy storage ``st`` (``n`` bytes) to ``dst[off:]`` by torch, as 8-byte words where the
    offsets allow: torch's copy of uint8 elements took 1.2 x as long as the same bytes as int64."""
    src = torch.empty(0, dtype=torch.uint8).set_(st)
    wide = n & ~7 if off % 8 == 0 and st.data_ptr() % 8 == 0 else 0
    if wide:
        dst[off : off + wide].view(torch.int64).copy_(src[:wide].view(torch.int64))
    if wide < n:
        dst[off + wide : off + n].copy_(src[wide:])


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
    segments = layout.segments
    # A buffer whose last snapshot was of this layout holds its metadata already: only snapshots
    # write below the tail, and the storages below go to the same slots after the metadata
    # either way, so the image is the same (and 100,000 segments are not copied again).
    if buf.holds != segments.serial:
        buf.holds = 0
        for off, data in segments:
            view[off : off + len(data)] = data
        buf.holds = segments.serial
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
            _copy_wide(dst, rec.offset, st, n)
        if progress is not None and rec.offset + n - told >= ADVANCE_BYTES:
            told = rec.offset + n
            progress.advance(told)
    events = {}
    for device, stream in streams.items():
        events[device] = torch.cuda.Event()
        events[device].record(stream)
        if hold_stream:
            torch.cuda.current_stream(device).wait_event(events[device])
    if progress is not None:
        progress.advance(layout.data_size)  # the caller calls finish() with its blocked time
    return Snapshot(buf, layout, events, progress)


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
