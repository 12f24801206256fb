"""Without a store, a rank that reaches its commit after rank 0 moved on to a newer attempt at
the group (rank 0 gave up on the rank's attempt, or rank 0 restarted and saved the group again)
must not join the newer attempt with the files of its old one: it fails, naming the group, and
the newer attempt never publishes those files (``commit/fallback.py``: ``own_attempt``).

The ranks are simulated in one process (one Checkpointer each, no store); a gate on rank 1's
fsync holds its save until rank 0 has moved on. One test SIGKILLs a real rank-0 process.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.commit import protocol as P
from fastckpt.errors import CheckpointWriteError, CommitTimeoutError
from fastckpt.testing import Fault, FaultyOps, Gate, as_if_killed
from tests.helpers import close_all, latest, place

LEFT_BEHIND = r"checkpoint group .*/G not committed on rank 1: rank 0 moved on to a newer attempt"


def _ck(rank: int, **kw: object) -> fastckpt.Checkpointer:
    kw.setdefault("commit_timeout_s", 60)
    return fastckpt.Checkpointer(rank=rank, world_size=2, overhead_budget=0.99, io_threads=1, **kw)


def _state(version: int, rank: int) -> dict:
    return {"w": torch.arange(64, dtype=torch.int64) * version + rank, "version": version, "rank": rank}


def _save(ck: fastckpt.Checkpointer, g: Path, version: int) -> fastckpt.SaveHandle:
    return ck.save(_state(version, ck.rank), str(g / f"rank{ck.rank}.pt"), group=str(g))


def _gated_rank_1(**kw: object) -> tuple[fastckpt.Checkpointer, Gate]:
    ops = FaultyOps()
    return _ck(1, ops=ops, **kw), ops.gate("fsync", path_contains="rank1.pt")


def _published_versions(g: Path) -> list[int]:
    m = P.read_group_manifest(place(str(g)))
    assert m is not None
    assert sorted(m["files"]) == ["rank0.pt", "rank1.pt"]
    return [fastckpt.load(str(g / f"rank{r}.pt"))["version"] for r in (0, 1)]


def _records(g: Path) -> object:
    """Where the attempts at ``g`` keep their records: beside it while it is re-saved."""
    home = place(str(g))
    staged = P.staged_place(home, P.read_group_manifest(home))
    return staged if staged.get(P.ATTEMPT) is not None else place(str(g))


def _left_behind(g: Path, ck1: fastckpt.Checkpointer, gate: Gate, pending: fastckpt.SaveHandle) -> None:
    """Rank 1's held save completes after rank 0 began a newer attempt: its commit fails at
    once, and its marker does not take the newer attempt's id."""
    newer = P.attempt_id(_records(g))
    gate.open()
    with pytest.raises(CommitTimeoutError, match=LEFT_BEHIND) as info:
        pending.wait(60)
    assert "save the group again" in str(info.value)
    assert ".fastckpt-next" not in str(info.value)  # names the group, not where its attempt is staged
    assert newer is not None
    assert P.read_markers(_records(g)).get(1, {}).get("attempt") != newer


