"""commit/reports.py: the saving rank's saves, counted and reported ended through a real TCPStore,
and a failed rank's bounded wait for them (the Lightning DDP end to end: test_lightning_ddp.py)."""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch.distributed as dist

from fastckpt.commit.reports import SaveReports
from fastckpt.records import SaveHandle, SaveRecord


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    yield dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))


def _save(path: str) -> tuple[SaveHandle, Future]:
    fut: Future = Future()
    return SaveHandle(fut, path, lambda exc: None), fut


def _record(path: str) -> SaveRecord:
    return SaveRecord(path=path, tier="direct", bytes=1, blocked_s=0.0, write_s=0.0, commit_s=0.0, durable_s=0.0)


def test_each_fit_draws_its_own_number_and_every_rank_learns_it(store: dist.TCPStore) -> None:
    shared: list[int | None] = []
    first = SaveReports.agree(store, True, lambda n: shared.append(n) or n)
    other = SaveReports.agree(store, False, lambda n: shared[-1])  # the broadcast from the saving rank
    again = SaveReports.agree(store, True, lambda n: n)
    assert shared == [1] and first is not None and other is not None and again is not None
    assert first._prefix == other._prefix != again._prefix
    assert SaveReports.agree(None, True, lambda n: n) is None  # no process group: nothing to report


def test_a_failed_rank_waits_for_the_saves_in_flight_and_no_longer(store: dist.TCPStore, caplog) -> None:
    saver, waiter = SaveReports(store, 7), SaveReports(store, 7)
    assert waiter.wait(0) == 0  # nothing started
    done, fut = _save("a.pt")
    saver.started(done)
    fut.set_result(_record("a.pt"))  # ended before the wait: reported already
    pending, fut = _save("b.pt")
    saver.started(pending)
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        assert waiter.wait(0.2) == 1  # bounded: close_timeout_s
    assert "gave up waiting for 1 checkpoint save(s) rank 0 started" in caplog.text
    ender = threading.Thread(target=fut.set_exception, args=(OSError("EIO"),))  # a failed save ends too
    ender.start()
    assert waiter.wait(60) == 0  # returns once the writer's thread reported it (whenever that was)
    ender.join()


def test_only_the_two_newest_end_keys_stay(store: dist.TCPStore) -> None:
    saver = SaveReports(store, 3)
    for i in range(5):
        handle, fut = _save(f"{i}.pt")
        saver.started(handle)
        fut.set_result(_record(f"{i}.pt"))
    keys = sorted(k for k in store.list_keys() if k.startswith("fastckpt/reports/3/"))
    assert keys == [f"fastckpt/reports/3/{k}" for k in ("ended", "ended/4", "ended/5", "started")]
    assert SaveReports(store, 3).wait(0) == 0


class _StoreRacedAtFirstCheck:
    """The waiter's store: before its first look for ``ended/<n>``, ``race`` runs (saves that
    start and end between the waiter's count and its wait). No ``clone``: Waits polls ``check``."""

    def __init__(self, store: dist.TCPStore, race) -> None:
        self._store, self._race = store, race

    def add(self, key: str, n: int) -> int:
        return self._store.add(key, n)

    def check(self, keys: list[str]) -> bool:
        race, self._race = self._race, None
        if race is not None:
            race()
        return self._store.check(keys)


def test_a_wait_whose_key_went_with_later_saves_counts_again(store: dist.TCPStore, monkeypatch) -> None:
    """The waiter counted 2 started, 1 ended and waits for ended/2; before it looks, that save
    and two more start and end, and ended/2 is deleted (the two newest stay): it counts again
    rather than wait for a key that will never come (with no bound: for ever)."""
    saver = SaveReports(store, 5)
    futures = []
    for i in range(2):
        handle, fut = _save(f"{i}.pt")
        saver.started(handle)
        futures.append(fut)
    futures[0].set_result(_record("0.pt"))

    def race() -> None:
        futures[1].set_result(_record("1.pt"))
        for i in (2, 3):
            handle, fut = _save(f"{i}.pt")
            saver.started(handle)
            fut.set_result(_record(f"{i}.pt"))

    monkeypatch.setattr("fastckpt.commit.reports.RECHECK_S", 0.5)  # WAIT_SLICE_S (30 s) in a job
    waiter = SaveReports(_StoreRacedAtFirstCheck(store, race), 5)
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(waiter.wait(None)), daemon=True)
    t.start()
    t.join(60)
    assert not store.check(["fastckpt/reports/5/ended/2"]) and got == [0]
