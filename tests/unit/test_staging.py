"""StagingPool: headroom, reservations made ahead of the first save, the buffer limit."""

from __future__ import annotations

import inspect
import threading

import pytest

from fastckpt.format.layout import ALIGN
from fastckpt.save import staging
from fastckpt.save.staging import HEADROOM_MIN, StagingPool, capacity_for

MiB = 1 << 20


class AllocSpy:
    """Counts real allocations; ``hold()`` makes the next ones wait until ``go`` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[int] = []
        self.entered = threading.Event()
        self.go = threading.Event()
        self.go.set()
        self.fail: BaseException | None = None
        real = staging._new_buffer

        def spy(capacity: int, pinned: bool) -> staging.StagingBuffer:
            self.calls.append(capacity)
            self.entered.set()
            assert self.go.wait(30)
            if self.fail is not None:
                raise self.fail
            return real(capacity, pinned)

        monkeypatch.setattr(staging, "_new_buffer", spy)

    def hold(self) -> None:
        self.go.clear()
        self.entered.clear()


def spy_waits(pool: StagingPool) -> threading.Event:
    """Set once a caller waits on the pool's condition (e.g. for a reservation)."""
    waiting = threading.Event()
    real = pool._cv.wait

    def wait(timeout: float | None = None) -> bool:
        waiting.set()
        return real(timeout)

    pool._cv.wait = wait  # type: ignore[method-assign]
    return waiting


