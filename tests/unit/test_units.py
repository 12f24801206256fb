"""Sizes and rates are rounded before their unit is chosen: a value just under a unit boundary
prints as one of the next unit ("1 TB"), never in scientific notation ("1e+03 GB", as plan,
doctor, bench, report and ls once printed for 999.5..999.99 of a unit)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from fastckpt.cli import cli
from fastckpt.cli._common import fmt_rate as cli_rate
from fastckpt.monitor import fmt_duration, fmt_rate
from fastckpt.units import fmt_bytes


@pytest.mark.parametrize("n, want", [(999.9e9, "1 TB"), (999.7e6, "1 GB"), (999.6e3, "1 MB"), (999.99e12, "1 PB"),
                                     (999.6, "1 kB"), (999.4e9, "999 GB"), (1.12e12, "1.12 TB"), (1536, "1.54 kB"),
                                     (12, "12 B"), (0, "0 B"), (2e18, "2,000 PB"), (None, "-")])
def test_fmt_bytes_rounds_before_it_picks_the_unit(n: float | None, want: str) -> None:
    assert fmt_bytes(n) == want


def test_rates_and_durations_round_before_they_pick_the_unit() -> None:
    assert cli_rate(999.7e6) == "1 GB/s"
    assert fmt_rate(999.7e6) == "1 GB/s" and fmt_rate(999.0) == "1 kB/s" and fmt_rate(995e6, up=True) == "1 GB/s"
    assert fmt_duration(59.9) == "1 min" and fmt_duration(0.9999) == "1 s" and fmt_duration(3599.0) == "1 h"


def test_plan_prints_a_state_just_under_a_terabyte_as_one_terabyte() -> None:
    res = CliRunner().invoke(cli, ["plan", "--state-size", "999.9GB", "--bandwidth", "10GB/s", "--gpus", "64"])
    total = next(line for line in res.output.splitlines() if "total" in line)
    assert "e+" not in res.output and total.split()[-2:] == ["1", "TB"], res.output


def test_sig_keeps_whole_numbers_out_of_e_notation() -> None:
    from fastckpt.units import sig

    assert [sig(x) for x in (43200.0, 999.96, 217.3, 0.01234, 2.0)] == ["43,200", "1,000", "217", "0.0123", "2"]
    assert sig(28.886, 4) == "28.89"
