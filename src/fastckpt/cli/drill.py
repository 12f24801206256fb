"""``fastckpt drill``: kill a training job at random moments and time its restore (drill_run.py)."""

from __future__ import annotations

import os
import shutil
import tempfile

import click

from ..urls import is_url
from ._common import (
    DURATION,
    DURATION_OR_ZERO,
    LOCATION,
    SIZE,
    console,
    count_range,
    emit_json,
    exit_with,
    fmt_bytes,
    json_option,
    not_a_dir,
    progress,
    storage_options_option,
    table,
    warn,
)
from ._localdir import LocalDir
from .drill_run import Drill, DrillConfig, DrillError, lose_local_problem, summarize

JOB_MEMORY_FACTOR = 3  # the built-in job's state, a save's staging buffers, the restore at its start


def _validate(cfg: DrillConfig) -> None:
    if cfg.lose_local and not cfg.local_dir:
        raise click.UsageError("--lose-local wipes the burst buffer: give --local-dir too")
    if cfg.lose_local and (problem := lose_local_problem(cfg.home, cfg.local_dir)):
        raise click.UsageError(problem)
    if is_url(cfg.home) and not cfg.local_dir:
        raise click.UsageError(f"--dir {cfg.home} is a URL: saving there needs --local-dir (the burst buffer)")
    if not_a_dir(cfg.home):
        raise click.UsageError(f"--dir {cfg.home} is a file: give a directory (it is created if missing) or a URL")
    if not cfg.command and cfg.device == "cpu":
        from ..sysinfo import mem_available

        need, avail = JOB_MEMORY_FACTOR * cfg.state_bytes, mem_available()
        if avail is not None and need > avail:
            raise click.BadParameter(
                f"the built-in job holds about {JOB_MEMORY_FACTOR} x its state in memory ({fmt_bytes(need)}: the "
                f"state, its staging buffers and a restore), and this machine has {fmt_bytes(avail)} available; "
                "give a smaller --state-size", param_hint="--state-size")
    if not cfg.command and cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise click.UsageError("--device cuda: this machine has no CUDA device torch can use; drop --device "
                                   "(the built-in job then runs on cpu) or run the drill on a GPU node")
    if cfg.min_run_s > cfg.max_run_s:
        raise click.UsageError("--min-run must not exceed --max-run")
    if cfg.command and shutil.which(cfg.command[0]) is None:
        raise click.UsageError(f"the command after -- is not found or not executable: {cfg.command[0]!r} "
                               "(give a program on PATH, or its path, e.g. -- python train.py)")
    if not cfg.command:
        from .. import latest

        if latest(cfg.home, cfg.storage_options) is not None:
            raise click.UsageError(f"{cfg.home} already holds a checkpoint: the built-in job needs an empty --dir "
                                   "(or give your own job after --)")


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def render(data: dict) -> None:
    out = console()
    rows = [[r["trial"], r["aimed"] or "-", "+".join(r["hit"]) or "-", r["killed_at_step"], r["durable_step"],
             r["restored_step"], r["source"], _f(r["rto_s"]), r["rpo_steps"],
             "ok" if r["restored"] else ("CORRUPT" if r["corrupt"] else "FAILED")] for r in data["rows"]]
    out.print(table("Trials", ["trial", "aimed at", "under way at the kill", "killed at step", "durable step",
                               "restored step", "from", "RTO s", "RPO steps", "result"], rows, right_from=3,
                    text=(6, 9)))
    rto, rpo = data["rto_seconds"], data["rpo_steps"]
    verdict = "PASS" if data["passed"] else "FAIL"
    out.print(table("Summary", ["", "value"], [
        ["trials (run / asked)", f"{data['run']} / {data['trials']}"], ["restored", data["restored"]],
        ["corrupt or partial checkpoints loaded", data["corrupt_loads"]],
        ["RTO s (min / median / max)", f"{_f(rto['min'])} / {_f(rto['median'])} / {_f(rto['max'])}"],
        ["RPO steps (min / median / max)", f"{_f(rpo['min'], 'g')} / {_f(rpo['median'], 'g')} / {_f(rpo['max'], 'g')}"],
        ["phases under way at the kills", ", ".join(f"{k} {v}" for k, v in data["phases_hit"].items()) or "-"],
        [f"verdict (RTO target {data['rto_target_seconds']:g} s)", verdict],
    ]))
    for r in data["rows"]:
        if r["error"]:
            out.print(f"- trial {r['trial']}: {r['error']}", markup=False)