def test_capacity_has_bounded_headroom() -> None:
    for n in (0, ALIGN, 10 * MiB, 304_000_000, 1 << 30):
        cap = capacity_for(n)
        assert cap % ALIGN == 0
        assert cap >= n + HEADROOM_MIN
        assert cap <= n + max(HEADROOM_MIN, n // 64) + ALIGN


def test_small_growth_reuses_the_buffer(monkeypatch) -> None:
    spy = AllocSpy(monkeypatch)
    pool = StagingPool()
    a = pool.acquire(10 * MiB, object(), pinned=False, wait=True)
    pool.release(a)
    b = pool.acquire(10 * MiB + 123, object(), pinned=False, wait=True)  # grew by a few bytes
    assert b is a and len(spy.calls) == 1
    pool.release(b)
    c = pool.acquire(20 * MiB, object(), pinned=False, wait=True)  # beyond the headroom
    assert c is not a and len(spy.calls) == 2
    assert pool.capacities() == [c.capacity]  # the small idle one was freed: memory stays bounded


def test_first_save_adopts_the_reservation(monkeypatch) -> None:
    spy = AllocSpy(monkeypatch)
    pool = StagingPool()
    assert pool.reserve(8 * MiB, pinned=False).result(30) == 1
    buf = pool.acquire(8 * MiB + 500, object(), pinned=False, wait=True)
    assert len(spy.calls) == 1 and pool.capacities() == [buf.capacity]
    pool.release(buf)
    assert pool.reserve(8 * MiB, pinned=False).result(30) == 0  # already there: nothing more


def test_save_during_reservation_waits_for_it_and_never_allocates_twice(monkeypatch) -> None:
    spy = AllocSpy(monkeypatch)
    pool = StagingPool()
    waiting = spy_waits(pool)
    spy.hold()
    fut = pool.reserve(8 * MiB, pinned=False)
    assert spy.entered.wait(30)  # the reservation is allocating
    got: list[staging.StagingBuffer] = []
    saver = threading.Thread(target=lambda: got.append(pool.acquire(8 * MiB, object(), False, True)))
    saver.start()
    assert waiting.wait(30)  # the save waits for the reservation instead of allocating
    assert len(spy.calls) == 1
    spy.go.set()
    saver.join(30)
    assert fut.result(30) == 1
    assert len(spy.calls) == 1 and pool.capacities() == [got[0].capacity]


def test_too_small_reservation_is_replaced_not_kept(monkeypatch) -> None:
    spy = AllocSpy(monkeypatch)
    pool = StagingPool()
    pool.reserve(MiB, pinned=False).result(30)
    buf = pool.acquire(16 * MiB, object(), pinned=False, wait=True)
    assert len(spy.calls) == 2 and pool.capacities() == [buf.capacity]


def test_failed_reservation_leaves_the_save_to_allocate(monkeypatch, caplog) -> None:
    spy = AllocSpy(monkeypatch)
    pool = StagingPool()
    spy.fail = MemoryError("no room")
    with caplog.at_level("WARNING", logger="fastckpt"):
        fut = pool.reserve(MiB, pinned=False)
        with pytest.raises(MemoryError):
            fut.result(30)
    assert "reserving 1 staging buffer" in caplog.text
    spy.fail = None
    buf = pool.acquire(MiB, object(), pinned=False, wait=True)
    assert pool.capacities() == [buf.capacity]


def test_two_buffers_serve_two_saves_and_no_more(monkeypatch) -> None:
    spy = AllocSpy(monkeypatch)
    pool = StagingPool(max_buffers=2)
    assert pool.reserve(4 * MiB, pinned=False).result(30) == 2
    a = pool.acquire(4 * MiB, object(), pinned=False, wait=True)
    b = pool.acquire(4 * MiB, object(), pinned=False, wait=True)  # the first is still writing
    assert a is not b and len(spy.calls) == 2
    assert pool.acquire(4 * MiB, object(), pinned=False, wait=False) is None  # bounded: two copies
    pool.release(a)
    assert pool.acquire(4 * MiB, object(), pinned=False, wait=False) is a


def test_one_buffer_makes_the_second_save_wait(monkeypatch) -> None:
    AllocSpy(monkeypatch)
    pool = StagingPool()
    pool.acquire(MiB, object(), pinned=False, wait=True)
    assert pool.acquire(MiB, object(), pinned=False, wait=False) is None


def test_reservation_finishing_after_close_is_freed(monkeypatch) -> None:
    spy = AllocSpy(monkeypatch)
    before = frozenset(threading.enumerate())  # a pool an earlier test dropped may still hold its thread
    pool = StagingPool()
    spy.hold()
    fut = pool.reserve(MiB, pinned=False)
    assert spy.entered.wait(30)
    closer = threading.Thread(target=pool.close)  # close() waits for the reservation's thread
    closer.start()
    spy.go.set()
    closer.join(30)
    assert not closer.is_alive()
    fut.result(30)
    assert pool.capacities() == []
    assert not any(t.name == "fastckpt-reserve" for t in threading.enumerate() if t not in before)


def test_close_frees_idle_buffers_before_it_returns() -> None:
    """No thread of the pool outlives close(): the buffers are freed on the caller's thread
    (Lightning's test fixtures fail a test that leaves a thread behind)."""
    import weakref

    pool = StagingPool()
    buf = pool.acquire(MiB, object(), pinned=False, wait=True)
    pool.release(buf)
    freed_by: list[str] = []
    weakref.finalize(buf, lambda: freed_by.append(threading.current_thread().name))
    del buf
    pool.close()
    assert freed_by == [threading.current_thread().name] and pool.capacities() == []


def test_cpu_buffers_are_prefaulted_without_holding_the_gil(monkeypatch) -> None:
    """MAP_POPULATE runs inside Python's mmap() with the GIL held, stalling every thread (the
    training thread too, while a reservation allocates in the background): pages are faulted in
    by a torch write instead, which releases the GIL."""
    calls: list[dict] = []
    real = staging.alloc_aligned
    monkeypatch.setattr(staging, "alloc_aligned", lambda n, **kw: calls.append(kw) or real(n, **kw))
    buf = staging._new_buffer(4 * MiB, pinned=False)
    assert calls == [{}]
    assert buf.capacity == 4 * MiB and len(buf.view) == 4 * MiB and buf.tensor.numel() == 4 * MiB
    assert int(buf.tensor[:: 4096].sum()) == 0  # every page was written




def test_an_idle_buffer_that_holds_the_layouts_metadata_is_preferred() -> None:
    pool = StagingPool(max_buffers=2)
    a = pool.acquire(4 * MiB, object(), pinned=False, wait=True)
    b = pool.acquire(4 * MiB, object(), pinned=False, wait=True)
    a.holds, b.holds = 11, 12
    pool.release(a)
    pool.release(b)
    assert pool.acquire(4 * MiB, object(), pinned=False, wait=True, holds=12) is b
    assert pool.acquire(4 * MiB, object(), pinned=False, wait=True, holds=99) is a  # none holds it: any that fits
    pool.release(a)
    pool.release(b)
    small = pool.acquire(MiB, object(), pinned=False, wait=True)  # one of them: no third buffer
    assert small in (a, b)
    pool.close()


def test_a_larger_save_counts_busy_smaller_buffers_against_the_limit(monkeypatch) -> None:
    """A state that outgrows the buffer while it is being written: the save is skipped (or
    waits), never given another full copy; once it gets its buffer, the small one goes."""
    spy = AllocSpy(monkeypatch)
    pool = StagingPool(max_buffers=1)
    small = pool.acquire(4 * MiB, object(), pinned=False, wait=True)
    assert pool.acquire(8 * MiB, object(), pinned=False, wait=False) is None  # skipped, not allocated
    assert pool.reserve(8 * MiB, pinned=False).result(30) == 0  # a reservation keeps the bound too
    waiting = spy_waits(pool)
    got: list[staging.StagingBuffer] = []
    saver = threading.Thread(target=lambda: got.append(pool.acquire(8 * MiB, object(), False, True)))
    saver.start()
    assert waiting.wait(30)  # the save waits for the busy buffer
    assert len(spy.calls) == 1
    pool.release(small)
    saver.join(30)
    assert len(spy.calls) == 2 and pool.capacities() == [got[0].capacity]  # the small one was freed


def test_a_groups_own_buffers_of_any_size_do_not_count_against_it(monkeypatch) -> None:
    AllocSpy(monkeypatch)
    pool = StagingPool(max_buffers=1)
    model = pool.acquire(MiB, "step-1", pinned=False, wait=True)
    optim = pool.acquire(4 * MiB, "step-1", pinned=False, wait=False)  # the same group's next file
    assert optim is not None and optim is not model
    assert pool.acquire(8 * MiB, "step-2", pinned=False, wait=False) is None  # another group waits


@pytest.mark.parametrize("idle", [False, True])
def test_a_ctrl_c_as_acquire_returns_gives_the_buffer_back(monkeypatch, idle: bool) -> None:
    """A real SIGINT between the buffer becoming the caller's and ``acquire`` returning it (raised
    from a line tracer at ``return buf``): the buffer goes back, and the next save gets it
    instead of waiting for ever (or, with ``wait=False``, being skipped)."""
    import signal
    import sys

    AllocSpy(monkeypatch)
    pool = StagingPool()
    if idle:
        pool.release(pool.acquire(MiB, object(), pinned=False, wait=True))
    code, lines = staging.StagingPool.acquire.__code__, inspect.getsourcelines(staging.StagingPool.acquire)
    returns = {lines[1] + i for i, text in enumerate(lines[0]) if text.strip() == "return buf"}

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None
        if event == "line" and frame.f_lineno in returns:
            sys.settrace(None)
            signal.raise_signal(signal.SIGINT)  # a Ctrl-C now: KeyboardInterrupt in acquire
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.acquire(MiB, object(), pinned=False, wait=False)
    finally:
        sys.settrace(previous)
    assert pool.acquire(MiB, object(), pinned=False, wait=False) is not None
