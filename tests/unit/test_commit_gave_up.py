"""A rank whose commit gave up waiting for rank 0's verdict has reported the group not
committed: a rank 0 that was only late must not publish that attempt afterwards
(``verdict.verdict`` with a store, ``fallback.wait_for_manifest`` without one). Else the
rank's next save of the group, in place while it is unpublished, replaces a file that the late
manifest names with the old checksum: a published checkpoint that fails verification.

Ranks are Checkpointers in this process, with a real TCPStore and without a store. Rank 1's
commit_timeout_s is short; each step waits for the previous one's outcome (no sleeps).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.commit import protocol as P
from fastckpt.errors import CommitTimeoutError
from fastckpt.testing import Fault, FaultyOps
from tests.helpers import close_all, latest, place

GAVE_UP = r"checkpoint group .*/G not committed: rank 1 gave up waiting \d+ s for rank 0"


def _cks(mode: str, world: int = 2) -> list[fastckpt.Checkpointer]:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60)) \
        if mode == "store" else None
    return [fastckpt.Checkpointer(rank=r, world_size=world, store=store, io_threads=1, overhead_budget=0.99,
                                  commit_timeout_s=0.2 if r == 1 else 60) for r in range(world)]


def _save(ck: fastckpt.Checkpointer, g: Path, version: int) -> fastckpt.SaveHandle:
    state = {"w": torch.full((256,), float(version)), "version": version, "rank": ck.rank}
    return ck.save(state, str(g / f"rank{ck.rank}.pt"), group=str(g))


def _versions(g: Path) -> list[int]:
    m = P.read_group_manifest(place(str(g)))
    assert m is not None and sorted(m["files"]) == ["rank0.pt", "rank1.pt"]
    return [fastckpt.load(str(g / f"rank{r}.pt"))["version"] for r in (0, 1)]  # verified against the manifest


def _agree_on_a_session(cks: list[fastckpt.Checkpointer], root: Path) -> None:
    """A first group committed by both ranks (with a store: the session is agreed then)."""
    warm = root / "warm"
    for ck in cks:
        ck.save({"x": torch.zeros(4)}, str(warm / f"rank{ck.rank}.pt"), group=str(warm)).wait(60)
    for h in [ck.commit(str(warm)) for ck in cks]:
        h.wait(60)


@pytest.mark.parametrize("mode", ["no store", "store"])
@pytest.mark.parametrize("published", [False, True], ids=["new group", "re-saved group"])
def test_a_late_rank_0_never_publishes_an_attempt_a_rank_gave_up_on(tmp_path: Path, mode: str,
                                                                     published: bool) -> None:
    cks = _cks(mode)
    root = tmp_path / "run"
    g = root / "G"
    try:
        _agree_on_a_session(cks, root)
        if published:  # the group is published already: its attempts are staged beside it
            for ck in cks:
                _save(ck, g, 0).wait(60)
            for h in [cks[0].commit(str(g)), cks[1].commit(str(g))]:  # rank 1's timeout is short: 0 first
                h.wait(60)
        for ck in cks:
            _save(ck, g, 1).wait(60)
        with pytest.raises(CommitTimeoutError, match="rank 0 did not publish"):
            cks[1].commit(str(g)).wait(60)  # rank 0 is late: it has not even called commit yet
        _save(cks[1], g, 2).wait(60)  # rank 1 saves the group again: a new file where version 1's was
        with pytest.raises(CommitTimeoutError, match=GAVE_UP) as info:
            cks[0].commit(str(g)).wait(60)  # late: it must not publish version 1 now
        assert "raise commit_timeout_s" in str(info.value)
        if published:
            assert _versions(g) == [0, 0]
        else:
            assert P.read_group_manifest(place(str(g))) is None
        assert latest(str(root)) == str(g if published else root / "warm")
        _save(cks[0], g, 2).wait(60)  # both ranks' next attempt publishes version 2 of both files
        for h in [cks[0].commit(str(g)), cks[1].commit(str(g))]:
            h.wait(60)
        assert _versions(g) == [2, 2]
        assert latest(str(root)) == str(g)
        if mode == "no store":  # only the published attempt's claim is left: the failed one's was swept
            m = P.read_group_manifest(place(str(g)))
            assert [n for n in place(str(g)).names(P.MARKER_DIR) if n.startswith("claim-")] == \
                [f"claim-{m['attempt']}.json"]
    finally:
        close_all(cks)


@pytest.mark.parametrize("mode", ["no store", "store"])
def test_rank_0_names_the_ranks_that_held_up_the_attempt_a_rank_gave_up_on(tmp_path: Path, mode: str) -> None:
    cks = _cks(mode, world=3)
    root = tmp_path / "run"
    g = root / "G"
    try:
        _agree_on_a_session(cks, root)
        for ck in cks[:2]:  # rank 2 is stuck before its save
            _save(ck, g, 1).wait(60)
        with pytest.raises(CommitTimeoutError, match="rank 0 did not publish"):
            cks[1].commit(str(g)).wait(60)
        with pytest.raises(CommitTimeoutError, match=GAVE_UP) as info:
            cks[0].commit(str(g)).wait(60)
        assert info.value.__notes__ == ["ranks [2] of 3 had not committed by then"]
        assert P.read_group_manifest(place(str(g))) is None
    finally:
        close_all(cks)


@contextlib.contextmanager
def _rank_1_gives_up_after_rank_0s_claim(tmp_path: Path, ops0: FaultyOps) -> Iterator[tuple[Path, list]]:
    """Without a store: both ranks saved the group; rank 0 has claimed the attempt
    (``commit/claim.py``) and is about to write the manifest when rank 1's wait runs out and its
    own claim (which loses) goes. Yields the group and both commits' handles, both ranks let go."""
    ops1 = FaultyOps()
    cks = [fastckpt.Checkpointer(rank=r, world_size=2, io_threads=1, overhead_budget=0.99, ops=ops,
                                 commit_timeout_s=0.2 if r == 1 else 60) for r, ops in enumerate((ops0, ops1))]
    g = tmp_path / "run" / "G"
    try:
        for ck in cks:
            _save(ck, g, 1).wait(60)
        manifest = ops0.gate("write_small", path_contains=P.GROUP_MANIFEST)  # rank 0, after its claim
        claim = ops1.gate("link", path_contains="claim-")  # rank 1's claim, once its wait ran out
        commits = [ck.commit(str(g)) for ck in cks]
        assert manifest.wait_entered(60)
        assert claim.wait_entered(60)
        claim.open()
        manifest.open()
        yield g, commits
    finally:
        close_all(cks)