@click.command()
@click.option("--trials", type=count_range(), default=10, show_default=True)
@click.option("--state-size", type=SIZE, default="256MiB", show_default=True,
              help="State of the built-in job (two files per checkpoint).")
@click.option("--dir", "home", required=True, type=LOCATION, help="The durable home: a directory or a URL (s3://...).")
@click.option("--local-dir", type=LocalDir(), help="The burst buffer (node-local directory).")
@click.option("--lose-local", is_flag=True, help="Wipe the burst buffer before each restart (a lost node).")
@click.option("--rto-target", type=DURATION, default="180s", show_default=True, help="Slowest acceptable restore.")
@click.option("--seed", type=count_range(0, 2**32 - 1), default=0, show_default=True,
              help="Seeds the kill moments and the state.")
@click.option("--every", type=count_range(), default=5, show_default=True, help="Built-in job: save every N steps.")
@click.option("--step-time", type=DURATION_OR_ZERO, default="50ms", show_default=True,
              help="Built-in job: compute time per step.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Built-in job: where its state lives.")
@click.option("--min-run", type=DURATION_OR_ZERO, default="5s", show_default=True,
              help="Your job: earliest kill after a (re)start.")
@click.option("--max-run", type=DURATION, default="30s", show_default=True, help="Your job: latest kill.")
@click.option("--trial-timeout", type=DURATION, default="300s", show_default=True,
              help="Give up when the job has not started, restored or made a checkpoint durable within this long.")
@click.option("--keep-logs", is_flag=True, help="Keep the jobs' logs and event logs (kept anyway on failure).")
@storage_options_option
@json_option
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def drill(command: tuple[str, ...], trials: int, state_size: int, home: str, local_dir: str | None,
          lose_local: bool, rto_target: float, seed: int, every: int, step_time: float, device: str,
          min_run: float, max_run: float, trial_timeout: float, keep_logs: bool, storage_options: dict | None,
          as_json: bool) -> None:
    """Kill a training job with SIGKILL, restart it, and time the restore: RTO and RPO.

    Without COMMAND it runs a built-in job (a synthetic model saving every --every steps)
    and aims the kills at snapshots, writes, commits, replication and idle training. With
    `-- COMMAND ...` it kills your job at random moments between --min-run and --max-run
    and times a fresh process's restore of the newest complete checkpoint under --dir.
    Exit 0 when every trial restored, no corrupt or partial checkpoint was ever loaded and
    every RTO met --rto-target; 1 otherwise.
    """
    cfg = DrillConfig(home=home if "://" in home else os.path.abspath(home), trials=trials, state_bytes=state_size,
                      local_dir=os.path.abspath(local_dir) if local_dir else None, lose_local=lose_local,
                      rto_target_s=rto_target, seed=seed, every=every, step_time_s=step_time,
                      storage_options=storage_options, command=tuple(command), trial_timeout_s=trial_timeout,
                      min_run_s=min_run, max_run_s=max_run, device=device)
    _validate(cfg)
    for d, flag in ((cfg.local_dir, "--local-dir"), (None if is_url(cfg.home) else cfg.home, "--dir")):
        try:
            if d:
                os.makedirs(d, exist_ok=True)
        except OSError as exc:  # a file on the way (file/x), no permission
            raise click.BadParameter(f"cannot create {d}: {exc.strerror}; give a directory path",
                                     param_hint=flag) from exc
    workdir = tempfile.mkdtemp(prefix="fastckpt-drill-")
    what = "your job" if command else f"the built-in job ({fmt_bytes(state_size)} of state)"
    error = None
    with progress(f"drilling {what}", trials, enabled=not as_json) as bar:
        drill_ = Drill(cfg, workdir)
        done: list = []
        try:
            drill_.run(lambda t: (done.append(t), bar.advance()))
        except DrillError as exc:
            error = str(exc)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the jobs are killed (Drill.run); their logs go too
            if keep_logs:
                warn(f"interrupted: logs kept in {workdir}")
            else:
                shutil.rmtree(workdir)
            raise
    data = summarize(cfg, done) | {"dir": cfg.home, "local_dir": cfg.local_dir, "lose_local": lose_local,
                                   "state_bytes": state_size if not command else None, "seed": seed,
                                   "command": list(command) or None, "error": error, "logs": workdir}
    if data["passed"] and error is None and not keep_logs:
        shutil.rmtree(workdir)
        data["logs"] = None
    emit_json(data) if as_json else render(data)
    if error:
        warn(f"drill stopped: {error}")
    if data["logs"]:
        warn(f"logs kept in {workdir}")
    exit_with(data["passed"] and error is None)
