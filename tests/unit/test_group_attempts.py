"""Attempts at a group, removal during a commit, and the burst-buffer copy of a group
(issue #9, items 1, 7 and 11), with simulated ranks in one process: with a shared TCPStore and
without one (the storage-marker fallback)."""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.commit import discovery
from fastckpt.commit import protocol as P
from fastckpt.errors import (
    CheckpointWriteError,
    CommitTimeoutError,
    CorruptCheckpointError,
    GroupRemovedError,
    IncompleteCheckpointError,
)
from fastckpt.eventlog import error_type
from fastckpt.events import Event
from fastckpt.storage.homes import Homes
from fastckpt.testing import Fault, FaultyOps, as_if_killed
from tests.helpers import latest, place


@pytest.fixture(params=["store", "no store"])
def store(request: pytest.FixtureRequest) -> Iterator[object | None]:
    yield dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60)) \
        if request.param == "store" else None


def _ck(rank: int, store: object | None, world: int = 2, **kw: object) -> fastckpt.Checkpointer:
    kw.setdefault("commit_timeout_s", 60)
    return fastckpt.Checkpointer(rank=rank, world_size=world, store=store, overhead_budget=0.99, **kw)


def _state(version: int, rank: int) -> dict:
    return {"w": torch.arange(128, dtype=torch.int64) * version + rank, "version": version, "rank": rank}


def _save_all(cks: list[fastckpt.Checkpointer], g: Path, version: int) -> None:
    """Every rank saves its file of ``version`` into ``g`` and commits; waits for all."""
    for ck in cks:
        ck.save(_state(version, ck.rank), str(g / f"rank{ck.rank}.pt"), group=str(g))
    for h in [ck.commit(str(g), step=version) for ck in cks]:
        h.wait(60)


def _held_poll(g: Path, polling: threading.Event, release: threading.Event) -> FaultyOps:
    """Rank 1's ops: its first poll for ``g``'s manifest once its marker is written sets
    ``polling`` and waits for ``release``."""

    class Held(FaultyOps):
        def read_small(self, path: str) -> bytes | None:
            if path == str(g / P.GROUP_MANIFEST) and (g / ".fastckpt" / "rank-00001.json").exists() \
                    and not polling.is_set():
                polling.set()
                assert release.wait(60)
            return super().read_small(path)

    return Held()


def _removed_while_rank_1_polls(cks: list, tmp_path: Path, g: Path, polling: threading.Event) -> fastckpt.SaveHandle:
    """Both ranks commit step-1; rank 1 saves and commits ``g`` (step 2) alone, and rank 0 removes
    ``g`` once rank 1 polls for its manifest (``polling``, set by ``_held_poll``): rank 1's handle."""
    _save_all(cks, tmp_path / "step-1", 1)
    cks[1].save(_state(2, 1), str(g / "rank1.pt"), group=str(g)).wait(60)
    h = cks[1].commit(str(g), step=2)
    assert polling.wait(60)  # rank 1's marker is written; it waits for the manifest
    cks[0].remove(str(g))
    return h


def _failed_group_commits(events: list[Event]) -> list[tuple[int, str]]:
    """(rank, error type) of each failed group ``commit`` event: what fastckpt_failures_total and
    ``fastckpt report`` count. Checks that no other phase failed."""
    failed = [e for e in events if e.error is not None]
    assert all(e.name == "commit" and e.detail == "group" for e in failed), failed
    return sorted((e.rank, error_type(e.error or "")) for e in failed)


def _close(cks: list[fastckpt.Checkpointer]) -> None:
    for ck in cks:
        ck.close()


def _versions(g: Path) -> list[int]:
    return [fastckpt.load(str(g / f"rank{r}.pt"))["version"] for r in (0, 1)]


# --------------------------------------------------------------------------- item 1
def test_a_dead_attempts_marker_is_never_published(tmp_path: Path) -> None:
    """Without torch.distributed: rank 1's commit timed out and its process died, leaving its
    marker; a fresh rank 0 must not publish a manifest naming rank 1's old file."""
    g = tmp_path / "G"
    old1 = _ck(1, None, commit_timeout_s=0.3)
    old1.save(_state(1, 1), str(g / "rank1.pt"), group=str(g)).wait(60)
    with pytest.raises(CommitTimeoutError):
        old1.commit(str(g)).wait(60)
    old1.close()
    assert sorted(P.read_markers(place(str(g)))) == [1]  # the leftover
    fresh0 = _ck(0, None, commit_timeout_s=0.5)
    try:
        fresh0.save(_state(2, 0), str(g / "rank0.pt"), group=str(g)).wait(60)
        with pytest.raises(CommitTimeoutError, match=r"ranks \[1\] of 2"):
            fresh0.commit(str(g)).wait(60)
    finally:
        fresh0.close()
    assert P.read_group_manifest(place(str(g))) is None
    assert latest(str(tmp_path)) is None


def test_a_restarted_rank_that_rejoins_the_attempt_is_published_with_its_new_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a store: rank 1 wrote its marker for rank 0's attempt and died; restarted, it
    joins the same attempt and saves its file again in place, while rank 0 (slow, alive) has not
    committed yet. Before, rank 0 published the old marker's checksum (its check of the size
    passed, or failed by chance) for the file that now holds the new bytes; now the restarted
    rank's first save deletes its old marker, and rank 0 waits for the new one."""
    from fastckpt.commit import fallback as F

    g = tmp_path / "G"
    rank0, dead1 = _ck(0, None), _ck(1, None)
    polled, check = threading.Event(), F.check_failures

    def checked(*args):  # noqa: ANN002, ANN202
        check(*args)
        polled.set()  # rank 0 has read every marker there once

    monkeypatch.setattr(F, "check_failures", checked)
    try:
        rank0.save(_state(2, 0), str(g / "rank0.pt"), group=str(g)).wait(60)  # rank 0 begins the attempt
        rec = dead1.save(_state(2, 1), str(g / "rank1.pt"), group=str(g)).wait(60)
        P.write_marker(place(str(g)), 1, 2, {"rank1.pt": {"size": rec.bytes, "checksum": rec.checksum}},
                       P.attempt_id(place(str(g))))  # what its commit wrote before it died
        # dead1 died: never closed (close() would end its attempt on every rank) until the end
        as_if_killed(dead1)
        restarted1 = _ck(1, None, commit_timeout_s=5)
        try:
            restarted1.save(_state(3, 1), str(g / "rank1.pt"), group=str(g)).wait(60)
            pending = rank0.commit(str(g), step=2)  # after the re-save, before the restarted rank's commit
            assert polled.wait(60)
            restarted1.commit(str(g), step=2).wait(60)
            pending.wait(60)
        finally:
            restarted1.close()
    finally:
        rank0.close()
        dead1.close()
    assert _versions(g) == [2, 3]
    assert latest(str(tmp_path)) == str(g)


