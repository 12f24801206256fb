"""A rank that closes its Checkpointer (``close()``, or the exit flush) after saving into a group it
never committed ends that attempt on every rank (``Coordinator.close``): the others' commits fail
at once, naming the rank and why, instead of waiting ``commit_timeout_s``; ``latest`` stays at the
last committed group. A commit in flight is waited for, not ended; a rank that saved nothing into
a group leaves it alone; one rank is unaffected.

Simulated ranks: two Checkpointer(rank=r, world_size=2) in this process, with a real TCPStore or
without one (marker files). Real processes: tests/integration/test_group_rank_closed.py.
"""

from __future__ import annotations

import datetime
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.commit import protocol as P
from fastckpt.commit.names import MARKER_DIR
from fastckpt.errors import CheckpointWriteError
from tests.helpers import close_all, latest

TIMEOUT_S = 30  # commit_timeout_s: a commit this fix does not end waits that long (the tests give it 20 s)


@pytest.fixture(params=["store", "no store"])
def store(request: pytest.FixtureRequest) -> object | None:
    if request.param == "no store":
        return None
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))


def _state(step: int, rank: int) -> dict:
    return {"w": torch.arange(256, dtype=torch.int64) + 1000 * step + rank, "step": step}


def _ranks(store: object | None, world: int = 2) -> list[fastckpt.Checkpointer]:
    return [fastckpt.Checkpointer(rank=r, world_size=world, store=store, io_threads=1, overhead_budget=0.99,
                                  commit_timeout_s=TIMEOUT_S) for r in range(world)]


def _save(ck: fastckpt.Checkpointer, g: Path, step: int) -> fastckpt.SaveHandle:
    return ck.save(_state(step, ck.rank), str(g / f"r{ck.rank}.pt"), group=str(g))


def _commit_step_1(cks: list, tmp_path: Path) -> Path:
    g1 = tmp_path / "global_step1"
    for ck in cks:
        _save(ck, g1, 1)
    for h in [ck.commit(str(g1), step=1) for ck in cks]:
        h.wait(60)
    return g1


def _both_saved_step_2(cks: list, tmp_path: Path) -> Path:
    """global_step1 committed by both ranks, then global_step2 saved (not committed) by both."""
    _commit_step_1(cks, tmp_path)
    g2 = tmp_path / "global_step2"
    for ck in cks:
        _save(ck, g2, 2).wait(60)
    return g2


def _closing(ck: fastckpt.Checkpointer) -> tuple[threading.Thread, list[BaseException]]:
    """``ck.close()`` on a thread of its own (it may wait for the other rank), started; what it raised."""
    raised: list[BaseException] = []

    def close() -> None:
        try:
            ck.close()
        except BaseException as exc:  # noqa: BLE001 (the test asserts there is none)
            raised.append(exc)

    th = threading.Thread(target=close, name="closing-rank")
    th.start()
    return th, raised


@pytest.mark.parametrize("closer", [1, 0])
def test_a_rank_closed_without_committing_its_group_ends_the_others_commit(tmp_path: Path, closer: int) -> None:
    """With a store: both ranks save global_step2; the other rank commits it and waits; ``closer``
    closes instead. The other's commit fails at once naming the closer, and global_step1 stays the latest."""
    cks = _ranks(dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60)))
    try:
        g1 = _commit_step_1(cks, tmp_path)
        g2 = tmp_path / "global_step2"
        for ck in cks:
            _save(ck, g2, 2).wait(60)
        waiting = cks[1 - closer].commit(str(g2), step=2)
        cks[closer].close()
        with pytest.raises(CheckpointWriteError,
                           match=rf"rank {closer} closed its Checkpointer without committing group {g2}"):
            waiting.wait(20)  # not CommitTimeoutError after commit_timeout_s
    finally:
        close_all(cks)
    assert latest(str(tmp_path)) == str(g1)
    assert not (g2 / P.GROUP_MANIFEST).exists()