@pytest.mark.parametrize("published", [False, True], ids=["new group", "re-saved group"])
def test_a_rank_left_behind_by_a_timed_out_attempt_does_not_join_the_next(tmp_path: Path, published: bool) -> None:
    """Rank 0's commit times out waiting for a slow rank 1, and rank 0 saves the group again.
    Rank 1's old files then reach its commit: they are not published with rank 0's new ones; the
    new attempt waits for rank 1's new save, and publishes that. A re-saved published group
    (its attempts beside it, in ``.G.fastckpt-next``) stays the published one meanwhile."""
    g = tmp_path / "G"
    ck0 = _ck(0, commit_timeout_s=0.3)
    cks = [ck0]
    try:
        if published:
            first = _ck(1)
            cks.append(first)
            for ck in (ck0, first):
                _save(ck, g, 0).wait(60)
            for h in [first.commit(str(g)), ck0.commit(str(g))]:
                h.wait(60)
        ck1, gate = _gated_rank_1()
        cks.append(ck1)
        _save(ck0, g, 1).wait(60)
        _save(ck1, g, 1)
        pending = ck1.commit(str(g))
        assert gate.wait_entered()
        with pytest.raises(CommitTimeoutError, match=r"ranks \[1\] of 2"):
            ck0.commit(str(g)).wait(60)
        _save(ck0, g, 2).wait(60)  # the same rank 0 (process) starts a newer attempt
        _left_behind(g, ck1, gate, pending)
        with pytest.raises(CommitTimeoutError, match=r"ranks \[1\] of 2"):  # nothing of rank 1's is in it
            ck0.commit(str(g)).wait(60)
        if published:
            assert _published_versions(g) == [0, 0]
        else:
            assert P.read_group_manifest(place(str(g))) is None
        for ck in (ck0, ck1):  # both ranks save again: the next attempt publishes both new files
            _save(ck, g, 3)
        for h in [ck1.commit(str(g)), ck0.commit(str(g))]:
            h.wait(60)
    finally:
        close_all(cks)
    assert _published_versions(g) == [3, 3]
    assert latest(str(tmp_path)) == str(g)


def test_the_newer_attempt_publishes_the_late_ranks_next_save(tmp_path: Path) -> None:
    """Rank 0 (a restarted process: a new Checkpointer) saves the group again while rank 1's old
    save is still in flight; rank 1 fails, saves again, and the newer attempt, still waiting,
    publishes rank 1's new file with rank 0's."""
    g = tmp_path / "G"
    ck1, gate = _gated_rank_1()
    old0 = _ck(0)
    cks = [ck1]
    try:
        _save(old0, g, 1).wait(60)
        _save(ck1, g, 1)
        pending = ck1.commit(str(g))
        assert gate.wait_entered()
        # old0 crashed: never closed (close() would end its attempt on every rank), its attempt stays
        # recorded as running
        as_if_killed(old0)
        new0 = _ck(0)
        cks.append(new0)
        _save(new0, g, 2).wait(60)
        _left_behind(g, ck1, gate, pending)
        waiting = new0.commit(str(g))
        _save(ck1, g, 2)
        ck1.commit(str(g)).wait(60)
        waiting.wait(60)
    finally:
        close_all([*cks, old0])
    assert _published_versions(g) == [2, 2]


def test_a_rank_made_after_rank_0_began_is_still_left_behind_by_it(tmp_path: Path) -> None:
    """Rank 1's Checkpointer is made after rank 0 began its attempt (a slow start), but rank 1
    began saving while that attempt ran: rank 0, the same process, then gave up on it. Rank 1
    is left behind as well."""
    g = tmp_path / "G"
    ck0 = _ck(0, commit_timeout_s=0.3)
    cks = [ck0]
    try:
        _save(ck0, g, 1).wait(60)
        ck1, gate = _gated_rank_1()
        cks.append(ck1)
        _save(ck1, g, 1)
        pending = ck1.commit(str(g))
        assert gate.wait_entered()
        with pytest.raises(CommitTimeoutError, match=r"ranks \[1\] of 2"):
            ck0.commit(str(g)).wait(60)
        _save(ck0, g, 2).wait(60)
        _left_behind(g, ck1, gate, pending)
    finally:
        close_all(cks)
    assert P.read_group_manifest(place(str(g))) is None


def test_a_rank_of_a_new_job_joins_rank_0_after_a_crashed_attempt(tmp_path: Path) -> None:
    """The legitimate case the rule must keep: a job died while its rank 0's attempt ran (the
    record says it runs still). The next job's rank 1 begins before its rank 0: that record is
    not its attempt, and it joins the attempt its rank 0 starts next."""
    g = tmp_path / "G"
    dead = [_ck(r) for r in (0, 1)]
    try:
        _save(dead[0], g, 1).wait(60)
    finally:
        close_all(dead)
    cks = [_ck(r) for r in (0, 1)]
    try:
        _save(cks[1], g, 2).wait(60)  # before rank 0 began: attempt.json still names the dead attempt
        _save(cks[0], g, 2).wait(60)
        for h in [ck.commit(str(g)) for ck in cks]:
            h.wait(60)
    finally:
        close_all(cks)
    assert _published_versions(g) == [2, 2]


