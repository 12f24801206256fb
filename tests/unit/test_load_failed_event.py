"""A load that raises is an event: the log, ``fastckpt report`` and fastckpt_failures_total show it.

Before, ``Checkpointer.load`` emitted its ``load`` event only when the load returned: a corrupt
checkpoint (the restore of a restarted job) left no trace in the log, the report said
"failures: none" and exited 0, and no exporter counted it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.errors import CheckpointNotFoundError, CorruptCheckpointError


def _damaged(tmp_path: Path) -> Path:
    path = tmp_path / "home" / "a.pt"
    with fastckpt.Checkpointer() as ck:
        ck.save({"w": torch.randn(1 << 16)}, str(path)).wait()
    with open(path, "r+b") as f:  # one damaged region in the tensor data
        f.seek(5000)
        f.write(b"\xff\xfe\xfd\xfc")
    return path


def _events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_a_failed_load_is_an_event_and_a_failure_metric(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    from tests.integration._scrape import scrape, value

    path, log = _damaged(tmp_path), tmp_path / "ev.jsonl"
    with fastckpt.Checkpointer(event_log=str(log), metrics_port=0) as ck:
        with pytest.raises(CorruptCheckpointError):
            ck.load(str(path))
        with pytest.raises(CheckpointNotFoundError):
            ck.load(str(tmp_path / "home" / "never.pt"))
        samples = scrape(ck.metrics_url)
        assert ck.stats().last_restore_s is None  # no restore happened
    loads = [e for e in _events(log) if e["name"] == "load"]
    assert [(e["path"], e["tier"], e["error"].split("(")[0], e["bytes"]) for e in loads] == [
        (str(path), "path", "CorruptCheckpointError", 0),
        (str(tmp_path / "home" / "never.pt"), "path", "CheckpointNotFoundError", 0)]
    assert all(e["end"] >= e["start"] for e in loads)
    for err in ("CorruptCheckpointError", "CheckpointNotFoundError"):
        assert value(samples, "fastckpt_failures_total", phase="load", error=err, tier="path", rank="0") == 1
    assert value(samples, "fastckpt_load_seconds_count") is None  # the RTO is of the loads that returned


def test_report_lists_a_failed_load_and_exits_1(tmp_path: Path) -> None:
    """docs/report.md: exit 1 when a load failed (a checkpoint the job could not restore)."""
    path, log = _damaged(tmp_path), tmp_path / "ev.jsonl"
    with fastckpt.Checkpointer(event_log=str(log)) as ck:
        with pytest.raises(CorruptCheckpointError):
            ck.load(str(path))
    res = subprocess.run([sys.executable, "-m", "fastckpt.cli", "report", str(log), "--json"],
                         capture_output=True, text=True)
    assert res.returncode == 1, res.stdout + res.stderr
    out = json.loads(res.stdout)
    assert out["failures"] == {"load: CorruptCheckpointError": 1} and out["loads"]["count"] == 0
    text = subprocess.run([sys.executable, "-m", "fastckpt.cli", "report", str(log)], capture_output=True, text=True)
    assert text.returncode == 1 and "failures: load: CorruptCheckpointError x1" in text.stdout, text.stdout


def test_a_group_changed_during_a_reading_is_no_failed_load(tmp_path: Path) -> None:
    """``GroupChangedError`` asks to load the group again (DeepSpeed's loads retry it themselves): the
    loads that follow are the restore, so it logs no failed load and report exits 0."""
    from fastckpt.errors import GroupChangedError

    g, log = tmp_path / "step-1", tmp_path / "ev.jsonl"

    def save(v: int) -> None:
        cks = [fastckpt.Checkpointer(rank=r, world_size=2, commit_timeout_s=60) for r in (0, 1)]
        try:
            for ck in cks:
                ck.save({"v": v}, str(g / f"r{ck.rank}.pt"), group=str(g))
            for h in [ck.commit(str(g), step=v) for ck in cks]:
                h.wait(60)
        finally:
            for ck in cks:
                ck.close()

    save(1)
    with fastckpt.Checkpointer(event_log=str(log)) as ck:
        with pytest.raises(GroupChangedError), ck.reading(str(g)):
            ck.load(str(g / "r0.pt"))
            save(2)  # another job saves the group again between the two loads of one reading
            ck.load(str(g / "r1.pt"))
        with ck.reading(str(g)):  # loaded again, whole
            assert [ck.load(str(g / f"r{r}.pt"))["v"] for r in (0, 1)] == [2, 2]
    assert [e["error"] for e in _events(log) if e["name"] == "load"] == [None, None, None]
    res = subprocess.run([sys.executable, "-m", "fastckpt.cli", "report", str(log)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