def test_a_published_group_stays_published_until_its_resave_is(tmp_path: Path, store: object | None) -> None:
    g = tmp_path / "G"
    first = [_ck(r, store) for r in (0, 1)]
    _save_all(first, g, 1)
    _close(first)
    (g / "zero_to_fp32.py").write_text("# a file the framework wrote beside its shards\n")
    published = (g / P.GROUP_MANIFEST).read_bytes()
    second = [_ck(r, store) for r in (0, 1)]
    try:
        second[1].save(_state(2, 1), str(g / "rank1.pt"), group=str(g)).wait(60)  # a fresh rank 1 re-saves G
        assert latest(str(tmp_path)) == str(g)
        assert (g / P.GROUP_MANIFEST).read_bytes() == published
        assert _versions(g) == [1, 1]  # the published attempt, whole: nothing of the new one yet
        second[0].save(_state(2, 0), str(g / "rank0.pt"), group=str(g)).wait(60)
        for h in [ck.commit(str(g), step=2) for ck in second]:
            h.wait(60)
    finally:
        _close(second)
    assert latest(str(tmp_path)) == str(g)
    assert _versions(g) == [2, 2]
    m = P.read_group_manifest(place(str(g)))
    assert m["step"] == 2 and sorted(m["files"]) == ["rank0.pt", "rank1.pt"]
    assert (g / "zero_to_fp32.py").read_text().startswith("# a file the framework")
    assert sorted(os.listdir(tmp_path)) == ["G", P.LATEST]  # the old attempt is gone
    for r in (0, 1):
        assert torch.equal(torch.load(g / f"rank{r}.pt", weights_only=True)["w"], _state(2, r)["w"])


def test_a_resave_that_cannot_be_swapped_in_leaves_the_old_group(tmp_path: Path) -> None:
    g = tmp_path / "G"
    first = [_ck(r, None) for r in (0, 1)]
    _save_all(first, g, 1)
    _close(first)
    ops = FaultyOps([Fault("exchange", errno.EINVAL)])  # a file system without RENAME_EXCHANGE
    second = [_ck(0, None, ops=ops), _ck(1, None, commit_timeout_s=5)]
    try:
        for ck in second:
            ck.save(_state(2, ck.rank), str(g / f"rank{ck.rank}.pt"), group=str(g))
        handles = [ck.commit(str(g)) for ck in second]
        with pytest.raises(CheckpointWriteError, match="Invalid argument"):
            handles[0].wait(60)
        with pytest.raises(CommitTimeoutError):
            handles[1].wait(60)
    finally:
        _close(second)
    ops.assert_all_reached()
    assert latest(str(tmp_path)) == str(g)
    assert _versions(g) == [1, 1]
    staged = [n for n in os.listdir(tmp_path) if n.startswith(".G.fastckpt-next")]
    assert staged and (tmp_path / staged[0] / P.GROUP_MANIFEST).exists()  # the new attempt, never swapped in
    (tmp_path / P.LATEST).unlink()  # the scan decides: never the hidden re-save directory, though newer
    assert latest(str(tmp_path)) == str(g)
    assert [f.path for f in discovery.scan(Homes().resolve(str(tmp_path)))] == [str(g)]


def test_a_file_of_another_attempt_never_loads_as_part_of_the_group(tmp_path: Path) -> None:
    g, other = tmp_path / "G", tmp_path / "other" / "G"
    for where, version in ((g, 1), (other, 2)):
        cks = [_ck(r, None) for r in (0, 1)]
        _save_all(cks, where, version)
        _close(cks)
    shutil.copy(other / "rank1.pt", g / "rank1.pt")  # the same name, written by another attempt
    with pytest.raises(IncompleteCheckpointError, match="names another version of it"):
        fastckpt.load(str(g / "rank1.pt"))
    assert fastckpt.load(str(g / "rank0.pt"))["version"] == 1


def test_a_group_file_moved_over_another_never_loads_as_it(tmp_path: Path) -> None:
    """Two files of a group swapped, or a file of an older step copied over a newer one's: each
    verifies whole, but is not what its group published at that path (helper review D2)."""
    old, new = tmp_path / "step-10", tmp_path / "step-20"
    for where, version in ((old, 10), (new, 20)):
        cks = [_ck(r, None) for r in (0, 1)]
        _save_all(cks, where, version)
        _close(cks)
    (new / "backup").mkdir()
    shutil.copy(new / "rank1.pt", new / "backup" / "rank1.pt")  # a path the group names nothing at
    shutil.copytree(new, tmp_path / "universal")  # a copy out of the group (ds_to_universal)
    (tmp_path / "universal" / P.GROUP_MANIFEST).unlink()
    swapped = new / "rank0.pt"
    os.replace(new / "rank1.pt", tmp_path / "r1")
    os.replace(swapped, new / "rank1.pt")
    os.replace(tmp_path / "r1", swapped)
    for f in (swapped, new / "rank1.pt"):
        with pytest.raises(CorruptCheckpointError, match=r"moved or copied here, over the group's own file"):
            fastckpt.load(str(f))
    shutil.copy(old / "rank1.pt", new / "rank1.pt")  # step 10's file over step 20's
    with pytest.raises(CorruptCheckpointError, match=r"written as 'rank1.pt' of group 'step-10'"):
        fastckpt.load(str(new / "rank1.pt"))
    assert fastckpt.load(str(new / "backup" / "rank1.pt"))["version"] == 20  # a verified copy of its bytes
    assert fastckpt.load(str(tmp_path / "universal" / "rank1.pt"))["version"] == 20
    assert fastckpt.load(str(old / "rank1.pt"))["version"] == 10


