"""Without a store, a rank whose save into a group failed ends the commit for the ranks that
wait on it (with a store: tests/unit/test_commit_store.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fastckpt
from fastckpt.commit import protocol as P
from fastckpt.errors import CheckpointWriteError
from fastckpt.eventlog import error_type
from fastckpt.events import Event
from fastckpt.io.atomic import final_path
from fastckpt.testing import Fault, FaultyOps
from tests.helpers import close_all, expect_aborted_by_rank_1, latest, place


def _state(v: int) -> dict:
    return {"w": torch.arange(256, dtype=torch.int64) + v, "v": v}


def _three_ranks_after_step_1(tmp_path: Path, events: list[Event] | None = None
                              ) -> tuple[list, FaultyOps, threading.Event]:
    """Three ranks without a store (commit timeout 600 s) that committed global_step1; rank 1's
    FaultyOps; an event set once rank 2 wrote its marker of global_step2 (it polls for the
    manifest next). ``events``: receives every rank's events."""
    ops1 = FaultyOps()
    waiting = threading.Event()
    ops2 = FaultyOps(on_call=lambda op, path: waiting.set() if op == "replace"
                     and (final_path(path) or "").endswith(f"global_step2/{P.marker_rel(2)}") else None)
    sinks = (SimpleNamespace(emit=events.append),) if events is not None else ()
    cks = [fastckpt.Checkpointer(rank=r, world_size=3, io_threads=1, overhead_budget=0.99, commit_timeout_s=600,
                                 ops={1: ops1, 2: ops2}.get(r), sinks=sinks) for r in range(3)]
    g1 = tmp_path / "global_step1"
    try:
        for ck in cks:
            ck.save(_state(1), str(g1 / f"r{ck.rank}.pt"), group=str(g1))
        for h in [ck.commit(str(g1)) for ck in cks]:
            h.wait(60)
    except BaseException:
        close_all(cks)
        raise
    return cks, ops1, waiting


def _rank_1_fails_while_0_and_2_wait(cks: list, ops1: FaultyOps, waiting: threading.Event, g2: Path) -> None:
    """Ranks 0 and 2 save step 2 and wait in their commits; then rank 1's save of it fails
    (ENOSPC on its file): both commits end, naming rank 1's error (``expect_aborted_by_rank_1``)."""
    handles = []
    for r in (0, 2):
        cks[r].save(_state(2), str(g2 / f"r{r}.pt"), group=str(g2))
        handles.append(cks[r].commit(str(g2)))
    assert waiting.wait(60)
    ops1.inject(Fault("pwrite", 28, path_contains="r1.pt"))
    cks[1].save(_state(2), str(g2 / "r1.pt"), group=str(g2))
    expect_aborted_by_rank_1(cks[1], handles, str(g2))


def test_a_failed_save_ends_the_commit_on_the_waiting_ranks_without_a_store(tmp_path: Path) -> None:
    """Rank 1's save fails while ranks 0 and 2 already wait in their commits (no store: marker
    files). Rank 1 leaves a failure record for rank 0's attempt; rank 0 ends the attempt on it
    and records the outcome, which rank 2 is polling for. Neither waits commit_timeout_s (600 s
    here): each raises within the 60 s the test gives it, naming rank 1's error."""
    cks, ops1, waiting = _three_ranks_after_step_1(tmp_path)
    g1, g2 = tmp_path / "global_step1", tmp_path / "global_step2"
    try:
        _rank_1_fails_while_0_and_2_wait(cks, ops1, waiting, g2)
    finally:
        close_all(cks)
    assert latest(str(tmp_path)) == str(g1)
    assert not (g2 / P.GROUP_MANIFEST).exists()
    assert torch.equal(fastckpt.load(str(g1 / "r1.pt"))["w"], _state(1)["w"])


def test_a_commit_a_failed_save_ended_is_one_failure_event_on_each_rank(tmp_path: Path) -> None:
    """Ranks 0 and 2, whose commit rank 1's failed save ended, each emit one failed group
    ``commit`` event, so fastckpt_failures_total and ``fastckpt report`` count their failed
    commits (before, a failed group commit emitted nothing). Rank 1 emits none for the group:
    its save's own failed event counts that failure, once."""
    events: list[Event] = []
    cks, ops1, waiting = _three_ranks_after_step_1(tmp_path, events)
    g2 = tmp_path / "global_step2"
    try:
        _rank_1_fails_while_0_and_2_wait(cks, ops1, waiting, g2)
    finally:
        close_all(cks)
    failed = sorted((e.rank, e.name, e.detail, e.path, error_type(e.error)) for e in events if e.error is not None)
    assert failed == [(0, "commit", "group", str(g2), "CheckpointWriteError"),
                      (1, "write", None, str(g2 / "r1.pt"), "CheckpointWriteError"),
                      (2, "commit", "group", str(g2), "CheckpointWriteError")]