def test_a_rank_that_gives_up_after_rank_0_claimed_the_attempt_waits_for_its_manifest(tmp_path: Path) -> None:
    """Rank 1's own claim loses, so it waits for the manifest once more, and its commit succeeds
    with rank 0's."""
    with _rank_1_gives_up_after_rank_0s_claim(tmp_path, FaultyOps()) as (g, commits):
        for h in commits:
            h.wait(60)
        assert _versions(g) == [1, 1]


def test_a_rank_0_that_fails_after_its_claim_tells_the_others_at_once(tmp_path: Path) -> None:
    """Without a store rank 0 claims the attempt before it checks the files and writes the
    manifest. A storage error after the claim (EIO on the manifest's rename) recorded no outcome:
    the other ranks took the claim for "rank 0 is publishing it" and waited a second
    commit_timeout_s, then reported a timeout. Now they fail with rank 0's error at once."""
    ops0 = FaultyOps([Fault("replace", errno.EIO, path_contains=P.GROUP_MANIFEST)])
    cks = [fastckpt.Checkpointer(rank=r, world_size=2, io_threads=1, overhead_budget=0.99, commit_timeout_s=600,
                                 ops=ops0 if r == 0 else None) for r in range(2)]
    g = tmp_path / "run" / "G"
    try:
        for ck in cks:
            _save(ck, g, 1).wait(60)
        handles = [ck.commit(str(g)) for ck in cks]
        with pytest.raises(OSError, match="Input/output error"):
            handles[0].wait(60)
        with pytest.raises(CommitTimeoutError, match="Input/output error") as info:
            handles[1].wait(60)  # before: after 600 s, "rank 0 claimed the attempt ... its manifest did not follow"
        assert "did not follow" not in str(info.value)
        assert P.read_group_manifest(place(str(g))) is None and latest(tmp_path / "run") is None
    finally:
        close_all(cks)


def test_a_rank_that_gives_up_after_rank_0_claimed_learns_rank_0s_failure_at_once(tmp_path: Path) -> None:
    """As above, but rank 0's manifest then fails (EIO). Rank 1 polled for the manifest only,
    so it waited a second commit_timeout_s and said "its manifest did not follow"; it now stops
    at rank 0's recorded outcome and names rank 0's error."""
    ops0 = FaultyOps([Fault("replace", errno.EIO, path_contains=P.GROUP_MANIFEST)])
    with _rank_1_gives_up_after_rank_0s_claim(tmp_path, ops0) as (g, commits):
        with pytest.raises(OSError, match="Input/output error"):
            commits[0].wait(60)
        with pytest.raises(CommitTimeoutError, match="Input/output error") as info:
            commits[1].wait(60)
        assert "did not follow" not in str(info.value)
        assert P.read_group_manifest(place(str(g))) is None