def test_a_group_file_copied_deeper_than_it_was_written_never_loads_as_another_groups(tmp_path: Path) -> None:
    """step-10's rank1.pt (written at the group's top) copied over step-20's sub/rank1.pt loaded
    silently as step-20's file: only the directory as deep as the file was written, or its
    parent, was asked for a manifest naming it (helper review H1). Every directory above is."""
    old, new = tmp_path / "step-10", tmp_path / "step-20"
    cks = [_ck(r, None) for r in (0, 1)]
    _save_all(cks, old, 10)
    for ck in cks:
        ck.save(_state(20, ck.rank), str(new / f"rank{ck.rank}.pt"), group=str(new))
        ck.save(_state(21, ck.rank), str(new / "sub" / "deeper" / f"rank{ck.rank}.pt"), group=str(new))
    for h in [ck.commit(str(new), step=20) for ck in cks]:
        h.wait(60)
    _close(cks)
    target = new / "sub" / "deeper" / "rank1.pt"
    assert fastckpt.load(str(target))["version"] == 21
    shutil.copy(old / "rank1.pt", target)
    with pytest.raises(CorruptCheckpointError, match=r"written as 'rank1.pt' of group 'step-10'"):
        fastckpt.load(str(target))
    (new / "sub" / "deeper" / "extra.pt").write_bytes((old / "rank1.pt").read_bytes())  # named nothing there
    assert fastckpt.load(str(new / "sub" / "deeper" / "extra.pt"))["version"] == 10  # a verified copy


def test_a_group_copied_whole_under_a_directory_of_its_own_name_loads(tmp_path: Path) -> None:
    """A published group copied to archive/step-20/old/ (a directory of the group's name above the
    copy) was refused as incomplete: the directory of its name above was taken for the group
    instead of the copy's own, published one (helper review H2)."""
    g = tmp_path / "step-20"
    cks = [_ck(r, None) for r in (0, 1)]
    _save_all(cks, g, 20)
    _close(cks)
    copy = tmp_path / "archive" / "step-20" / "old"
    shutil.copytree(g, copy)
    assert [fastckpt.load(str(copy / f"rank{r}.pt"))["version"] for r in (0, 1)] == [20, 20]
    shutil.copy(copy / "rank0.pt", copy / "rank1.pt")  # a file moved over another in the copy is still damage
    with pytest.raises(CorruptCheckpointError, match="moved or copied here"):
        fastckpt.load(str(copy / "rank1.pt"))


# --------------------------------------------------------------------------- item 7
def test_remove_cancels_the_commit_on_every_rank(tmp_path: Path, store: object | None) -> None:
    """Each rank's cancelled commit is reported as a failed one: one group ``commit`` event with
    the GroupRemovedError (before, none: metrics and reports never saw it)."""
    g = tmp_path / "G"
    events: list[Event] = []
    cks = [_ck(r, store, sinks=(SimpleNamespace(emit=events.append),)) for r in (0, 1)]
    try:
        for ck in cks:
            ck.save(_state(1, ck.rank), str(g / f"rank{ck.rank}.pt"), group=str(g)).wait(60)
        t0 = time.monotonic()
        pending = cks[0].commit(str(g))  # rank 0 waits for rank 1 ...
        cks[1].remove(str(g))  # ... which removes the group instead of committing it
        with pytest.raises(GroupRemovedError, match="was removed while it was being committed"):
            pending.wait(60)
        assert time.monotonic() - t0 < 30  # at once, not after commit_timeout_s
        with pytest.raises(GroupRemovedError):
            cks[1].commit(str(g)).wait(60)  # what rank 1 saved before remove() is not committed either
    finally:
        _close(cks)
    assert not g.exists()
    assert latest(str(tmp_path)) is None
    assert _failed_group_commits(events) == [(0, "GroupRemovedError"), (1, "GroupRemovedError")]


@pytest.mark.parametrize(("committer", "hold"), [(0, "P.write_marker"), (1, "F.own_attempt"),
                                                  (1, "P.write_marker")])