@pytest.mark.parametrize("closer", [1, 0])
def test_a_rank_whose_only_save_into_a_group_raised_ends_it_at_close(tmp_path: Path, closer: int) -> None:
    """With a store: ``closer``'s save into global_step2 raises at the call (an entry it cannot save; a
    signal's ``SystemExit`` inside ``save()`` alike), so it began no attempt, and it closes. The other
    rank's commit fails at once naming the closer and the save, not after commit_timeout_s."""
    cks = _ranks(dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60)))
    try:
        g1 = _commit_step_1(cks, tmp_path)
        g2 = tmp_path / "global_step2"
        with pytest.raises(fastckpt.UnsupportedObjectError):
            cks[closer].save({"hook": lambda: 0}, str(g2 / f"r{closer}.pt"), group=str(g2))
        _save(cks[1 - closer], g2, 2).wait(60)
        waiting = cks[1 - closer].commit(str(g2), step=2)
        cks[closer].close()
        with pytest.raises(CheckpointWriteError, match=rf"rank {closer} closed its Checkpointer without committing "
                                                       rf"group {g2}: its save of r{closer}.pt \(UnsupportedObject"):
            waiting.wait(20)  # not CommitTimeoutError after commit_timeout_s
    finally:
        close_all(cks)
    assert latest(str(tmp_path)) == str(g1)


@pytest.mark.parametrize("closer", [1, 0])
def test_closing_after_a_failed_re_save_leaves_the_published_groups_local_copy_whole(tmp_path: Path,
                                                                                     closer: int) -> None:
    """The published global_step1 saved again, ``closer``'s save raising at the call: close() ends that
    attempt, and its burst-buffer copy of the published group keeps its manifest (set aside as the attempt
    began, given back as it ends), so loads still read it there."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    cks = [fastckpt.Checkpointer(rank=r, world_size=2, store=store, io_threads=1, overhead_budget=0.99,
                                 commit_timeout_s=TIMEOUT_S, local_dir=str(tmp_path / f"nvme{r}")) for r in range(2)]
    try:
        g1 = _commit_step_1(cks, tmp_path / "home")
        mine = str(g1 / f"r{closer}.pt")
        local = Path(cks[closer].local_path(mine)).parent / P.GROUP_MANIFEST
        assert local.exists()
        with pytest.raises(fastckpt.UnsupportedObjectError):
            cks[closer].save({"hook": lambda: 0}, mine, group=str(g1))
    finally:
        close_all(cks)
    assert local.exists() and latest(str(tmp_path / "home")) == str(g1)
    with fastckpt.Checkpointer(local_dir=str(tmp_path / f"nvme{closer}")) as ck:
        assert ck.load(mine)["step"] == 1 and ck.stats().last_restore_from == "local"


def test_a_rank_closed_before_the_session_was_agreed_closes_at_once_telling_no_one(tmp_path: Path) -> None:
    """With a store, a rank that closes before its first commit does not know the store session yet:
    telling the others would wait for rank 0, which may be dead too (a rank closing with a group
    saved and never committed, rank 1 never there, took 60 s). close() returns at once; rank 0's
    commit then waits commit_timeout_s, as before."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    cks = _ranks(store)
    g1 = tmp_path / "global_step1"
    try:
        _save(cks[1], g1, 1).wait(60)
        th, raised = _closing(cks[1])
        th.join(TIMEOUT_S / 3)  # it waited for rank 0 up to 60 s, or commit_timeout_s (30 s here)
        assert not th.is_alive()
        assert raised == []
    finally:
        close_all(cks)
    assert latest(str(tmp_path)) is None


