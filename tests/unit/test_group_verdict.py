"""``commit.verdict``: what a rank concludes from the home's manifest when rank 0's outcome could
not reach it through the store."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.commit import protocol as P
from fastckpt.commit import store as S
from fastckpt.commit.attempt import Attempt
from fastckpt.commit.verdict import verdict
from fastckpt.storage.homes import Homes


class StoppedStore:
    """The store stopped answering (rank 0's process hosted it)."""

    def hear(self, deadline: float, stop: threading.Event, label: str, waited_s: float) -> str:
        raise S.StoreError("the store stopped answering")


def _rank1_verdict(group: Path) -> str:
    """What rank 1 concludes about the published ``group`` when the store stopped answering."""
    homes = Homes()
    try:
        home = homes.resolve(str(group)).place()
        m = P.read_group_manifest(home)
        ch = StoppedStore()
        att = Attempt(group=str(group), home=home, place=home, local=(), channel=ch, token=m["attempt"], old=None)
        return verdict(att, ch, 1, m["files"], time.monotonic() + 5, threading.Event(), 5)
    finally:
        homes.close()


def test_a_group_published_before_latest_moved_on_to_a_newer_one_is_published(tmp_path: Path) -> None:
    """Commits of successive groups run at once: by the time a rank reads step_100's manifest,
    rank 0 may have published step_200 and moved ``latest`` past step_100. The rank reported
    the published step_100 "not committed" (286bb0f accepted only a ``latest`` naming it)."""
    with fastckpt.Checkpointer() as ck:
        for step in (100, 200):
            g = str(tmp_path / f"step_{step}")
            ck.save({"w": torch.arange(64) + step}, f"{g}/rank0.pt", group=g).wait()
            ck.commit(g, step=step).wait()
    assert fastckpt.latest(str(tmp_path)) == str(tmp_path / "step_200")
    assert _rank1_verdict(tmp_path / "step_100").startswith(S.PUBLISHED)


def test_a_pointer_dated_far_ahead_by_a_skewed_host_is_not_a_newer_checkpoint(tmp_path: Path) -> None:
    """``latest`` names a previous run's step_900, dated an hour ahead by a host whose clock ran
    ahead; rank 0 published step_100's manifest and died before moving ``latest`` (a move it would
    have made: ``order.holds``). A rank took the skewed pointer for a newer checkpoint and reported
    step_100 committed, while ``fastckpt.latest`` resumes from step_900."""
    with fastckpt.Checkpointer() as ck:
        for step in (900, 100):
            g = str(tmp_path / f"step_{step}")
            ck.save({"w": torch.arange(64) + step}, f"{g}/rank0.pt", group=g).wait()
            ck.commit(g, step=step).wait()
            if step == 900:  # dated by a host whose clock ran an hour ahead
                m = json.loads((tmp_path / g / P.GROUP_MANIFEST).read_text())
                m.pop("digest", None)
                m["requested_at"] = time.time() + 3600
                Path(g, P.GROUP_MANIFEST).write_bytes(P.manifest_bytes(m))
    (tmp_path / P.LATEST).write_text("step_900")  # rank 0 died before its move of latest
    assert fastckpt.latest(str(tmp_path)) == str(tmp_path / "step_900")
    with pytest.raises(S.StoreError, match="not latest: it is not committed"):
        _rank1_verdict(tmp_path / "step_100")


def _redate(group: Path, at: float) -> None:
    """Rewrite ``group``'s manifest as published (and requested) at ``at`` by rank 0's clock."""
    m = json.loads((group / P.GROUP_MANIFEST).read_text())
    m.update(requested_at=at, committed_at=at)
    (group / P.GROUP_MANIFEST).write_bytes(P.manifest_bytes(m))


def test_a_rank_judges_a_skewed_pointer_by_rank_0s_clock_not_its_own(tmp_path: Path) -> None:
    """Rank 0's clock is an hour behind rank 1's. ``latest`` names step_900, dated ten minutes after
    step_100 by rank 0's clock: far ahead of it, so rank 0's ``move_pointer`` moves ``latest`` past
    it (``order.holds``), and took it back when that move failed; rank 0 died before the move here.
    Rank 1 judged the pointer with its own clock (step_900 is in its past: a newer checkpoint) and
    reported step_100 committed. Every rank now judges against rank 0's clock when it published the
    group (its ``committed_at``): the move was still to come, so step_100 is not committed."""
    with fastckpt.Checkpointer() as ck:
        for step in (900, 100):
            g = str(tmp_path / f"step_{step}")
            ck.save({"w": torch.arange(64) + step}, f"{g}/rank0.pt", group=g).wait()
            ck.commit(g, step=step).wait()
    rank0_now = time.time() - 3600
    _redate(tmp_path / "step_100", rank0_now)
    _redate(tmp_path / "step_900", rank0_now + 600)
    (tmp_path / P.LATEST).write_text("step_900")  # rank 0 died before its move of latest
    with pytest.raises(S.StoreError, match="not latest: it is not committed"):
        _rank1_verdict(tmp_path / "step_100")
