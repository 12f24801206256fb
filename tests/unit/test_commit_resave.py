"""Re-saving a published group while the attempt it replaced is still being deleted
(``commit/resave.py``): the next re-save writes elsewhere, ``latest`` moves first, and a failed
delete does not fail a published checkpoint.

Ranks are Checkpointers in this process (with a real TCPStore, and without a store); rank 0's
deletion of the replaced attempt is held at a ``FaultyOps`` gate.
"""

from __future__ import annotations

import datetime
import errno
import io
import json
import os
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.commit import protocol as P
from fastckpt.io import atomic
from fastckpt.testing import Fault, FaultyOps
from tests.helpers import close_all, place

MODES = ("no store", "store")


def _cks(mode: str, ops: FaultyOps, faulty_rank: int = 0) -> list[fastckpt.Checkpointer]:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60)) \
        if mode == "store" else None
    return [fastckpt.Checkpointer(rank=r, world_size=2, store=store, io_threads=1, overhead_budget=0.99,
                                  commit_timeout_s=60, ops=ops if r == faulty_rank else None) for r in range(2)]


def _save(ck: fastckpt.Checkpointer, g: Path, version: int) -> fastckpt.SaveHandle:
    state = {"w": torch.full((64,), float(version)), "version": version, "rank": ck.rank}
    return ck.save(state, str(g / f"rank{ck.rank}.pt"), group=str(g))


def _versions(g: Path) -> list[int]:
    m = P.read_group_manifest(place(str(g)))
    assert m is not None and sorted(m["files"]) == ["rank0.pt", "rank1.pt"]
    return [fastckpt.load(str(g / f"rank{r}.pt"))["version"] for r in (0, 1)]


def _publish(cks: list[fastckpt.Checkpointer], g: Path, version: int) -> None:
    for ck in cks:
        _save(ck, g, version)
    for h in [ck.commit(str(g), step=version) for ck in cks]:
        h.wait(60)


@pytest.mark.parametrize("mode", MODES)
def test_the_next_resave_never_writes_where_the_replaced_attempt_is_being_deleted(tmp_path: Path,
                                                                                   mode: str) -> None:
    ops = FaultyOps()
    cks = _cks(mode, ops)
    g = tmp_path / "run" / "global_step10"
    try:
        _publish(cks, g, 1)
        held = ops.gate("rmdir", path_contains=".fastckpt-next")  # rank 0 deleting the replaced attempt
        for ck in cks:
            _save(ck, g, 2)
        commits = [ck.commit(str(g), step=2) for ck in cks]
        assert held.wait_entered(60)  # version 2 is published (swapped in); version 1 is half deleted
        commits[1].wait(60)  # rank 1 saw it published: it re-saves the tag at once
        assert _versions(g) == [2, 2]
        assert fastckpt.latest(str(tmp_path / "run")) == str(g)  # moved before the delete
        _save(cks[1], g, 3).wait(60)  # rank 1's file of version 3 is durable while rank 0 still deletes
        held.open()
        commits[0].wait(60)
        _save(cks[0], g, 3)
        for h in [ck.commit(str(g), step=3) for ck in cks]:
            h.wait(60)
        assert _versions(g) == [3, 3]
        assert not [n for n in os.listdir(g.parent) if ".fastckpt-next" in n]  # every replaced attempt went
    finally:
        close_all(cks)


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_delete_of_the_replaced_attempt_does_not_fail_the_published_resave(tmp_path: Path, mode: str,
                                                                                  caplog: pytest.LogCaptureFixture
                                                                                  ) -> None:
    ops = FaultyOps()
    cks = _cks(mode, ops)
    g = tmp_path / "run" / "global_step10"
    try:
        _publish(cks, g, 1)
        ops.inject(Fault("unlink", errno.EACCES, path_contains="rank0.pt",  # the replaced attempt's file
                         path_startswith=str(g.parent / ".global_step10.fastckpt-next")))
        with caplog.at_level("WARNING", logger="fastckpt"):
            _publish(cks, g, 2)  # every commit succeeds: the group is published
        assert _versions(g) == [2, 2]
        assert fastckpt.latest(str(tmp_path / "run")) == str(g)
        assert "could not be deleted" in caplog.text
        leftovers = [n for n in os.listdir(g.parent) if ".fastckpt-next" in n]
        assert leftovers  # the replaced attempt, still there
        _publish(cks, g, 3)  # the next re-save sweeps it
        assert _versions(g) == [3, 3]
        assert not set(leftovers) & set(os.listdir(g.parent))
        m = json.loads((g / P.GROUP_MANIFEST).read_bytes())
        assert m["step"] == 3
    finally:
        close_all(cks)


