"""A group file whose save did not happen (it raised, or was skipped) keeps the group from
being committed, on every rank, unless that file is saved again before ``commit``.

Simulated ranks: two Checkpointer(rank=r, world_size=2) in this process, with a real TCPStore
or without one (marker files). Each scenario makes rank 1's file of ``global_step2`` fail, the
way a training loop with ``try/except`` around ``save`` then still calls ``commit`` on every
rank. The group must never be published without that file, every rank's commit must fail
saying why, ``global_step1`` stays the latest, and the next group commits.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.commit import protocol as P
from fastckpt.errors import CheckpointWriteError
from fastckpt.eventlog import error_type
from fastckpt.events import Event
from fastckpt.save import saver as saver_module
from fastckpt.save import staging
from fastckpt.testing import Fault, FaultyOps
from tests.helpers import close_all, latest, place


@pytest.fixture(params=["store", "no store"])
def store(request: pytest.FixtureRequest) -> object | None:
    if request.param == "no store":
        return None
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))


def _state(step: int, rank: int, big: bool = False) -> dict:
    s = {"w": torch.arange(256, dtype=torch.int64) + 1000 * step + rank, "step": step}
    if big:  # needs a larger staging buffer than step 1's
        s["big"] = torch.zeros(1 << 19)  # 2 MiB: more than a buffer's headroom
    return s


def _ranks(store: object | None, ops: FaultyOps | None = None, bad: int = 1,
           **kw: object) -> list[fastckpt.Checkpointer]:
    """Ranks 0 and 1 (``ops`` and ``kw`` for rank ``bad``), commit timeout 60 s: a commit
    that is not ended by rank ``bad``'s failure would wait that long."""
    return [fastckpt.Checkpointer(rank=r, world_size=2, store=store, io_threads=1, overhead_budget=0.99,
                                  commit_timeout_s=60, **({"ops": ops, **kw} if r == bad else {}))
            for r in range(2)]


def _commit(cks: list, group: Path, step: int) -> None:
    for ck in cks:
        ck.save(_state(step, ck.rank), str(group / f"r{ck.rank}.pt"), group=str(group))
    for h in [ck.commit(str(group)) for ck in cks]:
        h.wait(60)


def _files(group: Path) -> list[str] | None:
    m = P.read_group_manifest(place(str(group)))
    return None if m is None else sorted(m["files"])


def _expect_not_committed(cks: list, g2: Path, file_and_error: str, bad: int = 1) -> None:
    """Rank ``bad``'s commit raises at the call, naming its file and the error; the other's
    (called first) fails at once, not after commit_timeout_s, naming rank ``bad`` and the same."""
    h = cks[1 - bad].commit(str(g2))
    with pytest.raises(CheckpointWriteError, match=f"not committed: .*{file_and_error}") as info:
        cks[bad].commit(str(g2))
    assert "the previous checkpoint is intact" in str(info.value)
    with pytest.raises(CheckpointWriteError, match=rf"failed on another rank \(rank {bad}: .*{file_and_error}"):
        h.wait(60)


def _then_intact_and_next_commits(cks: list, tmp_path: Path) -> None:
    g1, g2, g3 = (tmp_path / f"global_step{i}" for i in (1, 2, 3))
    assert _files(g2) is None  # never published without rank 1's file
    assert latest(str(tmp_path)) == str(g1)
    assert torch.equal(fastckpt.load(str(g1 / "r1.pt"))["w"], _state(1, 1)["w"])
    _commit(cks, g3, 3)
    assert _files(g3) == ["r0.pt", "r1.pt"]
    assert latest(str(tmp_path)) == str(g3)


@contextlib.contextmanager
def _failing(where: str, monkeypatch: pytest.MonkeyPatch, ops: FaultyOps) -> Iterator[None]:
    """Make the next save (of the rank with ``ops``) fail on the training thread, ``where``:
    probe     the tier's O_DIRECT probe in the new group's directory (EACCES), before the
              attempt at the group begins
    staging   allocating a larger staging buffer (MemoryError), after it began
    snapshot  the copy into the staging buffer, with the writer already following it
              (overlap_write), after it began
    """
    with monkeypatch.context() as m:
        if where == "probe":
            ops.inject(Fault("makedirs", errno.EACCES, path_contains="global_step2"))
        elif where == "staging":
            def no_memory(capacity: int, pinned: bool) -> object:
                raise MemoryError(f"cannot allocate {capacity} bytes of staging memory")

            m.setattr(staging, "_new_buffer", no_memory)
        else:
            def copy_fails(*args: object, **kw: object) -> object:
                raise RuntimeError("the copy into the staging buffer failed")

            m.setattr(saver_module, "snapshot", copy_fails)
        yield
    if where == "probe":
        ops.assert_all_reached()


