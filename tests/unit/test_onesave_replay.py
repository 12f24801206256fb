"""The event-log replays count a ``Checkpointer.one_save()`` block as one save, as the live monitor does.

``fastckpt report``, ``fastckpt serve-metrics`` and ``fastckpt plan --from-run`` read one ``snapshot``
event per file: a checkpoint of three files was three saves there, milliseconds apart, so the replay
raised the overhead alarm (report exited 1) that the job, which counted one save, never raised, and
plan took the gap between two files for the interval. The files' snapshots now name their block and
the block logs a ``one_save`` event when it ends. Real Checkpointer, real event log, the real CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import fastckpt
from fastckpt.cli import cli
from fastckpt.eventlog import read_events

FILES = ("model", "optim", "extra")
MIB = 1 << 20


def _run(*args: str):
    return CliRunner().invoke(cli, list(args))


def _save_blocks(tmp_path: Path, blocks: int, local_dir: str | None) -> tuple[Path, fastckpt.Stats]:
    """``blocks`` checkpoints of three 1 MiB files each, saved back to back in one_save() blocks."""
    log = tmp_path / "events.jsonl"
    bb = str(tmp_path / local_dir) if local_dir else None
    with fastckpt.Checkpointer(local_dir=bb, event_log=str(log)) as ck:
        for step in range(blocks):
            with ck.one_save():
                for name in FILES:
                    ck.save({"w": torch.full((MIB // 4,), step, dtype=torch.int32)},
                            str(tmp_path / "ckpt" / str(step) / f"{name}.pt"))
        ck.wait()
        stats = ck.stats()
    return log, stats


@pytest.fixture(params=[None, "bb"], ids=["direct", "burst buffer"])
def one_block(tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    log, stats = _save_blocks(tmp_path, 1, request.param)
    assert (stats.saves, stats.alarms, stats.over_budget) == (1, 0, False)  # the live monitor: one save, no alarm
    return log


def test_the_log_names_the_block_on_its_files_and_ends_it_after_them(one_block: Path) -> None:
    events = read_events(str(one_block))
    snaps = [e for e in events if e.name == "snapshot"]
    [end] = [e for e in events if e.name == "one_save"]
    assert len(snaps) == 3 and {e.block for e in snaps} == {end.block} and end.block is not None
    assert (end.bytes, end.detail) == (3 * MIB, "files=3")
    assert events.index(end) > max(events.index(e) for e in snaps)  # read_events' order (by start) too
    assert all(e.block is None for e in events if e.name not in ("snapshot", "one_save"))


def test_report_shows_one_save_and_no_alarm(one_block: Path) -> None:
    res = _run("report", str(one_block), "--json")
    assert res.exit_code == 0, res.output  # was 1: the alarm fired on the 2nd and 3rd file
    out = json.loads(res.output)
    assert (out["saves"], out["files"], out["alarms"], out["failed"], out["pending"]) == (1, 3, 0, 0, 0), out
    [rank] = out["ranks"]
    assert (rank["saves"], rank["alarms"], rank["overhead"]) == (1, 0, None), rank  # no check on one save
    assert out["blocked_s"]["count"] == 1 and out["blocked_s"]["max"] == pytest.approx(rank["blocked_s"])
    text = _run("report", str(one_block))
    assert text.exit_code == 0 and text.output.startswith("1 saves (3 files: "), text.output
    assert "0 alarm(s), 1 saves blocked" in text.output


def test_serve_metrics_shows_one_save_and_no_alarm(one_block: Path) -> None:
    res = _run("serve-metrics", "--event-log", str(one_block), "--once")
    assert res.exit_code == 0, res.output
    saves = re.findall(r'^fastckpt_saves_total\{rank="0",tier="\w+"\} (\S+)$', res.output, re.M)
    assert [float(n) for n in saves] == [1.0], res.output  # was 3.0
    assert re.search(r'^fastckpt_save_blocked_seconds_count\{rank="0",tier="\w+"\} 1\.0$', res.output, re.M)
    assert re.search(r'^fastckpt_overhead_alarms_total\{rank="0"\} 0\.0$', res.output, re.M), res.output  # was 1.0
    status = _run("serve-metrics", "--event-log", str(one_block), "--once", "--json")
    [rank] = json.loads(status.output)["ranks"]
    assert (rank["alarms"], rank["over_budget"]) == (0, False), rank


def test_plan_from_run_takes_the_block_for_one_checkpoint(one_block: Path) -> None:
    res = _run("plan", "--from-run", str(one_block), "--json")
    assert res.exit_code in (0, 1), res.output
    measured = json.loads(res.output)["measured"]
    # was 3 checkpoints of 1 MiB, every few ms: the interval the plan then used was the gap between two files
    assert (measured["checkpoints"], measured["state_bytes"], measured["interval_s"]) == (1, 3 * MIB, None), measured


def test_two_blocks_back_to_back_replay_the_alarm_the_live_monitor_raised(tmp_path: Path) -> None:
    """The replay is the Monitor's rule: two checkpoints with no training between them are above
    the budget, live and replayed alike, each counted once with its three files' blocked time."""
    log, stats = _save_blocks(tmp_path, 2, None)
    assert (stats.saves, stats.alarms) == (2, 1)
    res = _run("report", str(log), "--json")
    assert res.exit_code == 1, res.output  # the alarm
    out = json.loads(res.output)
    [rank] = out["ranks"]
    assert (out["saves"], out["files"], rank["saves"], rank["alarms"]) == (2, 6, 2, 1), out
    assert out["blocked_s"]["count"] == 2
    measured = json.loads(_run("plan", "--from-run", str(log), "--json").output)["measured"]
    assert (measured["checkpoints"], measured["state_bytes"]) == (2, 3 * MIB), measured
    metrics = _run("serve-metrics", "--event-log", str(log), "--once").output
    assert re.search(r'^fastckpt_saves_total\{rank="0",tier="direct"\} 2\.0$', metrics, re.M), metrics
    assert re.search(r'^fastckpt_overhead_alarms_total\{rank="0"\} 1\.0$', metrics, re.M), metrics