def test_a_rank_whose_save_failed_joins_rank_0s_retry(tmp_path: Path) -> None:
    """Rank 1's save into rank 0's attempt fails, and rank 1 saves again before rank 0 has even
    noticed (the attempt is still recorded as running). That attempt is over for rank 1: its new
    save is for rank 0's retry, which it joins, and which publishes."""
    g = tmp_path / "G"
    ops1 = FaultyOps()
    ck0, ck1 = _ck(0), _ck(1, ops=ops1)
    cks = [ck0, ck1]
    try:
        _save(ck0, g, 1).wait(60)
        ops1.inject(Fault("pwrite", errno.ENOSPC, path_contains="rank1.pt"))
        _save(ck1, g, 1)
        with pytest.raises(CheckpointWriteError, match="No space left"):
            ck1.commit(str(g)).wait(60)
        _save(ck1, g, 2).wait(60)  # attempt.json still names the attempt rank 1 failed
        with pytest.raises(CheckpointWriteError, match=r"failed on another rank \(rank 1: .*No space left"):
            ck0.commit(str(g)).wait(60)
        _save(ck0, g, 2).wait(60)
        for h in [ck1.commit(str(g)), ck0.commit(str(g))]:
            h.wait(60)
    finally:
        close_all(cks)
    ops1.assert_all_reached()
    assert _published_versions(g) == [2, 2]


# --------------------------------------------------------------------------- a real SIGKILL
def _rank_0(g: str, version: int, commit: bool, conn: Connection) -> None:
    """A rank-0 process: saves its file of ``version`` into ``g``, says so, then commits (and
    reports how that ended) or waits to be killed."""
    ck = _ck(0)
    _save(ck, Path(g), version).wait(60)
    conn.send("saved")
    if not commit:
        conn.recv()  # killed while it waits here, its attempt recorded as running
        return
    try:
        ck.commit(g).wait(60)
        conn.send("published")
    except Exception as exc:  # noqa: BLE001 (reported to the test)
        conn.send(f"{type(exc).__name__}: {exc}")
    ck.close()


def _start_rank_0(ctx: mp.context.BaseContext, g: Path, version: int, commit: bool) -> tuple:
    recv, send = ctx.Pipe()
    p = ctx.Process(target=_rank_0, args=(str(g), version, commit, send), daemon=True)
    p.start()
    assert recv.poll(120), "the rank-0 process did not save"
    assert recv.recv() == "saved"
    return p, recv


def test_a_late_rank_does_not_join_a_restarted_rank_0s_attempt(tmp_path: Path) -> None:
    """Rank 0's process is SIGKILLed while rank 1's save is in flight; a new rank-0 process saves
    the group again with other contents. Rank 1's old file must not be published with it."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "fastckpt"])
    g = tmp_path / "G"
    ck1, gate = _gated_rank_1()
    procs = []
    try:
        old0, _ = _start_rank_0(ctx, g, 1, commit=False)
        procs.append(old0)
        _save(ck1, g, 1)
        pending = ck1.commit(str(g))
        assert gate.wait_entered()
        old0.kill()
        old0.join(60)
        new0, said = _start_rank_0(ctx, g, 2, commit=True)
        procs.append(new0)
        _left_behind(g, ck1, gate, pending)
        assert not said.poll(0)  # still waiting for rank 1: the stale marker does not count
        _save(ck1, g, 2)
        ck1.commit(str(g)).wait(60)
        assert said.poll(60)
        assert said.recv() == "published"
    finally:
        gate.open()
        close_all([ck1])
        for p in procs:
            p.kill()
            p.join(60)
    assert _published_versions(g) == [2, 2]
