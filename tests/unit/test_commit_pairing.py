"""Each rank's commit of a group pairs with the other ranks' commit of the same save: a commit made
again on one rank alone and ranks that commit different steps never publish a group that mixes
two saves, nor one with a rank's step silently replaced; the ranks' commits pair again after, and
a rank with nothing new to save at a commit keeps committing. Simulated ranks in one process, with
a real TCPStore and without one (marker files)."""

from __future__ import annotations

import datetime
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.errors import ConfigError, FastCkptError
from tests.helpers import close_all, latest

QUICK_S = 60  # a commit that pairs ends in well under this


@pytest.fixture(params=["store", "no store"])
def store(request: pytest.FixtureRequest) -> Iterator[object | None]:
    yield dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60)) \
        if request.param == "store" else None


def _ck(rank: int, store: object | None, timeout_s: float = 120) -> fastckpt.Checkpointer:
    return fastckpt.Checkpointer(rank=rank, world_size=2, store=store, commit_timeout_s=timeout_s,
                                 overhead_budget=0.99)


def _save(ck: fastckpt.Checkpointer, g: Path, step: int) -> None:
    ck.save({"step": step, "w": torch.full((8,), float(step))}, str(g / f"r{ck.rank}.pt"), group=str(g))


def _published(g: Path) -> tuple[int, dict[str, int]] | None:
    """The published manifest's step, and the step each file it names was saved at."""
    if not (g / "fastckpt-manifest.json").exists():
        return None
    m = json.loads((g / "fastckpt-manifest.json").read_text())
    return m["step"], {f: fastckpt.load(str(g / f))["step"] for f in sorted(m["files"])}


def _step(cks: list[fastckpt.Checkpointer], g: Path, step: int, savers: tuple[int, ...] = (0, 1)) -> list:
    """One save of the group on every rank (those in ``savers`` save a file): each rank's outcome."""
    for ck in cks:
        if ck.rank in savers:
            _save(ck, g, step)
    handles = [ck.commit(str(g), step=step) for ck in cks]
    out: list = []
    for h in handles:
        try:
            out.append(h.wait(QUICK_S))
        except FastCkptError as exc:
            out.append(exc)
    return out


def _whole(g: Path, step: int, savers: tuple[int, ...] = (0, 1)) -> None:
    assert _published(g) == (step, {f"r{r}.pt": step for r in savers})


