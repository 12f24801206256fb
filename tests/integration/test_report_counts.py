"""``fastckpt report`` and ``fastckpt serve-metrics`` on the same real event logs: the same saves,
counted by one rule (``replay.SaveCounter``); the budget and the clock each replays the alarm with; a log of
loads only; a lazy save whose job was killed before its ``fence`` event."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastckpt import Checkpointer
from fastckpt.units import fmt_bytes
from tests.cli_child import CliChild
from tests.integration._fork_server import ForkServer

from ._scrape import parse, value

pytest.importorskip("prometheus_client")

Cli = Callable[..., subprocess.CompletedProcess]

# Two lazy saves fenced, then a lazy save killed (kill -9) before its fence event was logged. With
# "block": a one_save() block of an eager file and a lazy one, killed once the block ended but before
# its lazy file's fence event was logged (a copy that outlasts the block; here its fence event is
# held back from the log instead, wherever its copy ends). The log is the Checkpointer's own
# JsonlSink, the one event_log= makes, behind a sink that stops at those points.
_KILLED_BEFORE_FENCE = """
import os, signal, sys, time, torch, fastckpt
from fastckpt.events import JsonlSink, start_detail
log, home, block = sys.argv[1], sys.argv[2], sys.argv[3] == "block"
jsonl = JsonlSink(log, start_detail(0.99, 3600.0, time.time()))

class KilledBeforeFence:
    def emit(self, ev):
        if ev.name == "fence" and ev.path.endswith("k.pt"):
            if not block:
                os.kill(os.getpid(), signal.SIGKILL)
            return
        jsonl.emit(ev)
        if ev.name == "one_save":
            os.kill(os.getpid(), signal.SIGKILL)

ck = fastckpt.Checkpointer(sinks=(KilledBeforeFence(),), overhead_budget=0.99)
for i in range(2):
    h = ck.save({"w": torch.randn(1000)}, f"{home}/s{i}.pt", lazy=True)
    ck.fence()
    h.wait()
if block:
    with ck.one_save():
        ck.save({"w": torch.randn(1000)}, f"{home}/b/a.pt").wait()
        ck.save({"w": torch.randn(1000)}, f"{home}/b/k.pt", lazy=True)
ck.save({"w": torch.randn(1000)}, f"{home}/k.pt", lazy=True)
ck.fence()
"""


@pytest.fixture
def cli(cli_child: CliChild) -> Cli:
    """``fastckpt ARGS`` in the child this module's command lines share."""
    return cli_child.run


def _killed_before_fence(torch_python: ForkServer, tmp_path: Path, block: bool) -> Path:
    log = tmp_path / "events.jsonl"
    r = torch_python.run_code(_KILLED_BEFORE_FENCE, [str(log), str(tmp_path / "home"), "block" if block else "alone"],
                              120)
    assert r.returncode == -9, r.stderr
    names = [json.loads(line)["name"] for line in log.read_text().splitlines()]
    assert (names.count("fence"), names.count("snapshot")) == (2, 4 if block else 3)
    assert ("one_save" in names) == block
    return log


def test_report_and_serve_metrics_count_the_same_saves(cli: Cli, torch_python: ForkServer, tmp_path: Path) -> None:
    """A block whose lazy file's fence never came (the job was killed): the report counted it, the
    exporter's replay of the same log held it for a fence that never comes (2 saves against 3)."""
    log = _killed_before_fence(torch_python, tmp_path, block=True)
    rep = json.loads(cli("report", str(log), "--json").stdout)
    got = parse(cli("serve-metrics", "--event-log", str(log), "--once").stdout)
    assert rep["saves"] == rep["ranks"][0]["saves"] == 3
    assert value(got, "fastckpt_saves_total", rank="0", tier="direct") == 3  # was 2


def test_a_lazy_runs_blocked_time_is_the_same_both_ways(cli: Cli, tmp_path: Path) -> None:
    """Lazy saves, fenced, and a one_save() block of lazy files fenced after it ended: the report's
    saves and blocked time are the exporter's, counted from the same log."""
    w, log = torch.randn(1 << 20), tmp_path / "events.jsonl"
    with Checkpointer(event_log=str(log), overhead_budget=0.99) as ck:
        for s in range(3):
            h = ck.save({"w": w}, str(tmp_path / f"s{s}.pt"), lazy=True)
            ck.fence()
            h.wait()
        with ck.one_save():
            handles = [ck.save({"w": w}, str(tmp_path / f"{n}.pt"), lazy=True) for n in "ab"]
        ck.fence()
        for h in handles:
            h.wait()
        st = ck.stats()
    (rank,) = json.loads(cli("report", str(log), "--json").stdout)["ranks"]
    got = parse(cli("serve-metrics", "--event-log", str(log), "--once").stdout)
    assert rank["saves"] == st.saves == value(got, "fastckpt_saves_total", rank="0", tier="direct") == 4
    assert rank["blocked_s"] == pytest.approx(value(got, "fastckpt_save_blocked_seconds_sum", rank="0"), abs=1e-6)