def test_removing_a_group_removes_every_resave_directory_it_has(tmp_path: Path) -> None:
    ops = FaultyOps()
    cks = _cks("no store", ops)
    g = tmp_path / "run" / "global_step10"
    try:
        _publish(cks, g, 1)
        stale = g.parent / ".global_step10.fastckpt-next"  # an earlier version's name
        (stale / "sub").mkdir(parents=True)
        (stale / "sub" / "x").write_bytes(b"x")
        for ck in cks:
            _save(ck, g, 2)  # an attempt at re-saving it, never committed
        for ck in cks:
            ck.remove(str(g))
        assert not [n for n in os.listdir(g.parent) if "global_step10" in n]
    finally:
        close_all(cks)


@pytest.mark.parametrize("mode", MODES)
def test_resave_directories_a_crash_left_with_only_temp_files_are_swept(tmp_path: Path, mode: str) -> None:
    # A writer killed during its first file of a re-save leaves a hidden directory holding only
    # its temp file (invisible to list()); a crash between mkdir and open leaves it empty.
    cks = _cks(mode, FaultyOps())
    g = tmp_path / "run" / "global_step10"
    try:
        _publish(cks, g, 1)
        crashed = [g.parent / ".global_step10.fastckpt-next-0123456789ab", g.parent / ".global_step10.fastckpt-next"]
        for d in crashed:
            d.mkdir()
        Path(atomic.tmp_name(str(crashed[0] / "rank0.pt"))).write_bytes(b"\0" * 4096)
        _publish(cks, g, 2)
        assert _versions(g) == [2, 2]
        assert not [n for n in os.listdir(g.parent) if ".fastckpt-next" in n]  # cleared, with the crashed ones
        for d in crashed:
            d.mkdir()
        Path(atomic.tmp_name(str(crashed[0] / "rank1.pt"))).write_bytes(b"\0" * 4096)
        for ck in cks:
            ck.remove(str(g))
        assert not [n for n in os.listdir(g.parent) if "global_step10" in n]
    finally:
        close_all(cks)


