"""The overhead options of the commands that replay a job's alarm from its event logs (``report``,
``serve-metrics``): one definition, so one default rule: each job's own budget and window, which
the ``start`` event of its log records (``replay.RankOverheads.options``), unless given."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click

from ..replay import DEFAULT_BUDGET, DEFAULT_WINDOW_S
from ._common import DURATION, OVERHEAD_BUDGET

F = TypeVar("F", bound=Callable[..., object])


def overhead_options(command: F) -> F:
    """``--overhead-budget`` and ``--overhead-window-s``, None unless given (then each job's)."""
    command = click.option(
        "--overhead-window-s", type=DURATION, default=None,
        help="The overhead's sliding window: seconds (3600) or a duration (1h) [default: each job's "
             f"overhead_window_s, from its event log; {DEFAULT_WINDOW_S:g} s for a log that does not].")(command)
    return click.option(
        "--overhead-budget", type=OVERHEAD_BUDGET, default=None,
        help="Budget the overhead alarm is replayed against [default: each job's overhead_budget, which its "
             f"event log records; {DEFAULT_BUDGET} for a log that does not].")(command)