def test_a_log_without_blocks_replays_each_file_as_a_save_as_before(tmp_path: Path) -> None:
    """A log written before blocks were logged: no ``block``, no ``one_save`` event."""
    log, _ = _save_blocks(tmp_path, 1, None)
    old = tmp_path / "old.jsonl"
    lines = [json.loads(ln) for ln in log.read_text().splitlines()]
    old.write_text("".join(json.dumps({k: v for k, v in d.items() if k != "block"}) + "\n"
                           for d in lines if d["name"] != "one_save"))
    res = _run("report", str(old), "--json")
    out = json.loads(res.output)
    assert (res.exit_code, out["saves"], out["files"], out["alarms"]) == (1, 3, 3, 1), out
    assert json.loads(_run("plan", "--from-run", str(old), "--json").output)["measured"]["checkpoints"] == 3


def test_every_rank_of_a_large_job_keeps_its_open_block() -> None:
    """At each checkpoint every rank has a block open at once: a cap over all of them (1,024) dropped
    the open blocks of a larger job's ranks, whose saves then vanished from the replay."""
    from fastckpt.events import Event
    from fastckpt.replay import Blocks

    blocks, ranks = Blocks(), 1100
    for f in range(2):  # each rank's two files, interleaved across ranks as a merged log is
        for r in range(ranks):
            blocks.add(Event("snapshot", r, f"/c/{r}/{f}.pt", 10, 1.0 + f, 1.5 + f, "direct", session="s",
                             block=f"b{r}"))
    closed = [blocks.close(Event("one_save", r, f"/c/{r}/0.pt", 20, 9.0, 9.0, "direct", session="s",
                                 block=f"b{r}")) for r in range(ranks)]
    assert all(b is not None and b.files == 2 and b.bytes == 20 for b in closed)
    for i in range(40):  # a Checkpointer killed in blocks over and over keeps its newest few
        blocks.add(Event("snapshot", 0, "/c/x.pt", 1, i, i, "direct", session="k", block=f"k{i}"))
    assert blocks.close(Event("one_save", 0, "/c/x.pt", 1, 99, 99, "direct", session="k", block="k39")) is not None
    assert blocks.close(Event("one_save", 0, "/c/x.pt", 1, 99, 99, "direct", session="k", block="k0")) is None
