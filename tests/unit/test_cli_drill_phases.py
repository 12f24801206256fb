"""Where the drill aims its kills and what it reads back: drill_phases on event logs."""

from __future__ import annotations

import random

import pytest

from fastckpt.cli import drill_phases as ph
from fastckpt.events import Event

FILES = ("model.pt", "optim.pt")


def ev(name: str, step: int, f: str | None, start: float, end: float, detail: str | None = None) -> Event:
    path = f"/home/step-{step:08d}" + (f"/{f}" if f else "")
    return Event(name, 0, path, 100, start, end, "nvme", None, detail)


def checkpoint(step: int, t: float) -> list[Event]:
    """One checkpoint saved at ``t``: snapshots 0-0.2, writes 0.1-0.4, renames, replicas 0.4-0.8, commit."""
    return [ev("snapshot", step, "model.pt", t, t + 0.1), ev("snapshot", step, "optim.pt", t + 0.1, t + 0.2),
            ev("write", step, "model.pt", t + 0.1, t + 0.2), ev("commit", step, "model.pt", t + 0.2, t + 0.21),
            ev("write", step, "optim.pt", t + 0.21, t + 0.4), ev("commit", step, "optim.pt", t + 0.4, t + 0.41),
            ev("replicate", step, "model.pt", t + 0.4, t + 0.6), ev("replicate", step, "optim.pt", t + 0.6, t + 0.8),
            ev("commit", step, None, t + 0.2, t + 0.9, "group")]


def test_windows_are_offsets_from_the_save_line() -> None:
    events = checkpoint(3, 100.0) + checkpoint(6, 102.0)
    w = ph.windows(events, saves={3: 100.0, 6: 102.0}, durables={3: 100.95, 6: 102.95})
    assert w.phases["snapshot"] == pytest.approx((0.0, 0.2))
    assert w.phases["write"] == pytest.approx((0.1, 0.4))
    assert w.phases["replicate"] == pytest.approx((0.4, 0.8))
    assert w.phases["commit"] == pytest.approx((0.8, 0.9))  # after the last replica
    assert w.idle == pytest.approx((0.0, 102.0 - 100.95))  # durable 3 to save 6


def test_no_windows_before_the_first_durable_checkpoint() -> None:
    assert ph.windows(checkpoint(3, 100.0), saves={3: 100.0}, durables={}) is None


def test_pick_aims_inside_the_window_and_skips_unseen_phases() -> None:
    w = ph.Windows({"write": (0.1, 0.4)}, None)
    rng = random.Random(0)
    anchor, delay = w.pick("write", rng)
    assert anchor == "save" and 0.1 <= delay <= 0.4
    assert w.pick("replicate", rng) is None and w.pick("idle", rng) is None


def test_in_progress_reads_the_phases_under_way() -> None:
    done = checkpoint(3, 100.0)
    saves, durables = {3: 100.0, 6: 102.0}, {3: 100.95}
    # step 6 died after the model's snapshot: the optim snapshot and the model write were running
    partial = [ev("snapshot", 6, "model.pt", 102.0, 102.1)]
    assert ph.in_progress(done + partial, saves, durables, FILES, True) == ("snapshot", "write")
    # both files written and renamed, one replica done: replicating
    partial = checkpoint(6, 102.0)[:7]
    assert ph.in_progress(done + partial, saves, durables, FILES, True) == ("replicate",)
    # everything but the group commit
    partial = checkpoint(6, 102.0)[:8]
    assert ph.in_progress(done + partial, saves, durables, FILES, True) == ("commit",)
    # without a burst buffer there is no replicate phase
    partial = checkpoint(6, 102.0)[:6]
    assert ph.in_progress(done + partial, saves, durables, FILES, False) == ("commit",)
    # the save line came, nothing else: snapshotting
    assert ph.in_progress(done, saves, durables, FILES, True) == ("snapshot",)


def test_nothing_in_flight_is_idle() -> None:
    assert ph.in_progress(checkpoint(3, 100.0), {3: 100.0}, {3: 100.95}, FILES, True) == ("idle",)


def test_step_of_path() -> None:
    assert ph.step_of_path("/a/step-00000042/model.pt") == 42
    assert ph.step_of_path("/a/other.pt") is None
    # a --dir (or its burst-buffer mirror) with a step-N of its own: the checkpoint's step counts
    assert ph.step_of_path("/scratch/step-7/ckpt/step-00000042/model.pt") == 42
    assert ph.step_of_path("/bb/scratch/step-7/ckpt/step-00000042") == 42
    assert ph.step_of_path("/a/my-step-3.pt") is None
