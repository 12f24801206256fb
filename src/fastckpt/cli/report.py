"""``fastckpt report EVENTS.jsonl... [-o report.png] [--html report.html] [--json]``."""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import os

import click

from ._overhead import overhead_options


@click.command()
@click.argument("logs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", "png", type=click.Path(dir_okay=False), default=None,
              help="Write the figure (timeline per rank, overhead curve, per-save times) to this PNG.")
@click.option("--html", "page", type=click.Path(dir_okay=False), default=None,
              help="Write one self-contained HTML page (summary and figure inline).")
@click.option("--json", "as_json", is_flag=True, help="Print the numbers as JSON instead of text.")
@overhead_options
def report(logs: tuple[str, ...], png: str | None, page: str | None, as_json: bool,
           overhead_budget: float | None, overhead_window_s: float | None) -> None:
    """Summarise and draw a run from its event logs (one per rank, or one shared).

    Prints saves, bytes, blocked and durable percentiles, overhead per rank, alarms,
    replication lag and failures. Exit 1 when a save, a group commit or a load failed or an alarm
    fired (docs/report.md).
    """
    from ..progress import Progress
    from ..report import load_run

    for flag, where in (("-o", png), ("--html", page)):
        if where and where.endswith(("/", os.sep)):
            raise click.BadParameter(f"{where} names a folder: give a file in it, e.g. "
                                     f"{os.path.join(where, 'report.png' if flag == '-o' else 'report.html')}",
                                     param_hint=flag)
        parent = os.path.dirname(os.path.abspath(where)) if where else None
        if parent is not None and not os.path.isdir(parent):
            raise click.BadParameter(f"{where}: the directory {parent} does not exist; create it or write elsewhere",
                                     param_hint=flag)
        if where and any(_same(where, p) for p in logs):
            raise click.BadParameter(f"{where} is an event log this report reads: writing there would destroy the "
                                     "run's record; give another file name", param_hint=flag)
    if png and os.path.splitext(png)[1].lower() != ".png":  # it wrote PNG bytes under any name, and said so
        raise click.BadParameter(f"{png}: the figure is a PNG; name it *.png (e.g. report.png), or use --html for a "
                                 "page", param_hint="-o")
    if png and page and _same(png, page):
        raise click.BadParameter(f"{png} is given for both -o and --html: give each its own file", param_hint="-o")
    if png or page:  # before the logs are read: a long run's log takes a while
        from ..report.plot import pyplot

        try:
            pyplot()
        except ModuleNotFoundError as exc:
            raise click.UsageError(f"{'-o' if png else '--html'}: {exc}") from exc
    total = sum(os.path.getsize(p) for p in logs)
    with Progress(f"reading {len(logs)} event log(s)", total=total, delay_s=2.0):
        try:
            run, summary = load_run(logs, overhead_budget, overhead_window_s)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="LOGS") from exc
    if not run.events:
        raise click.BadParameter(f"{', '.join(logs)}: no events in the log(s)", param_hint="LOGS")
    _write(run, summary, png, page)
    if as_json:
        out = dataclasses.asdict(summary)
        out["outputs"] = {"png": png, "html": page}
        click.echo(json.dumps(out, indent=2, sort_keys=True))
    else:
        click.echo(summary.text())
        for what, where in (("figure", png), ("page", page)):
            if where:
                click.echo(f"{what}: {where}")
    if summary.failed or summary.alarms or any(k.startswith("load: ") or k.startswith("commit: ") and  # a group's
                                               k != "commit: GroupRemovedError" for k in summary.failures):  # too,
        raise SystemExit(1)  # unless remove()d; a failed load: a checkpoint the job could not restore


def _write(run, summary, png: str | None, page: str | None) -> None:  # noqa: ANN001 (RunState, Summary)
    """Draw once; the page embeds the PNG from memory, so no other file is left beside it. Each file
    is replaced whole (``outfile.write_output``): a write that fails or is killed midway leaves the
    previous file whole, never a part of the new one."""
    if not (png or page):
        return
    from ..progress import Progress
    from ..report.page import html_page
    from ..report.plot import render_png
    from .outfile import write_output

    buf = io.BytesIO()
    with Progress("drawing", total=None, unit="figures", delay_s=2.0):
        render_png(run, summary, buf)
    flag, where = "-o", png
    try:
        if png:
            write_output(png, buf.getvalue())
        flag, where = "--html", page
        if page:
            write_output(page, html_page(summary, buf.getvalue()).encode("utf-8"))
    except OSError as exc:  # bad usage (exit 2, as a missing directory is): exit 1 says the run failed
        if exc.errno == errno.EPIPE:  # the reader went away (--html /dev/stdout | head): no usage error, no fix to
            raise  # give: click quiets it and exits 1, as for a closed stdout
        denied = "make its directory writable by this user, or give a path elsewhere"
        fix = {errno.EROFS: "its filesystem is read-only: give a path on a writable one",
               errno.ENOSPC: "free space there, or give a path elsewhere",
               errno.EDQUOT: "free space there (or raise the quota), or give a path elsewhere",
               errno.EACCES: denied, errno.EPERM: denied}.get(exc.errno, "give a path elsewhere")
        raise click.BadParameter(f"cannot write {where} ({exc.strerror or exc}); {fix}", param_hint=flag) from exc


def _same(a: str, b: str) -> bool:
    """One file under two names: a symlink, or (once it exists) a hard link or a bind mount."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # either does not exist yet: not the same file
        return False
