"""Crash-safe resume with Lightning: a real Trainer with FastCkptIO and a burst buffer, saving
every step, is SIGKILLed at random moments and resumed from ``FastCkptIO.latest(dirpath)``
each time (``_lightning_kill_worker.py``, one process per generation, forked by
``_fork_launcher.py`` from a process that imported torch, Lightning and torch._dynamo once: a
generation's own imports took 6 of its 8 s).

Every resume must load a whole checkpoint (verified; the weights after the restore hash to what
that checkpoint recorded when it was saved) that is no older than the newest checkpoint the
killed generation's event log reports verified at its home. The last generation ends with its
final checkpoint durable at its home and named by ``latest``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import fastckpt  # noqa: E402
from fastckpt.eventlog import read_events  # noqa: E402

from ._fork_launcher import launch  # noqa: E402

HERE = Path(__file__).parent
REPO = HERE.parent.parent
KILLS = 6
STEP_FILE = re.compile(r"step=(\d+)\.ckpt$")


def _events(log: Path) -> list:
    """A generation's events (``read_events`` skips the line a kill cut short)."""
    return read_events(str(log)) if log.exists() else []


def _verified_at_home(log: Path) -> list[int]:
    """Steps of the step=N.ckpt files a generation's log reports verified at their home."""
    return [int(m.group(1)) for e in _events(log)
            if e.name == "replicate" and not e.error and (m := STEP_FILE.search(e.path))]


def _last_event(log: Path) -> str:
    events = _events(log)
    return max(events, key=lambda e: e.end).name if events else "none"


@pytest.mark.slow
def test_sigkill_at_random_moments_always_resumes_lightning_from_a_whole_checkpoint(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]), OMP_NUM_THREADS="1")
    run = launch("tests.integration._lightning_kill_worker", 1, KILLS + 1, [str(tmp_path), str(KILLS)], env,
                 str(REPO), timeout_s=900)
    assert [g["exitcodes"] for g in run.generations] == [[-9]] * KILLS + [[0]], run.output[-8000:]
    floor = 0
    for gen in range(KILLS + 1):
        rec = json.loads((tmp_path / "gen" / f"g{gen}.json").read_text())
        if gen == 0 or rec["path"] is None:
            assert floor == 0 and rec["path"] is None, rec
        else:
            assert rec["weights_match"], rec
            assert rec["step"] == rec["saved_step"] >= floor, (rec, floor)
        floor = max([floor, *_verified_at_home(tmp_path / "events" / f"g{gen}.jsonl")])
    final = fastckpt.latest(str(tmp_path / "ckpt"))
    assert final is not None
    got = fastckpt.load(final, weights_only=False)
    assert got["global_step"] == (rec["step"] + 4), (final, got["global_step"], rec)
    resumed = [json.loads((tmp_path / "gen" / f"g{g}.json").read_text())["step"] for g in range(1, KILLS + 1)]
    assert sum(s > 0 for s in resumed) >= KILLS - 2, resumed  # most generations got past a first save
    local = sorted(p.name for p in (tmp_path / "nvme").rglob("*.ckpt"))
    print(f"resumed at steps {resumed}; last durable floor {floor}; kills interrupted (last event logged): "
          f"{[_last_event(tmp_path / 'events' / f'g{g}.jsonl') for g in range(KILLS)]}; burst buffer: {local}")