ERRORS = {"probe": (CheckpointWriteError, "Permission denied"), "staging": (MemoryError, "cannot allocate"),
          "snapshot": (RuntimeError, "copy into the staging buffer failed")}


@pytest.mark.parametrize("bad", [1, 0])
@pytest.mark.parametrize("where", list(ERRORS))
def test_a_group_file_whose_save_raised_is_not_committed_on_any_rank(tmp_path: Path, store: object | None,
                                                                     where: str, bad: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, rank ``bad``'s commit found no handle for its file (the save raised before it had
    one) and committed the group without it: rank 0 published a manifest lacking it."""
    ops = FaultyOps()
    cks = _ranks(store, ops, bad, overlap_write=where == "snapshot")
    g1, g2 = tmp_path / "global_step1", tmp_path / "global_step2"
    try:
        _commit(cks, g1, 1)
        cks[1 - bad].save(_state(2, 1 - bad), str(g2 / f"r{1 - bad}.pt"), group=str(g2))
        kind, message = ERRORS[where]
        with _failing(where, monkeypatch, ops), pytest.raises(kind, match=message):
            cks[bad].save(_state(2, bad, big=True), str(g2 / f"r{bad}.pt"), group=str(g2))
        _expect_not_committed(cks, g2, rf"r{bad}\.pt .*{message}", bad)
        _then_intact_and_next_commits(cks, tmp_path)
    finally:
        close_all(cks)


@pytest.mark.parametrize("where", list(ERRORS))
def test_a_file_saved_again_after_its_save_raised_commits_the_group(tmp_path: Path, store: object | None,
                                                                    where: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The mark of a failed save is cleared by a save of the same path that succeeds in the same
    attempt: the group commits with the good file. (Passed before the fix too: it guards that
    the marks do not block a group whose file was saved again.)"""
    ops1 = FaultyOps()
    cks = _ranks(store, ops1, overlap_write=where == "snapshot")
    g1, g2 = tmp_path / "global_step1", tmp_path / "global_step2"
    try:
        _commit(cks, g1, 1)
        cks[0].save(_state(2, 0), str(g2 / "r0.pt"), group=str(g2))
        kind, message = ERRORS[where]
        with _failing(where, monkeypatch, ops1), pytest.raises(kind, match=message):
            cks[1].save(_state(2, 1, big=True), str(g2 / "r1.pt"), group=str(g2))
        cks[1].save(_state(2, 1, big=True), str(g2 / "r1.pt"), group=str(g2))  # the retry
        for h in [ck.commit(str(g2)) for ck in cks]:
            h.wait(60)
        assert _files(g2) == ["r0.pt", "r1.pt"]
        assert torch.equal(fastckpt.load(str(g2 / "r1.pt"))["big"], _state(2, 1, big=True)["big"])
    finally:
        close_all(cks)


