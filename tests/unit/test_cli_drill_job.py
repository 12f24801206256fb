"""The drill's built-in job (cli.drill_job) in this process: what its restart does before the
``loaded`` line, where the drill's RTO ends. Its training loop is replaced by a spy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.cli import drill_job


def _run(monkeypatch: pytest.MonkeyPatch, home: Path) -> tuple[list[str], dict]:
    """Start the job once: the order of its lines and of its base builds, and the state it trains on."""
    seen: list[str] = []
    trained: dict = {}
    make_base, say = drill_job.make_base, drill_job.say

    def spy_base(nbytes: int, seed: int) -> dict[str, list[torch.Tensor]]:
        seen.append("make_base")
        return make_base(nbytes, seed)

    def spy_say(ev: str, **fields: object) -> None:
        seen.append(ev)
        say(ev, **fields)

    monkeypatch.setattr(drill_job, "make_base", spy_base)
    monkeypatch.setattr(drill_job, "say", spy_say)
    monkeypatch.setattr(drill_job, "train", lambda ck, args, state, step: trained.update(state=state, step=step))
    assert drill_job.main(["--dir", str(home), "--state-size", "64KiB"]) == 0
    return seen, trained


def test_the_restart_builds_the_synthetic_state_after_the_restore_it_times(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restarted job built its whole synthetic base (torch.randint over --state-size: about
    2.6 s per GiB) before it restored, so every RTO the drill reported held that time. The base
    is only needed for the exact-content check, after ``loaded``."""
    home = tmp_path / "home"
    seen, trained = _run(monkeypatch, home)  # fresh: the base is step 0's state
    assert seen == ["fresh", "make_base"] and trained["step"] == 0
    base, step = drill_job.make_base(64 << 10, 0), 5
    group = drill_job.group_path(str(home), step)
    with fastckpt.Checkpointer() as ck:
        for name, tensors in base.items():
            ck.save({"tensors": [t + step for t in tensors], "step": step}, f"{group}/{name}", group=group)
        ck.commit(group, step=step).wait(60)
    seen, trained = _run(monkeypatch, home)
    assert seen == ["loaded", "make_base", "restored"], seen
    assert trained["step"] == step and torch.equal(trained["state"]["model.pt"][0], base["model.pt"][0] + step)