def _run(cks: list[fastckpt.Checkpointer], g: Path, plans: list[list[tuple[int, bool]]]) -> tuple[list, list]:
    """Each rank on a thread of its own (as its own process would): for each (step, saves) of its
    plan, save its file (if it saves) and commit, waiting for the commit. Returns each rank's
    outcomes, and what was published after each commit rank 0 completed."""
    outcomes: list[list] = [[] for _ in cks]
    published: list = []

    def rank(ck: fastckpt.Checkpointer) -> None:
        for step, saves in plans[ck.rank]:
            if saves:
                _save(ck, g, step)
            try:
                outcomes[ck.rank].append(ck.commit(str(g), step=step).wait(QUICK_S))
                if ck.rank == 0:
                    published.append(_published(g))
            except FastCkptError as exc:
                outcomes[ck.rank].append(exc)

    threads = [threading.Thread(target=rank, args=(ck,)) for ck in cks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes, published


@pytest.mark.parametrize("again", [1, 0])
def test_a_commit_made_again_on_one_rank_never_publishes_a_mix_and_the_ranks_pair_again(
        tmp_path: Path, store: object | None, again: int) -> None:
    # Before: rank 1's second commit of step 1 paired with rank 0's commit of step 2 (published
    # without r1.pt), its commit of step 2 with rank 0's of step 3 (r1.pt of step 2 published beside
    # r0.pt of step 3, as step 3), and so on: every later publication mixed two saves.
    g = tmp_path / "last"
    cks = [_ck(r, store, timeout_s=20) for r in (0, 1)]
    try:
        steps = [(s, True) for s in range(1, 7)]
        plans = [steps, steps]
        plans[again] = steps[:1] + [(1, False)] + steps[1:]  # this rank commits step 1 again, alone
        outcomes, published = _run(cks, g, plans)
        for p in published:
            assert p is not None and set(p[1].values()) == {p[0]}  # never files of two saves
        said = f"step={2 if again else 1} on ranks [0]; step={1 if again else 2} on ranks [1]"
        for err in (outcomes[again][1], outcomes[1 - again][1]):  # its second step 1, the other's step 2
            assert isinstance(err, ConfigError)
            assert f"different steps ({said})" in str(err)
            assert f"Ranks [{again}] committed a step committed before" in str(err)
        # its commit of step 2 (the other rank's refused just before) fails at once, alone
        assert isinstance(outcomes[again][2], ConfigError)
        assert "with no attempt begun" in str(outcomes[again][2])
        assert [type(o).__name__ for o in outcomes[again][3:]] == ["SaveRecord"] * 4  # steps 3-6 pair again
        assert [type(o).__name__ for o in outcomes[1 - again][2:]] == ["SaveRecord"] * 4
        _whole(g, 6)
    finally:
        close_all(cks)


def test_a_rank_behind_with_nothing_to_save_that_commits_before_its_retry_ends_pairs_again(
        tmp_path: Path, store: object | None) -> None:
    """Rank 1 saves nothing into ``last`` (rank 0 writes it) and commits every step; it commits
    step 1 again alone, then step 2 without waiting for that retry (commits are asynchronous).
    Before: its step-2 commit was read as not behind before the retry's refusal was known, ran
    as an attempt of its own (with a store: the no-store protocol, a commit_timeout_s wait blaming
    rank 0), and steps 3-5 failed on both ranks, rank 0 then refused as "behind". Its step-2
    commit now fails at once, and every later step publishes."""
    g = tmp_path / "last"
    cks = [_ck(r, store, timeout_s=20) for r in (0, 1)]
    outcomes: list[list] = [[], []]

    def wait(rank: int, handle) -> None:  # noqa: ANN001
        try:
            outcomes[rank].append(handle.wait(QUICK_S))
        except FastCkptError as exc:
            outcomes[rank].append(exc)

    def rank0() -> None:
        for s in range(1, 6):
            cks[0].save({"step": s}, str(g / "r0.pt"), group=str(g))
            wait(0, cks[0].commit(str(g), step=s))

    def rank1() -> None:
        wait(1, cks[1].commit(str(g), step=1))
        retry, nxt = cks[1].commit(str(g), step=1), cks[1].commit(str(g), step=2)
        wait(1, retry)
        wait(1, nxt)
        for s in range(3, 6):
            wait(1, cks[1].commit(str(g), step=s))

    threads = [threading.Thread(target=f) for f in (rank0, rank1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert isinstance(outcomes[1][2], ConfigError) and "with no attempt begun" in str(outcomes[1][2])
        assert [type(o).__name__ for o in outcomes[0][2:]] == ["SaveRecord"] * 3, outcomes[0]  # steps 3-5
        assert [type(o).__name__ for o in outcomes[1][3:]] == ["SaveRecord"] * 3, outcomes[1]
        _whole(g, 5, savers=(0,))
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
        said = r"different steps \(step=100 on ranks \[0\]; step=200 on ranks \[1\]\)"
        for h in handles:
            with pytest.raises(ConfigError, match=said):
                h.wait(QUICK_S)
        assert _published(g) is None
        assert latest(str(tmp_path)) is None
        assert all(not isinstance(o, Exception) for o in _step(cks, g, 300))  # the next commit pairs at once
        _whole(g, 300)
    finally:
        close_all(cks)


def test_a_rank_with_nothing_new_to_save_keeps_committing(tmp_path: Path, store: object | None) -> None:
    # The revert of the first attempt at this: a rank that saved nothing since its last commit was
    # refused, so with a store every later commit failed on both ranks.
    g = tmp_path / "last"
    cks = [_ck(r, store) for r in (0, 1)]
    try:
        assert all(not isinstance(o, Exception) for o in _step(cks, g, 1))
        for s in (2, 3, 4):  # rank 1 has nothing new to save, several commits in a row
            assert all(not isinstance(o, Exception) for o in _step(cks, g, s, savers=(0,)))
            _whole(g, s, savers=(0,))
        assert all(not isinstance(o, Exception) for o in _step(cks, g, 5))
        _whole(g, 5)
        for _ in range(3):  # and without a step, one group committed again and again
            _step_unnumbered(cks, tmp_path / "unnumbered")
    finally:
        close_all(cks)


def _step_unnumbered(cks: list[fastckpt.Checkpointer], g: Path) -> None:
    cks[0].save({"w": torch.zeros(2)}, str(g / "r0.pt"), group=str(g))
    for h in [ck.commit(str(g)) for ck in cks]:
        h.wait(QUICK_S)  # raises if it did not commit


def test_a_checkpointer_made_again_on_one_rank_is_named_on_every_rank(tmp_path: Path) -> None:
    # Before: its commits, counted anew, never met rank 0's, and both ranks failed every later commit
    # blaming the other ("rank 0 did not answer ... or it died", "ranks [1] ... did not commit").
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    cks = [_ck(r, store, timeout_s=2) for r in (0, 1)]
    try:
        assert all(not isinstance(o, Exception) for o in _step(cks, tmp_path / "step1", 1))
        cks[1].close()
        cks[1] = _ck(1, store, timeout_s=2)  # on rank 1 alone
        out = _step(cks, tmp_path / "step2", 2)
        assert "ranks [1] asked for a new store session after every rank had agreed one" in str(out[0])
        assert "an earlier Checkpointer of this process agreed a store session as rank 1" in str(out[1])
        for err in out:
            assert "Make the Checkpointer again on every rank, rank 0 too" in str(err)
        close_all(cks)
        cks = [_ck(r, store) for r in (0, 1)]  # made again on every rank: commits again
        assert all(not isinstance(o, Exception) for o in _step(cks, tmp_path / "step3", 3))
        _whole(tmp_path / "step3", 3)
    finally:
        close_all(cks)