def test_a_save_that_failed_before_rank_0_began_ends_the_attempt_rank_0_begins(tmp_path: Path) -> None:
    """Rank 1's save fails before rank 0 has started the attempt (rank 0 has not saved into the
    group yet), so no attempt id exists for its failure record: it records the id attempt.json
    held (none, in a new group). Rank 0's attempt replaces exactly that one, so it ends on the
    record, and rank 2, which began before any attempt too, reads the outcome as its own. Before,
    both waited commit_timeout_s (600 s here)."""
    cks, ops1, waiting = _three_ranks_after_step_1(tmp_path)
    g1, g2 = tmp_path / "global_step1", tmp_path / "global_step2"
    try:
        ops1.inject(Fault("pwrite", 28, path_contains="r1.pt"))  # ENOSPC on rank 1's file of step 2
        cks[1].save(_state(2), str(g2 / "r1.pt"), group=str(g2))
        with pytest.raises(CheckpointWriteError, match="No space left"):
            cks[1].commit(str(g2)).wait(60)
        assert not (g2 / P.ATTEMPT).exists()  # rank 0 has not begun: the record names no attempt
        records = P.failure_ranks(sorted(p.name for p in (g2 / P.MARKER_DIR).iterdir()))
        assert records == {1: f"{P.MARKER_DIR}/failed-00001.json"}
        cks[2].save(_state(2), str(g2 / "r2.pt"), group=str(g2))
        late = cks[2].commit(str(g2))
        assert waiting.wait(60)
        cks[0].save(_state(2), str(g2 / "r0.pt"), group=str(g2))
        for h in (cks[0].commit(str(g2)), late):
            with pytest.raises(CheckpointWriteError, match=r"failed on another rank \(rank 1: .*No space left"):
                h.wait(60)
    finally:
        close_all(cks)
    assert latest(str(tmp_path)) == str(g1)
    assert not (g2 / P.GROUP_MANIFEST).exists()


@pytest.mark.parametrize(("attempt", "seen"), [("an-earlier-attempt", None), (None, "an-older-attempt")])
def test_a_failure_record_of_an_earlier_attempt_does_not_end_the_next(tmp_path: Path, attempt: str | None,
                                                                      seen: str | None) -> None:
    """The group is saved again after an attempt failed on rank 1: its failure record names
    the old attempt (or, written before any attempt ran, the attempt then recorded, which is
    not the one the new attempt replaces), so the new one commits."""
    g = tmp_path / "global_step1"
    cks = [fastckpt.Checkpointer(rank=r, world_size=2, overhead_budget=0.99, commit_timeout_s=60) for r in range(2)]
    try:
        P.write_failure(place(str(g)), 1, attempt, "OSError: [Errno 28] No space left on device", seen=seen)
        for ck in cks:
            ck.save(_state(3), str(g / f"r{ck.rank}.pt"), group=str(g))
        for h in [ck.commit(str(g)) for ck in cks]:
            h.wait(60)
    finally:
        for ck in cks:
            ck.close()
    assert latest(str(tmp_path)) == str(g)
    assert torch.equal(fastckpt.load(str(g / "r1.pt"))["w"], _state(3)["w"])


def test_a_rank_that_commits_after_rank_0_ended_the_attempt_fails_too(tmp_path: Path) -> None:
    """Rank 2 began (saved) while rank 0's attempt ran, but reaches its commit only after rank 0
    ended that attempt on rank 1's failure: it reads the outcome and fails at once, instead of
    waiting commit_timeout_s for an attempt that is over."""
    ops1 = FaultyOps()
    cks = [fastckpt.Checkpointer(rank=r, world_size=3, io_threads=1, overhead_budget=0.99, commit_timeout_s=600,
                                 ops=ops1 if r == 1 else None) for r in range(3)]
    g = tmp_path / "global_step1"
    try:
        for r in (0, 2):
            cks[r].save(_state(1), str(g / f"r{r}.pt"), group=str(g)).wait(60)
        first = cks[0].commit(str(g))
        ops1.inject(Fault("pwrite", 28, path_contains="r1.pt"))
        cks[1].save(_state(1), str(g / "r1.pt"), group=str(g))
        expect_aborted_by_rank_1(cks[1], [first], str(g))  # rank 0 ended the attempt
        late = cks[2].commit(str(g))
        with pytest.raises(CheckpointWriteError, match=r"failed on another rank \(rank 1: .*No space left"):
            late.wait(60)
    finally:
        close_all(cks)
    assert latest(str(tmp_path)) is None


def _both_ranks_save(g: Path, value: int) -> None:
    """A job of two ranks (Checkpointers made now, closed after) saves ``g`` and commits it."""
    cks = [fastckpt.Checkpointer(rank=r, world_size=2, overhead_budget=0.99, commit_timeout_s=60) for r in range(2)]
    try:
        for ck in cks:
            ck.save(_state(value), str(g / f"r{ck.rank}.pt"), group=str(g))
        for h in [ck.commit(str(g)) for ck in cks]:
            h.wait(60)
    finally:
        close_all(cks)