def test_a_commit_in_flight_at_close_is_waited_for_not_ended(tmp_path: Path, store: object | None) -> None:
    """Rank 1 commits global_step2 and closes while rank 0 has not committed yet: close() waits for
    that commit, which completes once rank 0 commits."""
    cks = _ranks(store)
    try:
        g2 = _both_saved_step_2(cks, tmp_path)
        mine = cks[1].commit(str(g2), step=2)
        th, raised = _closing(cks[1])
        assert cks[0].commit(str(g2), step=2).wait(20).path == str(g2)
        th.join(60)
        assert not th.is_alive()
        assert raised == []
        assert mine.wait(0).path == str(g2)
    finally:
        close_all(cks)
    assert latest(str(tmp_path)) == str(g2)


def test_a_rank_that_saved_nothing_into_a_group_leaves_it_alone_at_close(tmp_path: Path) -> None:
    """Rank 0 began global_step2; rank 1, which saved nothing into it, closes: no failure record of
    rank 1 is left there (rank 0's commit of it is its own business)."""
    cks = _ranks(None)
    try:
        _commit_step_1(cks, tmp_path)
        g2 = tmp_path / "global_step2"
        _save(cks[0], g2, 2).wait(60)
        cks[1].close()
        assert P.failure_ranks(sorted(p.name for p in (g2 / MARKER_DIR).iterdir())) == {}
    finally:
        close_all(cks)


def test_one_rank_closed_with_a_group_it_did_not_commit_records_nothing(tmp_path: Path) -> None:
    (ck,) = _ranks(None, world=1)
    g = tmp_path / "global_step1"
    _save(ck, g, 1).wait(60)
    ck.close()
    assert not (g / MARKER_DIR).exists()
    assert sorted(p.name for p in g.iterdir()) == ["r0.pt"]


def test_without_a_store_a_rank_closed_without_committing_leaves_no_record_a_later_job_would_take(
        tmp_path: Path) -> None:
    """Without a store, a failure record written at close outlives the job: the next job's first
    attempt at the group took it as its own, and its commit failed on both ranks (a review's
    r5a_close_failure_record_fails_restarted_jobs_commit). close() tells no one there: a restarted
    job commits the group."""
    cks = _ranks(None)
    try:
        g1 = _commit_step_1(cks, tmp_path)
        g2 = tmp_path / "global_step2"
        _save(cks[1], g2, 2).wait(60)  # rank 0 has not begun global_step2 yet
        for ck in reversed(cks):  # rank 1's exit flush after its crash, then the job is torn down
            ck.close()
    finally:
        close_all(cks)
    assert latest(str(tmp_path)) == str(g1)
    again = _ranks(None)  # the restarted job saves and commits global_step2
    try:
        for ck in again:
            _save(ck, g2, 2).wait(60)
        for h in [ck.commit(str(g2), step=2) for ck in again]:
            assert h.wait(20).path == str(g2)
    finally:
        close_all(again)
    assert latest(str(tmp_path)) == str(g2)


def test_a_signal_exit_while_the_commit_is_logged_still_ends_the_attempt_at_close(tmp_path: Path) -> None:
    """A sink's SystemExit (a SIGTERM handler's sys.exit on the main thread) while rank 1's commit
    logs ``committing``: the attempt was neither open nor running, so close() did not end it and
    rank 0 waited commit_timeout_s. It stays open for close()."""

    class SigtermInside:
        def emit(self, ev) -> None:  # noqa: ANN001
            if ev.name == "committing" and ev.path.endswith("global_step2"):
                raise SystemExit(143)

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    cks = [fastckpt.Checkpointer(rank=r, world_size=2, store=store, io_threads=1, overhead_budget=0.99,
                                 commit_timeout_s=TIMEOUT_S, sinks=(SigtermInside(),) if r == 1 else ())
           for r in range(2)]
    try:
        g2 = _both_saved_step_2(cks, tmp_path)
        waiting = cks[0].commit(str(g2), step=2)
        with pytest.raises(SystemExit):
            cks[1].commit(str(g2), step=2)
        cks[1].close()  # its exit flush
        with pytest.raises(CheckpointWriteError, match=r"rank 1 closed its Checkpointer without committing"):
            waiting.wait(20)  # not CommitTimeoutError after commit_timeout_s
    finally:
        close_all(cks)