def test_a_removal_that_wins_the_race_with_a_commit_fails_it_at_once_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, committer: int, hold: str) -> None:
    """Without a store, one rank's ``remove()`` can run before the other rank's commit thread has
    begun (another rank: ``own_attempt``, its first look at the group) or written its marker
    (rank 0 writes it first). That marker used to bring the directory back, and the committing
    rank then waited out commit_timeout_s (600 s by default) for a rank that had removed the group.
    The failed commit is one group ``commit`` event with the GroupRemovedError, whichever way it
    learnt of the removal (the cancel flag, or its marker's directory gone)."""
    from fastckpt.commit import attempt as A

    g = tmp_path / "G"
    events: list[Event] = []
    cks = [_ck(r, None, commit_timeout_s=120, sinks=(SimpleNamespace(emit=events.append),)) for r in (0, 1)]
    removed = threading.Event()
    owner, name = {"P": A.P, "F": A.F}[hold[0]], hold[2:]
    original = getattr(owner, name)

    def held(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        assert removed.wait(60)  # only the committing rank's thread calls these now
        return original(*args, **kwargs)

    try:
        for ck in cks:
            ck.save(_state(1, ck.rank), str(g / f"rank{ck.rank}.pt"), group=str(g)).wait(60)
        monkeypatch.setattr(owner, name, held)
        pending = cks[committer].commit(str(g))
        cks[1 - committer].remove(str(g))
        removed.set()
        t0 = time.monotonic()
        with pytest.raises(GroupRemovedError, match="was removed while it was being committed"):
            pending.wait(60)
        assert time.monotonic() - t0 < 60  # at once, not after commit_timeout_s
    finally:
        removed.set()
        _close(cks)
    assert not g.exists(), sorted(str(p.relative_to(tmp_path)) for p in g.rglob("*"))
    assert _failed_group_commits(events) == [(committer, "GroupRemovedError")]  # however the removal was seen


@pytest.mark.parametrize("first", ["rank 0", "remover", "removed"])
def test_a_removal_while_rank_0_publishes_never_publishes_a_group_without_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: str) -> None:
    """Without a store, rank 1's ``remove()`` while rank 0 publishes. Before, rank 0 checked the
    files, rank 1 deleted them, and rank 0's claim and manifest brought the directory back: a
    published group without files, which ``latest`` named. Now the attempt's claim decides. Rank
    0 first: the remover waits for its manifest, then deletes the group. The remover first: rank
    0's commit fails with GroupRemovedError, whether it claims while the remover deletes
    (``remover``) or once the claim went with the group (``removed``)."""
    from fastckpt.commit import claim as C

    prev, g = tmp_path / "P", tmp_path / "G"
    ops0, ops1 = FaultyOps(), FaultyOps()
    cks = [_ck(r, None, ops=(ops0, ops1)[r]) for r in (0, 1)]
    claiming, go, removal_claimed = threading.Event(), threading.Event(), threading.Event()
    original = C.claim

    def claim(place, token, who, why=""):  # noqa: ANN001, ANN202
        if who == C.RANK_0 and place.url().rstrip("/") == str(g):
            claiming.set()
            assert go.wait(60)
        won = original(place, token, who, why)
        if who == "removed":
            removal_claimed.set()
        return won

    monkeypatch.setattr(C, "claim", claim)
    manifest = ops0.gate("write_small", path_contains=f"G/{P.GROUP_MANIFEST}") if first == "rank 0" else None
    deleting = ops1.gate("unlink", path_contains=str(g / "rank")) if first == "remover" else None
    remover = threading.Thread(target=cks[1].remove, args=(str(g),))
    try:
        _save_all(cks, prev, 1)
        for ck in cks:
            ck.save(_state(2, ck.rank), str(g / f"rank{ck.rank}.pt"), group=str(g)).wait(60)
        pending = [ck.commit(str(g), step=2) for ck in cks]
        if first == "rank 0":
            go.set()
            assert manifest.wait_entered()  # rank 0 holds the claim; its manifest is on its way
            remover.start()
            while not removal_claimed.is_set() and remover.is_alive():
                remover.join(0.05)
            assert removal_claimed.is_set() and remover.is_alive()  # it waits for rank 0's manifest
            manifest.open()
            remover.join(60)
            assert pending[0].wait(60).group == str(g)  # published, then removed
        else:
            assert claiming.wait(60)  # rank 0 has every marker; it claims next
            remover.start()
            if first == "remover":
                assert deleting.wait_entered()  # the remover's claim is there while it deletes
            else:
                remover.join(60)
            go.set()
            with pytest.raises(GroupRemovedError, match="was removed while it was being committed|is gone"):
                pending[0].wait(60)
            if deleting is not None:
                deleting.open()
            remover.join(60)
        with pytest.raises(GroupRemovedError):
            pending[1].wait(60)
    finally:
        go.set()
        for gate in (manifest, deleting):
            if gate is not None:
                gate.open()
        _close(cks)
    assert not g.exists(), sorted(str(p.relative_to(tmp_path)) for p in g.rglob("*"))
    assert latest(str(tmp_path)) == str(prev)


def test_a_commit_that_finds_its_group_gone_reports_the_removal_once(tmp_path: Path) -> None:
    """Without a store, a removal by another rank shows as ENOENT when rank 0 writes its marker:
    the commit fails with GroupRemovedError, and its one group ``commit`` event carries that
    error too, not the raw FileNotFoundError it was seen as."""
    g = tmp_path / "G"
    events: list[Event] = []
    ops = FaultyOps([Fault("open", errno.ENOENT, path_contains=P.marker_rel(0))])
    cks = [_ck(r, None, ops=ops if r == 0 else None, sinks=(SimpleNamespace(emit=events.append),)) for r in (0, 1)]
    try:
        for ck in cks:
            ck.save(_state(1, ck.rank), str(g / f"rank{ck.rank}.pt"), group=str(g)).wait(60)
        with pytest.raises(GroupRemovedError, match="was removed while it was being committed"):
            cks[0].commit(str(g)).wait(60)
        ops.assert_all_reached()
    finally:
        _close(cks)
    assert _failed_group_commits(events) == [(0, "GroupRemovedError")]


def test_remove_waits_for_saves_in_flight_then_the_commit_fails_at_once(tmp_path: Path) -> None:
    g = tmp_path / "G"
    ops = FaultyOps()
    gate = ops.gate("fsync", path_contains="rank0")
    ck = _ck(0, None, world=1, ops=ops)
    try:
        save = ck.save(_state(1, 0), str(g / "rank0.pt"), group=str(g))
        assert gate.wait_entered()
        ck.save(_state(1, 0), str(g / "extra.pt"), group=str(g))
        ops.gate("fsync", path_contains="nothing")  # later fsyncs run freely
        gate_opener = gate.open
        gate_opener()
        ck.remove(str(g))
        assert save.wait(60).durable_s is not None  # it finished; then the group was deleted
        t0 = time.monotonic()
        with pytest.raises(GroupRemovedError):
            ck.commit(str(g)).wait(60)
        assert time.monotonic() - t0 < 30
    finally:
        gate.open()
        ck.close()
    assert not g.exists()


def test_a_group_saved_again_after_remove_commits(tmp_path: Path, store: object | None) -> None:
    g = tmp_path / "G"
    cks = [_ck(r, store) for r in (0, 1)]
    try:
        _save_all(cks, g, 1)
        for ck in cks:
            ck.remove(str(g))
        _save_all(cks, g, 2)
    finally:
        _close(cks)
    assert _versions(g) == [2, 2]


# --------------------------------------------------------------------------- item 11
def test_group_loads_read_the_burst_buffer_copy(tmp_path: Path, store: object | None,
                                                caplog: pytest.LogCaptureFixture) -> None:
    g, local = tmp_path / "durable" / "G", tmp_path / "nvme"
    cks = [_ck(r, store, local_dir=str(local)) for r in (0, 1)]
    try:
        _save_all(cks, g, 1)
        for ck in cks:
            assert ck.local_path(str(g / P.GROUP_MANIFEST)) is not None
            assert os.path.exists(ck.local_path(str(g / P.GROUP_MANIFEST)))
        with caplog.at_level(logging.WARNING, logger="fastckpt"):
            for ck in cks:
                got = ck.load(str(g / f"rank{ck.rank}.pt"))
                assert got["version"] == 1
                assert ck.stats().last_restore_from == "local"
        assert "unusable" not in caplog.text
        # a new attempt takes the local manifest away until it is committed itself
        cks[0].save(_state(2, 0), str(g / "rank0.pt"), group=str(g)).wait(60)
        assert not os.path.exists(cks[0].local_path(str(g / P.GROUP_MANIFEST)))
        assert cks[0].load(str(g / "rank0.pt"))["version"] == 1  # the published one, from its home
        assert cks[0].stats().last_restore_from == "path"
        cks[1].save(_state(2, 1), str(g / "rank1.pt"), group=str(g))
        for h in [ck.commit(str(g)) for ck in cks]:
            h.wait(60)
        assert cks[0].load(str(g / "rank0.pt"))["version"] == 2
        assert cks[0].stats().last_restore_from == "local"
    finally:
        _close(cks)


