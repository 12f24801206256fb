"""Each rank's commit of a group pairs with the other ranks' commit of the same save: a commit
retried on one rank, ranks that commit different steps, a bad step on one rank and a
Checkpointer made again on one rank never publish a group mixing saves, nor leave the ranks'
attempts out of step. Simulated ranks in one process, with a real TCPStore and without one."""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.errors import CheckpointWriteError, ConfigError
from tests.helpers import close_all, latest

QUICK_S = 30  # far below a commit's timeout where one is waited out


@pytest.fixture(params=["store", "no store"])
def store(request: pytest.FixtureRequest) -> Iterator[object | None]:
    yield dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60)) \
        if request.param == "store" else None


def _ck(rank: int, store: object | None, timeout_s: float = 120) -> fastckpt.Checkpointer:
    return fastckpt.Checkpointer(rank=rank, world_size=2, store=store, commit_timeout_s=timeout_s,
                                 overhead_budget=0.99)


def _save(ck: fastckpt.Checkpointer, g: Path, step: int) -> None:
    ck.save({"step": step, "w": torch.full((8,), float(step))}, str(g / f"r{ck.rank}.pt"), group=str(g))


def _commit_all(cks: list[fastckpt.Checkpointer], g: Path, step: int) -> None:
    for ck in cks:
        _save(ck, g, step)
    for h in [ck.commit(str(g), step=step) for ck in cks]:
        h.wait(QUICK_S)


def _published(g: Path) -> tuple[int, dict[str, int]]:
    """The published manifest's step, and the step each file it names was saved at."""
    m = json.loads((g / "fastckpt-manifest.json").read_text())
    return m["step"], {f: fastckpt.load(str(g / f))["step"] for f in sorted(m["files"])}


def test_a_commit_retried_on_one_rank_is_refused_and_never_pairs_with_the_next_save(
        tmp_path: Path, store: object | None) -> None:
    # Before: rank 1's extra commit began an attempt, which (numbered by rank 1 alone) joined rank 0's
    # commit of the next save: step 2 was published with r0.pt only, and the ranks stayed a commit apart.
    g = tmp_path / "last"
    cks = [_ck(r, store, timeout_s=5) for r in (0, 1)]
    try:
        _commit_all(cks, g, 1)
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match="rank 1 committed it already and saved nothing into it since"):
            cks[1].commit(str(g), step=1).wait(QUICK_S)  # rank 1 alone: nothing saved since
        assert time.monotonic() - t0 < 5  # at once: no attempt waited for the other rank
        _save(cks[0], g, 2)  # rank 0 went on meanwhile
        h0 = cks[0].commit(str(g), step=2)
        _save(cks[1], g, 2)
        cks[1].commit(str(g), step=2).wait(QUICK_S)
        h0.wait(QUICK_S)
        assert _published(g) == (2, {"r0.pt": 2, "r1.pt": 2})
        _commit_all(cks, g, 3)  # and the ranks' commits stay paired
        assert _published(g) == (3, {"r0.pt": 3, "r1.pt": 3})
    finally:
        close_all(cks)


def test_a_commit_retried_on_every_rank_is_refused_on_every_rank_at_once(tmp_path: Path,
                                                                         store: object | None) -> None:
    g = tmp_path / "last"
    cks = [_ck(r, store) for r in (0, 1)]
    try:
        _commit_all(cks, g, 1)
        handles = [ck.commit(str(g), step=1) for ck in cks]
        for rank, h in enumerate(handles):
            with pytest.raises(ConfigError, match=f"rank {rank} committed it already"):
                h.wait(QUICK_S)
        _commit_all(cks, g, 2)
        assert _published(g) == (2, {"r0.pt": 2, "r1.pt": 2})
    finally:
        close_all(cks)


def test_ranks_that_commit_different_steps_publish_nothing_and_say_which(tmp_path: Path,
                                                                        store: object | None) -> None:
    # Before: published with rank 0's step, silently.
    g = tmp_path / "ckpt"
    cks = [_ck(r, store) for r in (0, 1)]
    try:
        for ck in cks:
            _save(ck, g, 100)
        handles = [cks[0].commit(str(g), step=100), cks[1].commit(str(g), step=200)]
        said = r"different steps \(step=100 on ranks \[0\]; step=200 on ranks \[1\]"
        for h in handles:
            with pytest.raises(ConfigError, match=said):
                h.wait(QUICK_S)
        assert not (g / "fastckpt-manifest.json").exists()
        assert latest(str(tmp_path)) is None
        _commit_all(cks, g, 300)  # the next commit of the group pairs as before
        assert _published(g) == (300, {"r0.pt": 300, "r1.pt": 300})
    finally:
        close_all(cks)


def test_a_bad_step_on_one_rank_ends_the_attempt_on_every_rank_and_the_next_commits(
        tmp_path: Path, store: object | None) -> None:
    # Before: rank 0 waited commit_timeout_s, and with a store its attempt count stayed one ahead of
    # rank 1's: every later commit of the group failed on both ranks.
    g = tmp_path / "best"
    cks = [_ck(r, store, timeout_s=60) for r in (0, 1)]
    try:
        _commit_all(cks, g, 1)
        for ck in cks:
            _save(ck, g, 2)
        h0 = cks[0].commit(str(g), step=2)
        with pytest.raises(ConfigError, match=r"commit\(step=2.0\)"):
            cks[1].commit(str(g), step=2.0)
        with pytest.raises(CheckpointWriteError, match=r"rank 1: ConfigError: commit\(step=2.0\)"):
            h0.wait(QUICK_S)
        _commit_all(cks, g, 3)
        assert _published(g) == (3, {"r0.pt": 3, "r1.pt": 3})
        with pytest.raises(ConfigError, match=r"commit\(step=2.0\)"):  # a retry, nothing saved: no attempt to end
            cks[1].commit(str(g), step=2.0)
        _commit_all(cks, g, 4)
        assert _published(g) == (4, {"r0.pt": 4, "r1.pt": 4})
    finally:
        close_all(cks)


def test_a_bad_step_on_one_rank_alone_is_refused_before_anything(tmp_path: Path) -> None:
    g = tmp_path / "g"
    with fastckpt.Checkpointer() as ck:
        _save(ck, g, 1)
        with pytest.raises(ConfigError, match=r"commit\(step=-1\)"):
            ck.commit(str(g), step=-1)
        ck.commit(str(g), step=1).wait(QUICK_S)  # the same attempt, with a good step
    assert _published(g) == (1, {"r0.pt": 1})


def test_a_checkpointer_made_again_on_one_rank_is_named(tmp_path: Path) -> None:
    # Before: both ranks failed every later commit with "rank 0 did not answer ... or it died".
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    cks = [_ck(r, store, timeout_s=2) for r in (0, 1)]
    try:
        _commit_all(cks, tmp_path / "step1", 1)
        cks[1].close()
        cks[1] = _ck(1, store, timeout_s=2)  # on rank 1 only
        for ck in cks:
            _save(ck, tmp_path / "step2", 2)
        handles = [ck.commit(str(tmp_path / "step2"), step=2) for ck in cks]
        for h in handles:
            with pytest.raises(ConfigError, match=r"the Checkpointer of ranks \[1\] was made again"):
                h.wait(QUICK_S)
        close_all(cks)
        cks = [_ck(r, store) for r in (0, 1)]  # made again on every rank: commits again
        _commit_all(cks, tmp_path / "step3", 3)
        assert _published(tmp_path / "step3") == (3, {"r0.pt": 3, "r1.pt": 3})
    finally:
        close_all(cks)
