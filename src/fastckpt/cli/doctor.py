"""``fastckpt doctor``: what each tier can do on this machine, and what ``auto`` would pick."""

from __future__ import annotations

import dataclasses
import json
import os

import click

from ..urls import local_path
from ._common import LOCATION, SIZE, SIZE_OR_ZERO, count_range, file_in_the_way, storage_options_option
from ._localdir import LocalDir, distinct_dirs
from ._signals import sigterm_interrupts

_STYLE = {"ok": "green", "info": "blue", "warn": "yellow", "fail": "bold red"}


@click.command()
@click.option("--local-dir", type=LocalDir(file_okay=True), multiple=True, callback=distinct_dirs,
              help="The burst buffer (local_dir); repeat it for striped drives (each is measured).")
@click.option("--target", default=None, type=LOCATION,
              help="Where checkpoints are saved: a directory or a URL (default: here).")
@click.option("--tier", type=click.Choice(["auto", "gds", "nvme", "direct"]), default="auto", show_default=True,
              help="The tier you will ask for: exit 1 when it cannot work here.")
@click.option("--state-size", type=SIZE, default=None, help="Bytes of one checkpoint on this node (e.g. 40GiB).")
@click.option("--keep", type=count_range(), default=2, show_default=True,
              help="Checkpoints each place must hold at once.")
@click.option("--probe-size", type=SIZE_OR_ZERO, default="256MiB", show_default=True,
              help="Bytes the bandwidth probe writes and reads: whole MiB, at least 1 MiB (0 skips it).")
@storage_options_option
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
def doctor(local_dir: tuple[str, ...], target: str | None, tier: str, state_size: int | None, keep: int,
           probe_size: int, storage_options: dict | None, as_json: bool) -> None:
    """Probe this machine's tiers and storage; say what tier=auto would pick and why.

    Each finding has a status (ok, info, warn, fail) and, where needed, the fix. Exit 1 when a
    check fails, e.g. when the --tier asked for cannot work here (docs/doctor.md).
    """
    from ..doctor import DoctorOptions, diagnose

    for d in local_dir:
        if blocker := file_in_the_way(d):
            raise click.BadParameter(_in_the_way(d, blocker, "the burst buffer's directory"), param_hint="--local-dir")
    if target and (blocker := file_in_the_way(target)):
        raise click.BadParameter(_in_the_way(target, blocker, "the directory checkpoints are saved in") + " or a URL",
                                 param_hint="--target")
    opts = DoctorOptions(local_dir[0] if len(local_dir) == 1 else (local_dir or None), target, tier, state_size, keep,
                         probe_size, storage_options or {},
                         progress="off" if as_json else "auto")
    with sigterm_interrupts():  # a scheduler's cancel mid-probe: the probe files are removed, as on Ctrl-C
        dx = diagnose(opts)
    if as_json:
        click.echo(json.dumps({"findings": [dataclasses.asdict(f) for f in dx.findings], "auto": dx.auto,
                               "ok": not dx.failed}, indent=2))
    else:
        _print(dx)
    raise SystemExit(dx.exit_code)


def _in_the_way(path: str, blocker: str, what: str) -> str:
    """Why ``path`` cannot be ``what``: it is the file ``blocker``, or lies below it."""
    if blocker == os.path.abspath(local_path(path)):
        return f"{path} is a file: give {what} (it is created if missing)"
    return f"{blocker} is a file, so no directory can be made below it as {path}: give the path of {what}"


def _print(dx) -> None:  # noqa: ANN001 (a Diagnosis)
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False)
    for f in dx.findings:
        console.print(f"[{_STYLE[f.status]}]{f.status:<4}[/] {escape(f.check)}: {escape(f.summary)}")
        if f.fix and f.status != "ok":
            console.print(f"     fix: {escape(f.fix)}")
    picks = ", ".join(f"{state} state -> {tier}" for state, tier in dx.auto.items()) or "not decided"
    console.print(f"auto would pick: {picks}", markup=False)
    if dx.failed:
        console.print("[bold red]at least one check failed[/]")