def test_a_group_no_rank_saved_into_is_refused_and_latest_stays(tmp_path: Path, store: object | None) -> None:
    """``commit()`` of a group that no rank saved a file into (a typo in its path, say) published an
    empty group, and ``latest`` named it over the real checkpoints: a resume found nothing to load.
    Now rank 0 refuses it (ConfigError) and the other ranks' commits fail with its reason (as with
    any failure of rank 0's publication); nothing is published, latest does not move."""
    from fastckpt.errors import ConfigError

    cks = [_ck(r, store) for r in (0, 1)]
    why = "no rank saved a file into it, so there is nothing to commit"
    try:
        _save_all(cks, tmp_path / "step-1", 1)
        empty = tmp_path / "step_2"
        handles = [ck.commit(str(empty)) for ck in cks]
        with pytest.raises(ConfigError, match=why):
            handles[0].wait(60)
        with pytest.raises(CommitTimeoutError, match=why):
            handles[1].wait(60)
    finally:
        _close(cks)
    assert not (empty / P.GROUP_MANIFEST).exists()
    assert latest(str(tmp_path)) == str(tmp_path / "step-1")


def test_a_refused_commit_leaves_no_directory_that_ls_lists_as_incomplete(tmp_path: Path) -> None:
    """A commit refused for nothing to commit opened its attempt first: a retried commit of a
    published group left its re-save directory ``.TAG.fastckpt-next-<digest>``, a typo in the
    group's name an empty directory, both listed as incomplete groups by ``ls`` for good. Now
    what the refused commit created goes; a directory that holds a file stays."""
    from fastckpt.cli._listing import list_checkpoints
    from fastckpt.errors import ConfigError

    why = "no rank saved a file into it, so there is nothing to commit"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.bin").write_bytes(b"not fastckpt's")
    with fastckpt.Checkpointer(overhead_budget=0.99) as ck:
        ck.save(_state(1, 0), str(tmp_path / "step-1" / "a.pt"), group=str(tmp_path / "step-1"))
        ck.commit(str(tmp_path / "step-1"), step=1).wait(60)
        before = sorted(os.listdir(tmp_path))
        for group in ("step-1", "step-l", "data"):  # a retried commit, a typo, a directory of the user's
            with pytest.raises(ConfigError, match=why):
                ck.commit(str(tmp_path / group), step=1).wait(60)
    assert sorted(os.listdir(tmp_path)) == before
    assert (tmp_path / "data" / "x.bin").read_bytes() == b"not fastckpt's"
    assert [(e.name, e.status) for e in list_checkpoints(str(tmp_path))] == [("step-1", "complete")]


def _loaded_from(cks: list[fastckpt.Checkpointer], g: Path, version: int) -> list[str]:
    """Where each rank's load of its file of ``g`` (of ``version``) read it from."""
    where = []
    for ck in cks:
        assert ck.load(str(g / f"rank{ck.rank}.pt"))["version"] == version
        where.append(ck.stats().last_restore_from)
    return where


def test_a_refused_retried_commit_leaves_the_burst_buffer_copy_complete(tmp_path: Path, store: object | None) -> None:
    """Opening the attempt of a retried commit (no rank saved into the published group) deleted
    the burst-buffer copy's manifest before rank 0 refused it: the copy was whole but no longer
    complete (``ls`` of the burst buffer listed it incomplete, loads judged it by the home's
    manifest, and retention of a later run takes such a copy for an unpublished leftover). Now
    the refusal leaves the copy as it was: its manifest back, loads read it."""
    from fastckpt.cli._listing import list_checkpoints
    from fastckpt.errors import ConfigError

    g, local = tmp_path / "durable" / "G", tmp_path / "nvme"
    cks = [_ck(r, store, local_dir=str(local)) for r in (0, 1)]  # one node: both ranks share the copy
    copy = Path(cks[0].local_path(str(g / P.GROUP_MANIFEST)))
    why = "no rank saved a file into it, so there is nothing to commit"
    try:
        _save_all(cks, g, 1)
        published = copy.read_bytes()
        handles = [ck.commit(str(g), step=1) for ck in cks]  # the retry: nothing saved since
        with pytest.raises(ConfigError, match=why):
            handles[0].wait(60)
        with pytest.raises(CommitTimeoutError, match=why):
            handles[1].wait(60)
        assert [(e.name, e.status) for e in list_checkpoints(str(copy.parent.parent))] == [("G", "complete")]
        assert copy.read_bytes() == published  # before: gone
        assert _loaded_from(cks, g, 1) == ["local", "local"]
        _save_all(cks, g, 2)  # a later attempt is as before: the copy complete again once committed
        assert _loaded_from(cks, g, 2) == ["local", "local"]
    finally:
        _close(cks)
    assert latest(str(tmp_path / "durable")) == str(g)


def test_a_save_into_the_copy_leaves_no_set_aside_manifest_to_put_back(tmp_path: Path) -> None:
    """The manifest a rank that saves nothing sets aside is put back only while nothing was written
    into the copy since: a save's opening deletes it, so a refusal that comes later (another rank's,
    or one after a restart) never marks a copy being rewritten complete."""
    from fastckpt.commit import leftovers as L

    copy = place(tmp_path / "G")
    copy.put(P.GROUP_MANIFEST, P.manifest_bytes({"kind": "group", "attempt": "a", "files": {}}))
    att = SimpleNamespace(local=(copy,), old=P.read_group_manifest(copy))
    L.set_aside((copy,), writes=False)
    assert copy.size(P.GROUP_MANIFEST) < 0 and copy.size(L.KEPT) > 0  # killed now: incomplete, as before
    L.set_aside((copy,), writes=True)  # another rank's save into the copy
    L.put_back(att)  # type: ignore[arg-type]
    assert copy.size(P.GROUP_MANIFEST) < 0 and copy.size(L.KEPT) < 0


