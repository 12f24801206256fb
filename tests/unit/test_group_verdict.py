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


def test_a_rank_reading_minutes_later_counts_a_newer_commits_pointer(tmp_path: Path, monkeypatch) -> None:
    """Group A was published two minutes ago and ``latest`` has since moved on to B, committed
    later (every clock right). A rank that reads A's outcome now (at its deadline: rank 0's tell
    failed) takes B's pointer for a newer checkpoint, so A is committed. 027d50a judged it against
    A's ``committed_at``, which B's date is more than ``AHEAD_S`` past: A read as not committed,
    while rank 0 had reported it committed (a diff review's reproducer)."""
    from fastckpt.commit.pointing import moved
    from tests.helpers import place

    def group(name: str) -> tuple[Path, dict]:
        g = tmp_path / name
        g.mkdir()
        (g / "r0.bin").write_bytes(b"x" * 8)
        P.write_marker(place(g), 0, 1, {"r0.bin": {"size": 8, "checksum": "c0"}})
        return g, P.read_markers(place(g))

    now = time.time()
    ga, ma = group("global_step100")
    monkeypatch.setattr(time, "time", lambda: now - 120)  # A: requested and published two minutes ago
    man_a = P.publish_group(place(ga), 1, ma, {"step": 100}, requested_at=now - 125)
    monkeypatch.undo()
    gb, mb = group("global_step200")
    P.publish_group(place(gb), 1, mb, {"step": 200}, requested_at=now)
    assert (tmp_path / P.LATEST).read_text() == "global_step200"
    assert moved(place(ga), man_a)
