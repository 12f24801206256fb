"""Every number option of the operator CLI refuses what it cannot use (``nan``, ``inf``, an
integer too large for any later arithmetic), and drill refuses a --dir it cannot create or a
built-in job the machine cannot hold, each with exit 2 naming the flag before any work starts
(these once passed verdicts, silenced alarms, or died in a traceback mid-run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import fastckpt
from fastckpt.cli import cli

HUGE = "1" + "0" * 400


def _refused(args: list[str], *words: str) -> None:
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    for w in words:
        assert w in res.output, res.output


@pytest.mark.parametrize("args, flag", [
    (["plan", "--params", "70B", "--bandwidth", "10GB/s", "--gpus", HUGE], "--gpus"),
    (["plan", "--params", "70B", "--bandwidth", "10GB/s", "--gpus-per-node", HUGE], "--gpus-per-node"),
    (["plan", "--params", "70B", "--bandwidth", "10GB/s", "--overhead-budget", "nan"], "--overhead-budget"),
    (["doctor", "--keep", HUGE, "--probe-size", "0"], "--keep"),
    (["drill", "--dir", "{tmp}/d", "--seed", HUGE], "--seed"),
    (["drill", "--dir", "{tmp}/d", "--trials", HUGE], "--trials"),
    (["bench", "--dir", "{tmp}", "--pass-fraction", "nan"], "--pass-fraction"),
    (["report", "{tmp}/e.jsonl", "--overhead-budget", "nan"], "--overhead-budget"),
    (["report", "{tmp}/e.jsonl", "--overhead-window-s", "inf"], "--overhead-window-s"),
    (["serve-metrics", "--event-log", "{tmp}/e.jsonl", "--poll-s", "inf"], "--poll-s"),
    (["serve-metrics", "--event-log", "{tmp}/e.jsonl", "--poll-s", "1e300"], "--poll-s"),
])
def test_a_number_no_run_can_use_is_refused_naming_its_flag(tmp_path: Path, args: list[str], flag: str) -> None:
    (tmp_path / "e.jsonl").write_text("")
    _refused([a.replace("{tmp}", str(tmp_path)) for a in args], flag)


def test_drill_refuses_a_dir_below_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    _refused(["drill", "--dir", str(tmp_path / "file" / "x"), "--trials", "1"],
             "--dir", "Not a directory", "give a directory path")


def test_drill_refuses_a_built_in_job_larger_than_the_machine_holds(tmp_path: Path) -> None:
    _refused(["drill", "--dir", str(tmp_path / "home"), "--trials", "1", "--state-size", "1PB"],
             "--state-size", "available", "give a smaller --state-size")
    assert not (tmp_path / "home").exists()  # refused before anything was created


@pytest.mark.parametrize("args, want", [
    (["plan", "--params", "70B", "--bandwidth", "10GB/s", "--overhead-budget", "2%"], "a fraction, e.g. 0.02 for 2 %"),
    (["plan", "--params", "70B", "--bandwidth", "10GB/s", "--overhead-budget", "2"], "a fraction, e.g. 0.02 for 2 %"),
    (["report", "{tmp}/e.jsonl", "--overhead-budget", "2%"], "a fraction, e.g. 0.02 for 2 %"),
    (["serve-metrics", "--event-log", "{tmp}/e.jsonl", "--once", "--overhead-budget", "inf"], "e.g. 0.02 for 2 %"),
    (["bench", "--dir", "{tmp}", "--pass-fraction", "80%"], "a fraction, e.g. 0.8 for 80 %"),
    (["bench", "--dir", "{tmp}", "--pass-fraction", "80"], "a fraction, e.g. 0.8 for 80 %"),
    (["serve-metrics", "--event-log", "{tmp}/e.jsonl", "--once", "--poll-s", "1s"], "seconds, e.g. 1"),
    (["report", "{tmp}/e.jsonl", "--overhead-window-s", "an hour"], "plain seconds (3600)"),
])
def test_a_refused_fraction_or_seconds_names_the_form_wanted(tmp_path: Path, args: list[str], want: str) -> None:
    (tmp_path / "e.jsonl").write_text("")
    _refused([a.replace("{tmp}", str(tmp_path)) for a in args], want)


def test_the_overhead_window_takes_a_duration_as_every_other_time_option_does(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    with fastckpt.Checkpointer(event_log=str(log)) as ck:
        for step in range(3):
            ck.save({"w": torch.randn(1000)}, str(tmp_path / "home" / f"step-{step}.pt")).wait()
    outputs = []
    for window in ("1h", "3600", "60m"):
        res = CliRunner().invoke(cli, ["report", str(log), "--json", "--overhead-window-s", window])
        assert res.exit_code in (0, 1), res.output  # 1: the alarm may fire on three quick saves
        outputs.append(json.loads(res.output))
        res = CliRunner().invoke(cli, ["serve-metrics", "--event-log", str(log), "--once",
                                       "--overhead-window-s", window])
        assert res.exit_code == 0, res.output
    assert outputs[0] == outputs[1] == outputs[2]