def test_a_save_outside_its_group_is_refused_without_failing_the_groups_commit(tmp_path: Path) -> None:
    """A save whose path is not under its group raises ConfigError at the call. Before, it also
    marked the group's attempt as lacking that file (named with a garbled relative path,
    ``her/a.pt`` for ``other/a.pt``), so the commit failed after the right file was saved."""
    from fastckpt.errors import ConfigError

    g = tmp_path / "g"
    with fastckpt.Checkpointer(overhead_budget=0.99) as ck:
        with pytest.raises(ConfigError, match=f"is not inside its group directory {g}: save each file of a group "
                                              f"under its directory, e.g. {g}/a.pt"):
            ck.save(_state(1, 0), str(tmp_path / "other" / "a.pt"), group=str(g))
        ck.save(_state(1, 0), str(g / "a.pt"), group=str(g))
        ck.commit(str(g)).wait(60)
    assert latest(str(tmp_path)) == str(g)


def test_a_second_commit_without_saves_leaves_the_published_group_whole(tmp_path: Path) -> None:
    """Before: it re-published the group with no files and deleted the one it had (a committed
    checkpoint lost); now it is refused like any commit of a group nothing was saved into."""
    from fastckpt.errors import ConfigError

    g = tmp_path / "g"
    with fastckpt.Checkpointer(overhead_budget=0.99) as ck:
        ck.save(_state(1, 0), str(g / "a.pt"), group=str(g))
        ck.commit(str(g)).wait(60)
        with pytest.raises(ConfigError, match="no rank saved a file into it"):
            ck.commit(str(g)).wait(60)
    assert fastckpt.load(str(g / "a.pt"))["version"] == 1
    assert list(json.loads((g / P.GROUP_MANIFEST).read_text())["files"]) == ["a.pt"]