def test_another_file_saved_does_not_clear_the_mark(tmp_path: Path, store: object | None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a save of the same path clears a failed save's mark: after rank 1's ``r1.pt``
    failed, its ``r1-extra.pt`` succeeds, and the group is still not committed."""
    cks = _ranks(store)
    g1, g2 = tmp_path / "global_step1", tmp_path / "global_step2"
    try:
        _commit(cks, g1, 1)
        cks[0].save(_state(2, 0), str(g2 / "r0.pt"), group=str(g2))
        with _failing("staging", monkeypatch, FaultyOps()), pytest.raises(MemoryError):
            cks[1].save(_state(2, 1, big=True), str(g2 / "r1.pt"), group=str(g2))
        cks[1].save(_state(2, 1), str(g2 / "r1-extra.pt"), group=str(g2))
        _expect_not_committed(cks, g2, r"r1\.pt \(MemoryError: cannot allocate")
        _then_intact_and_next_commits(cks, tmp_path)
    finally:
        close_all(cks)


def test_a_failed_save_in_the_first_group_ends_its_commit_on_every_rank(tmp_path: Path, store: object | None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Checkpointers' first group, so (with a store) the session is not agreed yet when rank
    1's commit ends the attempt; then the next group commits."""
    cks = _ranks(store)
    g2, g3 = tmp_path / "global_step2", tmp_path / "global_step3"
    try:
        cks[0].save(_state(2, 0), str(g2 / "r0.pt"), group=str(g2))
        with _failing("staging", monkeypatch, FaultyOps()), pytest.raises(MemoryError):
            cks[1].save(_state(2, 1), str(g2 / "r1.pt"), group=str(g2))
        _expect_not_committed(cks, g2, r"r1\.pt \(MemoryError: cannot allocate")
        assert _files(g2) is None
        assert latest(str(tmp_path)) is None
        _commit(cks, g3, 3)
        assert _files(g3) == ["r0.pt", "r1.pt"]
    finally:
        close_all(cks)


def test_a_save_that_raised_an_earlier_failure_leaves_its_group_uncommitted(tmp_path: Path,
                                                                           store: object | None) -> None:
    """A single-file save fails in the background; the next save, into the group, raises that
    failure (the sync point) and so never saves its own file. Before, the group's commit then
    found nothing unseen and published it without that file."""
    ops1 = FaultyOps()
    cks = _ranks(store, ops1)
    g1, g2 = tmp_path / "global_step1", tmp_path / "global_step2"
    try:
        _commit(cks, g1, 1)
        ops1.inject(Fault("pwrite", errno.ENOSPC, path_contains="extra.pt"))
        h = cks[1].save(_state(2, 1), str(tmp_path / "extra.pt"))
        with pytest.raises(CheckpointWriteError, match="No space left"):
            h.result(60)  # ended; still unseen by the user (result() is what fastckpt's own steps call)
        cks[0].save(_state(2, 0), str(g2 / "r0.pt"), group=str(g2))
        with pytest.raises(CheckpointWriteError, match="No space left"):
            cks[1].save(_state(2, 1), str(g2 / "r1.pt"), group=str(g2))  # raises extra.pt's failure
        _expect_not_committed(cks, g2, r"r1\.pt .*No space left")
        _then_intact_and_next_commits(cks, tmp_path)
    finally:
        close_all(cks)


def test_a_file_whose_write_failed_and_is_saved_again_commits_the_group(tmp_path: Path,
                                                                        store: object | None) -> None:
    """A background failure seen by the user (``handle.wait()``), then the same path saved
    again in the same attempt: the retry's file counts. Before, the failed handle ended the
    commit on every rank although the group's file was there."""
    ops1 = FaultyOps()
    cks = _ranks(store, ops1)
    g1, g2 = tmp_path / "global_step1", tmp_path / "global_step2"
    try:
        _commit(cks, g1, 1)
        ops1.inject(Fault("pwrite", errno.ENOSPC, path_contains="global_step2/r1.pt"))
        cks[0].save(_state(2, 0), str(g2 / "r0.pt"), group=str(g2))
        with pytest.raises(CheckpointWriteError, match="No space left"):
            cks[1].save(_state(2, 1), str(g2 / "r1.pt"), group=str(g2)).wait(60)
        cks[1].save(_state(2, 1), str(g2 / "r1.pt"), group=str(g2))
        for h in [ck.commit(str(g2)) for ck in cks]:
            h.wait(60)
        assert _files(g2) == ["r0.pt", "r1.pt"]
        assert torch.equal(fastckpt.load(str(g2 / "r1.pt"))["w"], _state(2, 1)["w"])
    finally:
        close_all(cks)


@pytest.mark.parametrize("again", [False, True])
def test_a_skipped_group_file_ends_the_commit_on_every_rank(tmp_path: Path, store: object | None,
                                                            again: bool) -> None:
    """when_busy='skip' skips rank 1's file (its one staging buffer still holds step 1's, whose
    write is held). Before, rank 1's commit raised but told no one: rank 0 waited
    commit_timeout_s. Saved again once the buffer is free, the file counts (``again``)."""
    ops1 = FaultyOps()
    gate = ops1.gate("pwrite", path_contains="global_step1/r1.pt")
    cks = _ranks(store, ops1, when_busy="skip", staging_buffers=1)
    g1, g2 = tmp_path / "global_step1", tmp_path / "global_step2"
    try:
        for ck in cks:
            ck.save(_state(1, ck.rank), str(g1 / f"r{ck.rank}.pt"), group=str(g1))
        first = [ck.commit(str(g1)) for ck in cks]
        assert gate.wait_entered()
        cks[0].save(_state(2, 0), str(g2 / "r0.pt"), group=str(g2))
        with pytest.warns(UserWarning, match="skipped save"):
            assert cks[1].save(_state(2, 1), str(g2 / "r1.pt"), group=str(g2)).wait().skipped
        gate.open()
        for h in first:
            h.wait(60)
        if again:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # not skipped this time
                cks[1].save(_state(2, 1), str(g2 / "r1.pt"), group=str(g2))
            for h in [ck.commit(str(g2)) for ck in cks]:
                h.wait(60)
            assert _files(g2) == ["r0.pt", "r1.pt"]
            return
        _expect_not_committed(cks, g2, r"r1\.pt .*skipped")
        _then_intact_and_next_commits(cks, tmp_path)
    finally:
        close_all(cks)


def test_a_commit_ended_by_an_unsaved_file_is_one_failure_event_on_each_rank(tmp_path: Path,
                                                                            store: object | None) -> None:
    """Rank 1's commit refuses at the call (its file was never saved: ``unsaved``) and ends rank
    0's: each rank emits one failed group ``commit`` event, so fastckpt_failures_total and
    ``fastckpt report`` count both failed commits. Before, neither rank emitted one, and the
    unsaved file left no event at all."""
    events: list[Event] = []
    cks = [fastckpt.Checkpointer(rank=r, world_size=2, store=store, io_threads=1, overhead_budget=0.99,
                                 commit_timeout_s=60, sinks=(SimpleNamespace(emit=events.append),)) for r in range(2)]
    g = tmp_path / "global_step1"
    try:
        cks[0].save(_state(1, 0), str(g / "r0.pt"), group=str(g))
        cks[1].unsaved(str(g / "r1.pt"), str(g), RuntimeError("the copy of the state failed"))
        _expect_not_committed(cks, g, r"r1\.pt .*the copy of the state failed")
    finally:
        close_all(cks)
    failed = sorted((e.rank, e.name, e.detail, e.path, error_type(e.error)) for e in events if e.error is not None)
    assert failed == [(r, "commit", "group", str(g), "CheckpointWriteError") for r in (0, 1)]


def test_an_earlier_failure_raised_at_the_commit_of_a_rank_that_saved_nothing_ends_it(tmp_path: Path,
                                                                                       store: object | None) -> None:
    """Rank 1 saves nothing into the group (a rank that only commits); an earlier single file's
    failure, unseen, is raised at its ``commit``. Before, no rank was told: rank 0 waited
    commit_timeout_s, and with a store rank 1's count of attempts at the group fell one behind
    rank 0's, so every later commit of the group failed on every rank."""
    ops1 = FaultyOps()
    cks = _ranks(store, ops1)
    g = tmp_path / "global_step2"
    try:
        ops1.inject(Fault("pwrite", errno.ENOSPC, path_contains="extra.pt"))
        h = cks[1].save(_state(2, 1), str(tmp_path / "extra.pt"))
        with pytest.raises(CheckpointWriteError, match="No space left"):
            h.result(60)  # ended; still unseen by the user
        cks[0].save(_state(2, 0), str(g / "r0.pt"), group=str(g))
        pending = cks[0].commit(str(g))
        with pytest.raises(CheckpointWriteError, match="No space left"):
            cks[1].commit(str(g))
        with pytest.raises(CheckpointWriteError, match=r"failed on another rank \(rank 1: .*No space left"):
            pending.wait(60)  # at once, not after commit_timeout_s
        assert _files(g) is None
        cks[0].save(_state(2, 0), str(g / "r0.pt"), group=str(g))
        for h in [ck.commit(str(g)) for ck in cks]:
            h.wait(60)
        assert _files(g) == ["r0.pt"]
    finally:
        close_all(cks)