def _dead_jobs_record(g: Path, resave: bool) -> Path:
    """A job that died while saving ``g`` (in a new group, or re-saving it published) left rank 1's
    failure record of a save that failed before its rank 0 began (attempt None, seen None: no
    attempt was recorded); returns the directory holding it. Re-saving, a first job publishes
    ``g`` before (its Checkpointers are closed: dead)."""
    if resave:
        _both_ranks_save(g, 1)
    home = place(str(g))
    at = P.staged_place(home, P.read_group_manifest(home)) if resave else home
    P.write_failure(at, 1, None, "CheckpointWriteError: [Errno 28] No space left on device", seen=None)
    return Path(at.url())


@pytest.mark.parametrize("resave", [False, True], ids=["new-group", "resave"])
def test_a_failure_record_a_dead_job_left_does_not_end_the_restarted_jobs_attempt(tmp_path: Path,
                                                                                  resave: bool) -> None:
    """A restarted job saves the group again: its rank 0's first attempt replaces the same id as
    the dead job's would have (none), but the record was written before this rank 0's
    Checkpointer was made, so it is the dead job's and ends nothing: the group commits. Before,
    both ranks' commits failed with the dead job's ENOSPC (tests/integration/test_group_dead_job.py
    runs it with real processes)."""
    g = tmp_path / "global_step2"
    at = _dead_jobs_record(g, resave)
    assert sorted(p.name for p in (at / P.MARKER_DIR).iterdir()) == ["failed-00001.json"]
    _both_ranks_save(g, 3)
    assert latest(str(tmp_path)) == str(g)
    assert torch.equal(fastckpt.load(str(g / "r1.pt"))["w"], _state(3)["w"])


def test_a_failure_record_counts_only_from_rank_0s_checkpointer_on(tmp_path: Path) -> None:
    """The rule itself (``fallback.check_failures``), on a record written before rank 0 began its
    attempt (attempt None, seen what the attempt replaced): it ends the attempt when it was
    written since rank 0's Checkpointer was made (``since``), not when before."""
    from fastckpt.commit import fallback as F

    at = place(str(tmp_path / "g"))
    P.write_failure(at, 1, None, "OSError: [Errno 28] No space left on device", seen="old")
    listing = at.names(P.MARKER_DIR)
    written = P.read_record(at, f"{P.MARKER_DIR}/failed-00001.json")["written_at"]
    F.check_failures(at, "new", "old", listing, since=written + 1.0)  # a dead job's: nothing raised
    F.check_failures(at, "new", "other", listing, since=written - 1.0)  # an earlier attempt's
    with pytest.raises(CheckpointWriteError, match=r"failed on another rank \(rank 1: .*No space left"):
        F.check_failures(at, "new", "old", listing, since=written - 1.0)
    with pytest.raises(CheckpointWriteError, match=r"failed on another rank \(rank 1: .*No space left"):
        F.check_failures(at, "new", "old", listing, since=written)


def test_a_resave_that_failed_before_rank_0_began_names_the_group_not_its_resave_directory(tmp_path: Path) -> None:
    """Re-saving a published group, rank 1's save fails before rank 0 began (its record lies in
    the hidden re-save directory ``.global_step1.fastckpt-next-<digest>``): rank 0's commit ends
    on it, and its error names the group the user committed, not that directory."""
    g = tmp_path / "global_step1"
    ops1 = FaultyOps()
    cks = [fastckpt.Checkpointer(rank=r, world_size=2, io_threads=1, overhead_budget=0.99, commit_timeout_s=600,
                                 ops=ops1 if r == 1 else None) for r in range(2)]
    try:
        for ck in cks:
            ck.save(_state(1), str(g / f"r{ck.rank}.pt"), group=str(g))
        for h in [ck.commit(str(g)) for ck in cks]:
            h.wait(60)
        ops1.inject(Fault("pwrite", 28, path_contains="r1.pt"))
        cks[1].save(_state(2), str(g / "r1.pt"), group=str(g))
        with pytest.raises(CheckpointWriteError, match="No space left"):
            cks[1].commit(str(g)).wait(60)
        cks[0].save(_state(2), str(g / "r0.pt"), group=str(g))
        with pytest.raises(CheckpointWriteError, match=r"failed on another rank \(rank 1: .*No space left") as got:
            cks[0].commit(str(g)).wait(60)
    finally:
        close_all(cks)
    said = str(got.value)  # (rank 1's own error, quoted in it, names the file it wrote there)
    assert said.startswith(f"checkpoint group {g} not committed: its save failed on another rank"), said
    assert latest(str(tmp_path)) == str(g)
    assert torch.equal(fastckpt.load(str(g / "r1.pt"))["w"], _state(1)["w"])