def test_report_replays_the_alarm_against_the_jobs_budget(cli: Cli, tmp_path: Path) -> None:
    """The log's start event records the job's overhead_budget: the report uses it unless
    --overhead-budget is given, as serve-metrics does, and says which. It used its own 0.02 and
    exited 1 for an alarm the job never had."""
    log = tmp_path / "events.jsonl"
    with Checkpointer(event_log=str(log), overhead_budget=0.9) as ck:
        for s in range(3):
            ck.save({"w": torch.randn(1 << 18)}, str(tmp_path / f"s{s}.pt")).wait()
        assert not ck.stats().over_budget and ck.stats().overhead > 0.0001
    rep = cli("report", str(log))
    assert rep.returncode == 0, rep.stdout + rep.stderr  # was 1: the alarm fired at 2 %
    assert "(budget 90.0%: the job's), 0 alarm(s)" in rep.stdout
    given = cli("report", str(log), "--overhead-budget", "0.0001")
    assert given.returncode == 1 and "(budget 0.0%: --overhead-budget), 1 alarm(s)" in given.stdout
    (rank,) = json.loads(cli("report", str(log), "--json").stdout)["ranks"]
    assert (rank["budget"], rank["budget_source"], rank["alarms"]) == (0.9, "job", 0)
    served = parse(cli("serve-metrics", "--event-log", str(log), "--once").stdout)
    assert value(served, "fastckpt_overhead_budget_ratio", rank="0") == 0.9


def test_a_job_that_restored_before_its_first_save_is_replayed_as_its_monitor_saw_it(cli: Cli, tmp_path: Path) -> None:
    """The Monitor's clock starts when the Checkpointer is built, so a resumed job's restore (or its
    model's build, its steps before the first save) counts as run time; the replay's clock started
    at the first save, so the report read several times the job's overhead and exited 1, and
    serve-metrics counted an alarm, for saves back to back that its Monitor never alarmed on. The
    log's start event records when the Checkpointer was built: both replay from there."""
    restore, log = tmp_path / "restore.pt", tmp_path / "events.jsonl"
    with Checkpointer() as ck:
        ck.save({"w": torch.randn(64 << 20)}, str(restore)).wait()  # 256 MB
    with Checkpointer(event_log=str(log), overhead_budget=0.5) as ck:
        state = ck.load(str(restore))  # the restore, before the first save: on the Monitor's clock
        for s in range(4):  # small saves back to back: blocked most of the time since the first one
            ck.save({"step": s, "w": state["w"][:4096].clone()}, str(tmp_path / f"s{s}.pt"))
        live = ck.stats()
    rep = cli("report", str(log), "--json")
    (rank,) = json.loads(rep.stdout)["ranks"]
    assert (rank["alarms"], rep.returncode) == (live.alarms, 1 if live.alarms else 0), rep.stderr  # was 1 alarm, 1
    assert rank["overhead"] == pytest.approx(live.overhead, rel=0.25)  # was several times it
    served = parse(cli("serve-metrics", "--event-log", str(log), "--once").stdout)
    assert value(served, "fastckpt_overhead_alarms_total", rank="0") == live.alarms
    assert value(served, "fastckpt_overhead_alarm", rank="0") == live.over_budget


def test_a_log_of_loads_only_says_so(cli: Cli, tmp_path: Path) -> None:
    """A job that resumed and died before its first save logs loads only: the report said
    "0 saves (none) by 0 rank(s)" and nothing of the loads but their times."""
    path, log = str(tmp_path / "s.pt"), tmp_path / "events.jsonl"
    with Checkpointer() as ck:
        rec = ck.save({"w": torch.randn(1 << 16)}, path).wait()
    with Checkpointer(event_log=str(log)) as ck:
        for _ in range(2):
            ck.load(path)
    rep = cli("report", str(log))
    assert rep.returncode == 0, rep.stdout + rep.stderr
    first, last = rep.stdout.splitlines()
    assert first.startswith("no saves: 2 loads by 1 rank(s) over ") and "0 saves" not in rep.stdout
    assert first.endswith(f" s, {fmt_bytes(2 * rec.bytes)} read")
    assert last.startswith("failures: none; retries: 0; group commits: 0; loads: p50 ") and last.endswith("(2)")
    got = json.loads(cli("report", str(log), "--json").stdout)
    assert (got["saves"], got["load_ranks"], got["loaded_bytes"]) == (0, 1, 2 * rec.bytes)


def test_a_lazy_save_killed_before_its_fence_is_unfinished(cli: Cli, torch_python: ForkServer, tmp_path: Path) -> None:
    """A lazy save whose job was killed before its fence event: its copy never ended in the log.
    The report counted it pending (or, once the job resumed, abandoned) like any save still being
    written, and its overhead left it out without a word; it is now unfinished, named with the phase it
    reached, also after the resumed job's saves."""
    log = _killed_before_fence(torch_python, tmp_path, block=False)
    killed = str(tmp_path / "home" / "k.pt")
    for resumed in (False, True):
        if resumed:  # the job resumed with the same log: its new saves are no more unfinished
            with Checkpointer(event_log=str(log), overhead_budget=0.99) as ck:
                ck.save({"w": torch.randn(1000)}, str(tmp_path / "home" / "r.pt"), lazy=True).wait()
        rep = cli("report", str(log))
        assert rep.returncode == 0, rep.stdout + rep.stderr
        assert "0 pending, 0 abandoned, 1 unfinished, 0 failed" in rep.stdout  # was 1 pending (then 1 abandoned)
        assert f"unfinished: rank 0 {killed} reached snapshot (lazy saves whose fence event never came" in rep.stdout
        got = json.loads(cli("report", str(log), "--json").stdout)
        assert (got["unfinished"], got["unfinished_saves"]) == (1, [f"rank 0 {killed} reached snapshot"])
        assert (got["saves"], got["durable"]) == (3 + resumed, 2 + resumed)