@pytest.mark.parametrize("mode", MODES)
def test_a_group_trimmed_while_one_rank_re_saves_it_is_never_published_without_that_ranks_file(
        tmp_path: Path, mode: str) -> None:
    """Rank 1 begins re-saving the published tag ``last`` (beside it); rank 0's commit of a newer
    tag then trims ``last`` (``keep_persistent=1``) with rank 1's new file, and rank 0 saves into
    ``last`` in place. Before the fix, with a store, both commits succeeded and ``latest`` named a
    manifest whose rank-1 file was not there."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60)) \
        if mode == "store" else None
    cks = [fastckpt.Checkpointer(rank=r, world_size=2, store=store, io_threads=1, overhead_budget=0.99,
                                 keep_persistent=1, commit_timeout_s=60 if store else 2) for r in range(2)]
    run = tmp_path / "run"
    last, newer = run / "last", run / "global_step200"
    try:
        _publish(cks, last, 1)
        for ck in cks:
            _save(ck, newer, 2).wait(60)
        h1 = cks[1].commit(str(newer), step=200)
        _save(cks[1], last, 3).wait(60)  # 'last' is published: rank 1 writes beside it
        assert [n for n in os.listdir(run) if n.startswith(".last")]
        cks[0].commit(str(newer), step=200).wait(60)  # rank 0 trims 'last', and rank 1's new file with it
        h1.wait(60)
        assert not last.exists()
        _save(cks[0], last, 3)  # 'last' is not published now: rank 0 writes in place
        commits = [ck.commit(str(last), step=300) for ck in cks]
        for h in commits:
            with pytest.raises((fastckpt.CheckpointWriteError, fastckpt.CommitTimeoutError,
                                fastckpt.IncompleteCheckpointError)) as err:
                h.wait(60)
            if store is not None:
                assert "disagree on where it lives" in str(err.value)
        assert P.read_group_manifest(place(str(last))) is None
        assert fastckpt.latest(str(run)) == str(newer)
        _publish(cks, last, 4)  # the next save on every rank commits
        assert _versions(last) == [4, 4]
        assert fastckpt.latest(str(run)) == str(last)
    finally:
        close_all(cks)


def _zero_file(r: int) -> str:
    return f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"  # DeepSpeed's name of rank r's ZeRO file


def _zero_versions(g: Path, ranks: tuple[int, ...]) -> list[int]:
    return [torch.load(g / _zero_file(r), weights_only=True)["version"] for r in ranks]


@pytest.mark.parametrize("mode", MODES)
def test_a_tag_deepspeeds_own_engine_saved_stays_whole_until_its_resave_is_published(tmp_path: Path,
                                                                                      mode: str) -> None:
    """A tag DeepSpeed's own engine wrote has no fastckpt manifest, yet it is a checkpoint: a
    re-save through fastckpt that fails half-way leaves it whole (before, the first file was
    already renamed over DeepSpeed's), and one that succeeds replaces it whole: DeepSpeed's files
    the new attempt does not write (a save at another world size) are not carried over, the
    user's other files are."""
    g = tmp_path / "run" / "last"
    g.mkdir(parents=True)
    for r in (0, 1, 2):  # DeepSpeed's save by 3 ranks
        torch.save({"w": torch.full((64,), 0.0), "version": 0}, g / _zero_file(r))
    (g / "notes.txt").write_text("the user's")
    ops = FaultyOps([Fault("pwrite", errno.EIO, path_contains=_zero_file(1))])  # rank 1's write fails
    cks = _cks(mode, ops, faulty_rank=1)

    def save(ck: fastckpt.Checkpointer, version: int) -> fastckpt.SaveHandle:
        state = {"w": torch.full((64,), float(version)), "version": version}
        return ck.save(state, str(g / _zero_file(ck.rank)), group=str(g))

    try:
        save(cks[0], 1).wait(60)
        with pytest.raises(fastckpt.CheckpointWriteError):  # raised once, here: the commit then ends the attempt
            save(cks[1], 1).wait(60)
        for h in [ck.commit(str(g), step=1) for ck in cks]:
            with pytest.raises(fastckpt.CheckpointWriteError):
                h.wait(60)
        ops.assert_all_reached()
        assert _zero_versions(g, (0, 1, 2)) == [0, 0, 0]
        assert not (g / P.GROUP_MANIFEST).exists()
        for ck in cks:
            save(ck, 2)
        for h in [ck.commit(str(g), step=2) for ck in cks]:
            h.wait(60)
        assert [fastckpt.load(str(g / _zero_file(r)))["version"] for r in (0, 1)] == [2, 2]
        assert sorted(set(os.listdir(g)) - {P.MARKER_DIR}) == [P.GROUP_MANIFEST, "notes.txt", _zero_file(0),
                                                               _zero_file(1)]
        assert (g / "notes.txt").read_text() == "the user's"
        assert not [n for n in os.listdir(g.parent) if ".fastckpt-next" in n]
    finally:
        close_all(cks)


def test_a_tag_deepspeeds_own_engine_saved_at_a_url_is_refused_not_overwritten(tmp_path: Path) -> None:
    """An object store cannot swap directories: a re-save there of a tag DeepSpeed's own engine
    saved is refused at its first save, naming the tag and the fix (before, the object was
    replaced in place)."""
    root = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run"
    fs = fsspec.filesystem("memory")
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4), "version": 0}, buf)
    key = f"{root.removeprefix('memory://')}/last/{_zero_file(0)}"
    fs.pipe_file(key, buf.getvalue())
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        with pytest.raises(fastckpt.ConfigError) as info:
            ck.save({"w": torch.ones(4), "version": 1}, f"{root}/last/{_zero_file(0)}", group=f"{root}/last")
    assert f"{root}/last holds a tag DeepSpeed's own engine saved ({_zero_file(0)})" in str(info.value)
    assert "Remove it first (Checkpointer.remove), or save under a new tag" in str(info.value)
    assert fs.cat_file(key) == buf.getvalue()
