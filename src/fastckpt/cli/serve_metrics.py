"""``fastckpt serve-metrics --event-log events.jsonl --port P``: Prometheus metrics from event logs."""

from __future__ import annotations

import dataclasses
import json
import signal
import threading

import click

from ._common import FiniteRange
from ._localdir import LocalDir
from ._overhead import overhead_options


@click.command("serve-metrics")
@click.option("--event-log", "logs", multiple=True, required=True, type=click.Path(dir_okay=False),
              help="A Checkpointer's event_log to follow (repeat for each rank's log); it may not exist yet.")
@click.option("--port", type=click.IntRange(0, 65535), default=9400, show_default=True,
              help="TCP port to serve /metrics on (0: any free port).")
@click.option("--addr", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option("--local-dir", "local_dirs", type=LocalDir(), multiple=True,
              help="The node's burst buffer (local_dir), for its free space; repeat it for each directory of a "
                   "striped one (local_dir=[...]).")
@overhead_options
@click.option("--poll-s", type=FiniteRange(0, 3600, min_open=True, want="seconds, e.g. 1 or 0.5"), default=1.0,
              show_default=True,
              help="How often to read what the logs gained between scrapes (each scrape reads them too).")
@click.option("--once", is_flag=True, help="Read the logs once, print the metrics and exit (no server).")
@click.option("--json", "as_json", is_flag=True, help="Print the startup line (or, with --once, the ranks' "
              "status) as JSON.")
def serve_metrics(logs: tuple[str, ...], port: int, addr: str, local_dirs: tuple[str, ...],
                  overhead_budget: float | None, overhead_window_s: float | None, poll_s: float, once: bool,
                  as_json: bool) -> None:
    """Follow running jobs' event logs and serve their metrics to Prometheus (docs/metrics.md).

    One exporter per node: pass every rank's log of this node. Stops on Ctrl-C or SIGTERM.
    """
    import os

    from ..errors import ConfigError
    from ..metrics import LogExporter

    missing = [p for p in logs if not os.path.exists(p)]
    if once and missing:  # nothing will write them before it exits
        raise click.UsageError(f"--once reads the logs as they are now, and {', '.join(missing)} does not exist: "
                               "check the path (the Checkpointer's event_log)" + "".join(map(_pattern, missing)))
    for p in missing:  # a misspelt path or an unexpanded glob served an empty exporter for ever without a word
        click.echo(f"fastckpt: the event log {p} does not exist; waiting for it to appear (a job's Checkpointer "
                   f"creates it at its first event){_pattern(p)}", err=True)
    for local_dir in local_dirs:
        if not os.path.isdir(local_dir):  # else / (say) would stand in for its free space
            missing_dir = (f"{local_dir} does not exist: give the burst buffer's directory (the local_dir the "
                           "checkpoints are saved with), or leave --local-dir out")
            if once:  # nothing will create it before it exits
                raise click.BadParameter(missing_dir, param_hint="--local-dir")
            click.echo(f"fastckpt: {missing_dir}; its free space is absent until it exists", err=True)
    if odd := [p for p in logs if os.path.exists(p) and not os.path.isfile(p)]:  # a pipe would block the reader
        raise click.UsageError(f"{', '.join(odd)}: not a regular file (a directory, a named pipe): give the event "
                               "log file the Checkpointer's event_log writes")
    try:
        exporter = LogExporter(logs, 0 if once else port, addr, local_dirs=local_dirs, budget=overhead_budget,
                               window_s=overhead_window_s)
    except ConfigError as exc:  # the port is taken, or --addr is not an address of this node
        raise click.ClickException(str(exc)) from exc
    try:
        if once:
            _print_once(exporter, as_json)
            return
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        if as_json:
            click.echo(json.dumps({"url": exporter.url, "port": exporter.port, "event_logs": list(logs)}))
        else:
            click.echo(f"serving the metrics of {len(logs)} event log(s) at {exporter.url} (Ctrl-C stops)")
        exporter.run(stop, poll_s)
    finally:
        exporter.close()


def _pattern(path: str) -> str:
    """A hint when ``path`` looks like a glob no shell expanded (a Kubernetes ``args:`` list, a systemd
    unit, a quoted word): the exporter follows files by name, never patterns."""
    import glob

    if not any(c in path for c in "*?["):
        return ""
    found = sorted(glob.glob(path))
    matches = f" (it matches {len(found)} file(s): {', '.join(found[:3])}{', ...' if len(found) > 3 else ''})" \
        if found else ""
    return (f". {path} looks like a pattern no shell expanded{matches}: list each log with its own --event-log "
            "(--event-log events-0.jsonl --event-log events-1.jsonl), or let a shell expand it")


def _print_once(exporter, as_json: bool) -> None:  # noqa: ANN001 (a LogExporter)
    import time
    import urllib.request

    exporter.poll()
    if wrong := exporter.not_event_logs():  # a file given by mistake: its zero events are no reading
        raise click.ClickException("\n".join(wrong) + "\nGive --event-log the file a Checkpointer's event_log= "
                                   "writes (one JSON event per line), or check the path")
    if not as_json:
        with urllib.request.urlopen(exporter.url, timeout=10) as resp:  # the same text Prometheus gets
            click.echo(resp.read().decode(), nl=False)
        return
    status = exporter.status(time.time())
    click.echo(json.dumps({"events": exporter.events, "bad_lines": exporter.bad_lines,
                           "ranks": [dataclasses.asdict(s) for s in status]}, indent=2))
