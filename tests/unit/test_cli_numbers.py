"""Every number option of the operator CLI refuses what it cannot use (``nan``, ``inf``, an
integer too large for any later arithmetic), and drill refuses a --dir it cannot create or a
built-in job the machine cannot hold, each with exit 2 naming the flag before any work starts
(these once passed verdicts, silenced alarms, or died in a traceback mid-run)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

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
