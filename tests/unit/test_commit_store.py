"""Group commits through a torch.distributed store (issue #15), with simulated ranks.

Every "rank" is a Checkpointer(rank=r, world_size=W, store=...) in this process, all sharing
one real TCPStore (the way the default process group's store is shared by a job's ranks).
The multi-process protocol over torchrun's store is covered by tests/integration/test_groups.py.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.commit import protocol as P
from fastckpt.commit import store as S
from fastckpt.errors import CommitTimeoutError, ConfigError, IncompleteCheckpointError
from fastckpt.testing import Fault, FaultyOps
from tests.helpers import close_all, expect_aborted_by_rank_1, latest, place

W = 64


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    s = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    yield s


def _ranks(n: int, store: object, ops0: FaultyOps | None = None, **kw: object) -> list[fastckpt.Checkpointer]:
    kw.setdefault("commit_timeout_s", 60)
    return [fastckpt.Checkpointer(rank=r, world_size=n, store=store, io_threads=1, overhead_budget=0.99,
                                  ops=ops0 if r == 0 else None, **kw) for r in range(n)]


def _state(step: int, rank: int) -> dict:
    return {"w": torch.arange(64, dtype=torch.int64) + 1000 * step + rank, "step": step, "rank": rank}


def _fastckpt_keys(s: dist.TCPStore) -> list[str]:
    return sorted(k for k in s.list_keys() if k.startswith("fastckpt/") and not k.startswith("fastckpt/session/"))


def test_64_ranks_commit_through_the_store(tmp_path: Path, store: dist.TCPStore) -> None:
    marker_reads: list[str] = []
    ops0 = FaultyOps(on_call=lambda op, path: marker_reads.append(path)
                     if op == "open" and os.path.basename(path).startswith("rank-") else None)
    cks = _ranks(W, store, ops0)
    try:
        for step in (1, 2):
            g = tmp_path / f"global_step{step}"
            for r, ck in enumerate(cks):
                ck.save(_state(step, r), str(g / f"rank{r:03d}.pt"), group=str(g))
            recs = [h.wait(60) for h in [ck.commit(str(g), step=step) for ck in cks]]
            m = P.read_group_manifest(place(str(g)))
            assert m["world_size"] == W and m["step"] == step and m["ranks"] == list(range(W))
            assert sorted(m["files"]) == [f"rank{r:03d}.pt" for r in range(W)]
            assert all(rec.bytes == sum(f["size"] for f in m["files"].values()) for rec in recs)
            # A fixed number of store operations per rank, one blocking wait each: no polling of
            # the store. Every other rank: append, add, wait, get, add (5); rank 0: append, add,
            # wait, check, get, claim, set, 3 deletes (10). Whichever rank completes the count
            # also sets "ready" (+1), and the last to hear the outcome deletes 3 keys (+3).
            # The first commit agrees on the session first (session.py): every other rank asks
            # rank 0 and joins (append, ring, wait, get, delete, append, ring: 7-11 more, as a
            # ring reads the list of serving rank 0s and sets the bell of each: check, get, set);
            # rank 0 answers in rounds, as many as the asks come in.
            ops = [rec.store_ops for rec in recs]
            joining = range(7, 12) if step == 1 else range(0, 1)
            assert all(any(n - j in (5, 6, 8, 9) for j in joining) for n in ops[1:]), ops
            if step == 1:
                assert ops[0] >= 9 + 1 + (W - 1), ops  # the session's number, an answer per rank
            else:
                assert ops[0] in (9, 10), ops
                assert sum(ops) == 9 + 5 * (W - 1) + 1 + 3, ops
            assert _fastckpt_keys(store) == []  # ... and nothing left behind once every rank knows
            assert P.read_markers(place(str(g))) == {}  # markers are written only when a commit fails
        assert marker_reads == []  # rank 0 never read a marker: it learned everything from the store
    finally:
        for ck in cks:
            ck.close()
    assert latest(str(tmp_path)) == str(tmp_path / "global_step2")
    for r in (0, W - 1):
        got = fastckpt.load(str(tmp_path / "global_step2" / f"rank{r:03d}.pt"))
        assert torch.equal(got["w"], _state(2, r)["w"])


@pytest.mark.parametrize("kind", ["TCPStore", "FileStore"])
def test_a_dead_rank_fails_the_commit_on_every_rank_naming_it(tmp_path: Path, kind: str) -> None:
    """A FileStore (``init_method="file://..."``) times a wait out with a plain RuntimeError("Wait
    timeout"), not a DistStoreError: it went through as that, after commit_timeout_s, on every rank."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60)) if kind == "TCPStore" \
        else dist.FileStore(str(tmp_path / "filestore"), 1)
    cks = _ranks(3, store, commit_timeout_s=1.5)
    g1, g2 = tmp_path / "global_step1", tmp_path / "global_step2"
    try:
        for h in [ck.commit(str(g1)) for ck in cks if ck.save(_state(1, ck.rank), str(g1 / f"r{ck.rank}.pt"),
                                                                 group=str(g1))]:
            h.wait(60)
        for ck in cks:
            ck.save(_state(2, ck.rank), str(g2 / f"r{ck.rank}.pt"), group=str(g2)).wait(60)
        t0 = time.monotonic()
        handles = [cks[0].commit(str(g2)), cks[1].commit(str(g2))]  # rank 2 "died" before its commit
        for h in handles:
            with pytest.raises(CommitTimeoutError, match=r"ranks \[2\] of 3 did not commit"):
                h.wait(60)
        assert time.monotonic() - t0 < 1.5 + 10  # rank 1 learned rank 0's verdict from the store
    finally:
        for ck in cks[:2]:
            ck.close()
    assert latest(str(tmp_path)) == str(g1)
    assert not (g2 / P.GROUP_MANIFEST).exists()
    with pytest.raises(IncompleteCheckpointError, match=r"ranks \[2\] of 3 never committed"):
        fastckpt.load(str(g2 / "r0.pt"))
    assert torch.equal(fastckpt.load(str(g1 / "r2.pt"))["w"], _state(1, 2)["w"])


