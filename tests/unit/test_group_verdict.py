"""``commit.verdict``: what a rank concludes from the home's manifest when rank 0's outcome could
not reach it through the store."""

from __future__ import annotations

import threading
import time
from pathlib import Path

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
    homes = Homes()
    try:
        home = homes.resolve(str(tmp_path / "step_100")).place()
        m = P.read_group_manifest(home)
        ch = StoppedStore()
        att = Attempt(group=str(tmp_path / "step_100"), home=home, place=home, local=(), channel=ch,
                      token=m["attempt"], old=None)
        said = verdict(att, ch, 1, m["files"], time.monotonic() + 5, threading.Event(), 5)
    finally:
        homes.close()
    assert said.startswith(S.PUBLISHED)