def test_without_a_store_a_rank_reports_a_group_only_once_latest_moved(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 publishes the manifest, then moves ``latest``; killed in between, the group is one
    whose commit never returned, and a resumed job saves it again (at a URL: in place, deleting
    that manifest first). Rank 1 reported it committed as soon as it saw the manifest, so a step
    it had reported durable could be lost. Now it waits for ``latest`` too: with rank 0 held
    right before the move (as if killed there), rank 1's commit times out instead."""
    held, release = threading.Event(), threading.Event()
    move = P.move_pointer

    def stuck(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 (rank 0's commit thread)
        held.set()
        assert release.wait(60)
        return move(*args, **kwargs)

    cks = [_ck(r, None, commit_timeout_s=3) for r in (0, 1)]
    try:
        _save_all(cks, tmp_path / "step-1", 1)
        monkeypatch.setattr(P, "move_pointer", stuck)
        g = tmp_path / "step-2"
        for ck in cks:
            ck.save(_state(2, ck.rank), str(g / f"rank{ck.rank}.pt"), group=str(g))
        handles = [ck.commit(str(g), step=2) for ck in cks]
        assert held.wait(60)  # the manifest is out; latest still names step-1
        assert (g / P.GROUP_MANIFEST).exists() and latest(str(tmp_path)) == str(tmp_path / "step-1")
        with pytest.raises(CommitTimeoutError):
            handles[1].wait(60)  # before: it returned, reporting step-2 committed
        release.set()
        handles[0].wait(60)
    finally:
        release.set()
        _close(cks)
    assert latest(str(tmp_path)) == str(g)


def test_without_a_store_a_rank_late_to_a_group_that_keep_persistent_trimmed_reports_it_committed(
        tmp_path: Path) -> None:
    """Rank 0 published step-1, then step-2, and keep_persistent=1 trimmed step-1 before rank 1's
    poll read step-1's manifest. Rank 1 found its marker gone and raised GroupRemovedError ("...
    nothing of it is published"), stopping a healthy job at its next call; then, from ``latest``
    naming a later step, it ended superseded, while rank 0 reported it committed. Retention records
    the trim of the attempt it published (``commit/trimmed.py``): rank 1 reports it committed too."""
    s1 = tmp_path / "step-1"
    trimmed = threading.Event()

    class Trimming(FaultyOps):  # rank 0: tells when step-1's directory is gone
        def rmdir(self, path: str) -> None:
            super().rmdir(path)
            if os.path.normpath(path) == str(s1):
                trimmed.set()

    class Late(FaultyOps):  # rank 1: its first read of step-1's manifest comes after the trim
        def read_small(self, path: str) -> bytes | None:
            if path == str(s1 / P.GROUP_MANIFEST) and os.path.exists(path) and not trimmed.is_set():
                assert trimmed.wait(60)
            return super().read_small(path)

    cks = [_ck(0, None, keep_persistent=1, ops=Trimming()), _ck(1, None, ops=Late())]
    try:
        handles = {}
        for v in (1, 2):
            g = tmp_path / f"step-{v}"
            for ck in cks:
                ck.save(_state(v, ck.rank), str(g / f"rank{ck.rank}.pt"), group=str(g))
            handles.update({(v, ck.rank): ck.commit(str(g), step=v) for ck in cks})
        published = handles[(1, 0)].wait(60)
        assert not published.superseded  # rank 0 published it
        assert handles[(2, 1)].wait(60).durable_s is not None
        late = handles[(1, 1)].wait(60)  # before: GroupRemovedError, then superseded
        assert not late.superseded and late.durable_s is not None and late.bytes == published.bytes
        assert trimmed.is_set() and not s1.exists()
    finally:
        _close(cks)
    assert latest(str(tmp_path)) == str(tmp_path / "step-2")
    assert fastckpt.load(str(tmp_path / "step-2" / "rank1.pt"))["version"] == 2


def test_a_rank_whose_group_was_removed_while_latest_names_an_earlier_step_still_raises(
        tmp_path: Path) -> None:
    """The counterpart: the group went and ``latest`` names no later step, so nothing moved past
    it: GroupRemovedError, as before."""
    g, polling, go_on = tmp_path / "step-2", threading.Event(), threading.Event()
    go_on.set()  # rank 1 tells when it polls for step-2's manifest, and is not held

    cks = [_ck(0, None), _ck(1, None, ops=_held_poll(g, polling, go_on))]
    try:
        h = _removed_while_rank_1_polls(cks, tmp_path, g, polling)
        with pytest.raises(GroupRemovedError):
            h.wait(60)
    finally:
        _close(cks)
    assert latest(str(tmp_path)) == str(tmp_path / "step-1")


def test_a_rank_whose_group_was_removed_before_a_later_step_was_committed_still_raises(tmp_path: Path) -> None:
    """Rank 0 removed step-2 while rank 1 waited for its manifest, and both committed step-3 before
    rank 1's poll looked again: ``latest`` names a later step, but nobody published step-2, and no
    retention trimmed it. Before, rank 1's commit of it ended superseded, as if rank 0 had moved
    past it; it is a removal, and raises GroupRemovedError, naming no retention."""
    g, s3, polling, committed = tmp_path / "step-2", tmp_path / "step-3", threading.Event(), threading.Event()

    cks = [_ck(0, None), _ck(1, None, ops=_held_poll(g, polling, committed))]  # until step-3 is committed
    try:
        h = _removed_while_rank_1_polls(cks, tmp_path, g, polling)
        _save_all(cks, s3, 3)
        assert latest(str(tmp_path)) == str(s3)
        committed.set()
        with pytest.raises(GroupRemovedError, match="no deletion of this attempt once published was recorded"):
            h.wait(60)  # before: superseded
    finally:
        committed.set()
        _close(cks)
    assert not g.exists()


def test_a_rank_late_to_a_published_group_that_remove_deleted_reports_it_committed(tmp_path: Path) -> None:
    """Rank 0 published step-1, committed step-2 and removed step-1 (a top-k of one, as Lightning's
    ModelCheckpoint does) before rank 1's poll read step-1's manifest: rank 1 raised
    GroupRemovedError for a group rank 0 reported committed. remove() records a published group's
    deletion as retention's trim does: rank 1 reports it committed with rank 0's bytes."""
    g, polling, removed = tmp_path / "step-1", threading.Event(), threading.Event()

    cks = [_ck(0, None), _ck(1, None, ops=_held_poll(g, polling, removed))]  # until rank 0 removed step-1
    try:
        for ck in cks:
            ck.save(_state(1, ck.rank), str(g / f"rank{ck.rank}.pt"), group=str(g)).wait(60)
        h0, h1 = (ck.commit(str(g), step=1) for ck in cks)
        first = h0.wait(60)  # published: rank 1's marker joined before its poll was held
        assert polling.wait(60)
        cks[0].remove(str(g))
        removed.set()
        assert h1.wait(60).bytes == first.bytes  # before: GroupRemovedError
    finally:
        removed.set()
        _close(cks)
    assert not g.exists()


def test_retention_records_a_trim_before_it_and_keeps_the_group_when_it_cannot(tmp_path: Path) -> None:
    """The record of a trimmed group (``commit/trimmed.py``) is written before anything of the group
    goes: when it cannot be written (EIO), the group stays whole and published until a later trim;
    a record older than it is kept for (twice ``commit_timeout_s``, and more) is pruned then."""
    from fastckpt.commit import trimmed as T
    from fastckpt.commit.names import TRIMMED_DIR

    records = tmp_path / TRIMMED_DIR
    records.mkdir()
    (records / f"{int(time.time()) - 3600}-0123456789abcdef0123.json").write_text("{}")  # an hour old
    ops = FaultyOps([Fault("open", errno.EIO, path_contains=TRIMMED_DIR)])
    cks = [_ck(0, None, keep_persistent=1, ops=ops), _ck(1, None)]
    try:
        _save_all(cks, tmp_path / "step-1", 1)
        _save_all(cks, tmp_path / "step-2", 2)  # the trim of step-1 fails: no record, nothing deleted
        assert ops.fired and _versions(tmp_path / "step-1") == [1, 1]
        m = json.loads((tmp_path / "step-2" / P.GROUP_MANIFEST).read_text())
        _save_all(cks, tmp_path / "step-3", 3)  # step-1 and step-2 go, each recorded first
    finally:
        _close(cks)
    assert not (tmp_path / "step-1").exists() and not (tmp_path / "step-2").exists()
    done = T.find(place(str(tmp_path / "step-2")), m["attempt"])
    assert done is not None and done["total"] == sum(f["size"] for f in m["files"].values())
    assert len(os.listdir(records)) == 2  # step-1's and step-2's; the hour-old one pruned
    assert T.find(place(str(tmp_path / "step-2")), "another attempt") is None


def test_retention_records_no_trim_of_a_group_committed_through_a_store(tmp_path: Path) -> None:
    """Through a store the other ranks heard the outcome before anything was trimmed: no record,
    so a directory of DeepSpeed tags holds nothing new."""
    from fastckpt.commit.names import TRIMMED_DIR

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    cks = [_ck(0, store, keep_persistent=1), _ck(1, store)]
    try:
        for v in (1, 2):
            _save_all(cks, tmp_path / f"step-{v}", v)
    finally:
        _close(cks)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-2"] and not (tmp_path / TRIMMED_DIR).exists()


def test_two_checkpointers_saving_into_one_group_are_refused(tmp_path: Path) -> None:
    """An actor's and a critic's Checkpointer of one process both saved into run/step-1 and both
    committed: both commits succeeded, and the published group named only the critic's file (the
    actor's did not load). Now the second one's save is refused, naming both Checkpointers and the
    fix, and the first one's attempt commits whole."""
    from fastckpt.errors import ConfigError

    g = tmp_path / "run" / "step-1"
    with fastckpt.Checkpointer(overhead_budget=0.99) as actor, fastckpt.Checkpointer(overhead_budget=0.99) as critic:
        actor.save(_state(1, 0), str(g / "actor.pt"), group=str(g))
        with pytest.raises(ConfigError) as refused:
            critic.save(_state(2, 0), str(g / "critic.pt"), group=str(g))
        with pytest.raises(CheckpointWriteError, match="this rank's save of critic.pt \\(ConfigError: "):
            critic.commit(str(g), step=1)  # as after any save into the group that raised
        with fastckpt.Checkpointer(overhead_budget=0.99) as third, pytest.raises(ConfigError, match="has it open"):
            third.commit(str(g), step=1)  # a commit of it, with nothing saved, is refused the same way
        actor.commit(str(g), step=1).wait(60)
    text = str(refused.value)
    assert f"checkpoint group {g}: {critic._coordinator.label} saves into it" in text
    assert f"while {actor._coordinator.label} has it open there" in text
    assert "Save a group's files through one Checkpointer, or use separate tags/directories" in text
    assert "close() it, or make each one with `with Checkpointer(...)`" in text
    assert fastckpt.load(str(g / "actor.pt"))["version"] == 1
    assert list(json.loads((g / P.GROUP_MANIFEST).read_text())["files"]) == ["actor.pt"]


def test_a_group_spelt_through_a_symbolic_link_is_the_same_group_to_the_owners_check(tmp_path: Path) -> None:
    """``run`` -> ``real``: an actor saving into ``run/step-1`` and a critic into ``real/step-1``
    (one folder) were two groups to the check, keyed by the path as spelt, so both attempts ran
    and the commit that published last dropped the other's file. The critic is refused."""
    from fastckpt.errors import ConfigError

    (tmp_path / "real").mkdir()
    (tmp_path / "run").symlink_to(tmp_path / "real")
    g, other = tmp_path / "run" / "step-1", tmp_path / "real" / "step-1"
    with fastckpt.Checkpointer(overhead_budget=0.99) as actor, fastckpt.Checkpointer(overhead_budget=0.99) as critic:
        actor.save(_state(1, 0), str(g / "actor.pt"), group=str(g))
        with pytest.raises(ConfigError, match=f"while {actor._coordinator.label} has it open there"):
            critic.save(_state(2, 0), str(other / "critic.pt"), group=str(other))
        actor.commit(str(g), step=1).wait(60)
    assert list(json.loads((other / P.GROUP_MANIFEST).read_text())["files"]) == ["actor.pt"]


def test_a_checkpointer_dropped_without_close_does_not_hold_its_group(tmp_path: Path) -> None:
    """A retry loop whose first try raised between save and commit (its Checkpointer never closed,
    unreachable now): the new Checkpointer's save into the same group was refused until the cyclic
    garbage collector happened to run. Now a conflict collects once and looks again."""
    g = tmp_path / "run" / "step-1"

    def first_try() -> None:
        ck = fastckpt.Checkpointer(overhead_budget=0.99)
        ck.save(_state(1, 0), str(g / "a.pt"), group=str(g)).wait(60)
        raise RuntimeError("the training step failed before commit")

    with pytest.raises(RuntimeError, match="before commit"):
        first_try()
    with fastckpt.Checkpointer(overhead_budget=0.99) as retry:
        retry.save(_state(2, 0), str(g / "a.pt"), group=str(g))
        retry.commit(str(g), step=1).wait(60)
    assert fastckpt.load(str(g / "a.pt"))["version"] == 2


def test_a_second_checkpointer_is_refused_while_the_first_begins_the_group(tmp_path: Path) -> None:
    """Coordinator.begin claims the group, then reads its manifest (a GET for a URL), and opens the
    attempt only after: in between the first Checkpointer did not hold the group, and a second
    one's claim swept the first one's away. Both saved, both committed, one file was dropped."""
    from fastckpt.errors import ConfigError

    g = tmp_path / "run" / "step-1"
    ops = FaultyOps([])
    reading = ops.gate("open", path_contains=P.GROUP_MANIFEST)
    with fastckpt.Checkpointer(ops=ops, overhead_budget=0.99) as actor, \
            fastckpt.Checkpointer(overhead_budget=0.99) as critic:
        saved: list[fastckpt.SaveHandle] = []
        t = threading.Thread(target=lambda: saved.append(actor.save(_state(1, 0), str(g / "actor.pt"), group=str(g))))
        t.start()
        try:
            assert reading.wait_entered(30)  # the actor has claimed the group and reads its manifest
            with pytest.raises(ConfigError, match=f"while {actor._coordinator.label} has it open"):
                critic.save(_state(2, 0), str(g / "critic.pt"), group=str(g))
        finally:
            reading.open()
            t.join(60)
        saved[0].wait(60)
        actor.commit(str(g), step=1).wait(60)
    assert list(json.loads((g / P.GROUP_MANIFEST).read_text())["files"]) == ["actor.pt"]


def test_a_second_checkpointer_is_refused_while_the_first_hands_its_commit_on(tmp_path: Path) -> None:
    """Between commit() taking the attempt out of the open ones and its commit being in flight (the
    ``committing`` event is emitted in between) the group was not held: a second Checkpointer's
    save into it was let in."""
    from fastckpt.errors import ConfigError

    g = tmp_path / "run" / "step-1"
    entered, go = threading.Event(), threading.Event()

    class Holding:
        def emit(self, event: Event) -> None:
            if event.name == "committing":
                entered.set()
                go.wait(60)

    with fastckpt.Checkpointer(sinks=(Holding(),), overhead_budget=0.99) as actor, \
            fastckpt.Checkpointer(overhead_budget=0.99) as critic:
        actor.save(_state(1, 0), str(g / "actor.pt"), group=str(g)).wait(60)
        committed: list[fastckpt.SaveHandle] = []
        t = threading.Thread(target=lambda: committed.append(actor.commit(str(g), step=1)))
        t.start()
        try:
            assert entered.wait(30)
            with pytest.raises(ConfigError, match=f"while {actor._coordinator.label} has it open"):
                critic.save(_state(2, 0), str(g / "critic.pt"), group=str(g))
        finally:
            go.set()
            t.join(60)
        committed[0].wait(60)
    assert list(json.loads((g / P.GROUP_MANIFEST).read_text())["files"]) == ["actor.pt"]


def test_a_group_is_free_for_another_checkpointer_once_committed_or_closed(tmp_path: Path) -> None:
    """The claim lasts from the first save of an attempt to the end of its commit, or to close()."""
    g, h = tmp_path / "run" / "step-1", tmp_path / "run" / "step-2"
    with fastckpt.Checkpointer(overhead_budget=0.99) as first:
        first.save(_state(1, 0), str(g / "a.pt"), group=str(g))
        first.commit(str(g), step=1).wait(60)
        first.save(_state(1, 0), str(h / "a.pt"), group=str(h))  # closed with it open: never committed
    with fastckpt.Checkpointer(overhead_budget=0.99) as second:
        second.save(_state(2, 0), str(g / "a.pt"), group=str(g))  # a re-save of the published group
        second.commit(str(g), step=1).wait(60)
        second.save(_state(2, 0), str(h / "a.pt"), group=str(h))
        second.commit(str(h), step=2).wait(60)
    assert fastckpt.load(str(g / "a.pt"))["version"] == 2 and fastckpt.load(str(h / "a.pt"))["version"] == 2