def test_a_failed_save_ends_the_commit_on_every_rank_at_once(tmp_path: Path, store: dist.TCPStore) -> None:
    """A rank whose save into the group fails tells the others through the store: none of them
    waits commit_timeout_s (600 s here) for its announcement."""
    ops1 = FaultyOps()
    cks = [fastckpt.Checkpointer(rank=r, world_size=3, store=store, io_threads=1, overhead_budget=0.99,
                                 commit_timeout_s=600, ops=ops1 if r == 1 else None) for r in range(3)]
    g1, g2 = tmp_path / "global_step1", tmp_path / "global_step2"
    try:
        for h in [ck.commit(str(g1)) for ck in cks if ck.save(_state(1, ck.rank), str(g1 / f"r{ck.rank}.pt"),
                                                                 group=str(g1))]:
            h.wait(60)
        ops1.inject(Fault("pwrite", 28, path_contains="r1.pt"))  # ENOSPC on rank 1's file of step 2
        for ck in cks:
            ck.save(_state(2, ck.rank), str(g2 / f"r{ck.rank}.pt"), group=str(g2))
        expect_aborted_by_rank_1(cks[1], [cks[0].commit(str(g2)), cks[2].commit(str(g2))], str(g2))
    finally:
        close_all(cks)
    assert latest(str(tmp_path)) == str(g1)
    assert not (g2 / P.GROUP_MANIFEST).exists()


def test_a_checkpointer_made_again_does_not_reuse_a_failed_attempts_keys(tmp_path: Path,
                                                                         store: dist.TCPStore) -> None:
    g = tmp_path / "global_step1"
    first = _ranks(2, store, commit_timeout_s=0.5)
    first[1].save(_state(1, 1), str(g / "r1.pt"), group=str(g)).wait(60)
    with pytest.raises(CommitTimeoutError):
        first[1].commit(str(g)).wait(60)  # rank 0 never came: rank 1 gives up
    for ck in first:
        ck.close()
    second = _ranks(2, store)  # a new session: attempt 0 again, under other keys
    try:
        for h in [ck.commit(str(g)) for ck in second if ck.save(_state(2, ck.rank), str(g / f"r{ck.rank}.pt"),
                                                               group=str(g))]:
            h.wait(60)
    finally:
        for ck in second:
            ck.close()
    m = P.read_group_manifest(place(str(g)))
    assert sorted(m["files"]) == ["r0.pt", "r1.pt"]
    assert torch.equal(fastckpt.load(str(g / "r1.pt"))["w"], _state(2, 1)["w"])


def test_store_option_must_be_a_store() -> None:
    with pytest.raises(ConfigError, match="lacks add, append"):
        fastckpt.Checkpointer(rank=0, world_size=2, store=object())


class _CountingStore(dist.TCPStore):
    """A TCPStore whose clones record the timeout of every blocking ``wait``."""

    def __init__(self) -> None:
        super().__init__("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
        self.timeouts: list[float] = []

    def clone(self) -> object:
        outer, conn = self, super().clone()

        class Conn:
            def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
                outer.timeouts.append(timeout.total_seconds())
                conn.wait(keys, timeout)
        return Conn()


@pytest.mark.parametrize("close_timeout_s", [None, 5.0])
def test_a_commit_waits_in_one_store_wait_unless_close_can_end_it_early(tmp_path: Path,
                                                                        close_timeout_s: float | None) -> None:
    # Each c10d wait that times out logs two warnings: slices re-armed every 30 s filled the logs
    # of a commit that waited minutes. Only a close() with a time limit can end a wait early.
    store = _CountingStore()
    cks = _ranks(2, store, close_timeout_s=close_timeout_s, commit_timeout_s=120)
    g = tmp_path / "global_step1"
    try:
        cks[1].save(_state(1, 1), str(g / "r1.pt"), group=str(g))
        h1 = cks[1].commit(str(g))  # waits for rank 0's outcome
        cks[0].save(_state(1, 0), str(g / "r0.pt"), group=str(g))
        cks[0].commit(str(g)).wait(60)
        h1.wait(60)
    finally:
        close_all(cks)
    assert store.timeouts
    if close_timeout_s is None:
        assert min(store.timeouts) > S.WAIT_SLICE_S  # the whole commit timeout, in one wait
    else:
        assert max(store.timeouts) <= S.WAIT_SLICE_S


def test_a_wait_ends_at_its_deadline_or_when_stopped() -> None:
    waits = S.Waits.of(_CountingStore())
    assert not waits.wait("never", time.monotonic() + 0.5, threading.Event(), None)
    stopped = threading.Event()
    stopped.set()
    assert not waits.wait("never", time.monotonic() + 600, stopped, S.WAIT_SLICE_S)
