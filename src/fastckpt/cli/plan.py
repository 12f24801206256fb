"""``fastckpt plan``: size checkpoint storage before a run (the arithmetic is in sizing.py)."""

from __future__ import annotations

import dataclasses
import math

import click

from ..eventlog import read_events, unique_paths
from ..units import sig
from . import sizing
from ._common import (
    BANDWIDTH,
    DURATION,
    FINITE_POSITIVE,
    OVERHEAD_BUDGET,
    SIZE,
    Parsed,
    console,
    count_range,
    emit_json,
    exit_with,
    fmt_bytes,
    fmt_pct,
    fmt_rate,
    fmt_seconds,
    json_option,
    parse_count,
    parse_size,
    table,
)
from .runlog import RunProfile, profile

DEFAULT_INTERVAL_S = 2 * 3600.0
# a log whose saves hold less than this share of the groups it committed lacks other ranks' events
MISSING_RANKS_SHARE = 0.75
# a bare number of parameters below this is a unit left out: --params 70 meant 70B, not 70 parameters
BARE_PARAMS_MIN = 1000
PARAMS_UNITS = "K, M, B or G, T: thousand, million, billion, trillion"


def parse_params(text: str) -> float:
    """``--params``: a count of parameters, not bytes: ``70B`` (70e9), ``7e9``, ``1.3T``, ``350M``
    (``PARAMS_UNITS``). A bare number under ``BARE_PARAMS_MIN``, and a size in bytes (``70GB``),
    are refused naming the fix.

    Raises:
        ValueError: not a count, a unit left out, or a size in bytes.
    """
    try:
        n = parse_count(text)
    except ValueError as exc:
        try:
            parse_size(text)
        except ValueError:
            raise exc from None  # neither a count nor a size: the count's message, with its forms
        size = "".join(text.split())  # as the user types it again: "70 GB" would be two arguments
        raise ValueError(f"{text!r} is a size in bytes, and --params counts parameters (70B is 70 billion): give "
                         f"the checkpoint's size as --state-size {size} instead, or the parameters as e.g. "
                         "70B") from exc
    if text.strip()[-1:].isdigit() and 0 < n < BARE_PARAMS_MIN:  # no unit (parse_count read it: a count)
        raise ValueError(f"{text!r} is {n:g} parameters: write the unit, e.g. {n:g}B for {n:g} billion "
                         f"({PARAMS_UNITS}), or the whole count (e.g. 7e9)")
    return n


PARAMS = Parsed("count", parse_params, positive=True)


def _resolve(opts: dict, run: RunProfile | None, from_run: tuple[str, ...]) -> tuple[sizing.PlanInputs, list[str]]:
    """Flags win; a run's measurements fill the gaps; defaults last. Returns the inputs and
    a note per value that did not come from a flag."""
    notes: list[str] = []
    if opts["preset"] and opts["bytes_per_param"] is not None:
        raise click.UsageError("give --preset or --bytes-per-param, not both")
    bpp = opts["bytes_per_param"]
    if bpp is None:
        bpp = sizing.PRESETS[opts["preset"] or "mixed-adam"][0]
    gpn = opts["gpus_per_node"]
    gpus = opts["gpus"]
    share = run.logged_share if run else None
    if gpus is None and run and run.ranks and share is not None and share < MISSING_RANKS_SHARE:
        gpus = max(run.ranks + 1, round(run.ranks / share))  # its groups hold more than its ranks saved
        notes.append(f"GPUs: {gpus}, estimated: the {run.ranks} rank(s) in the event log saved {share:.0%} of each "
                     "checkpoint they committed; give every rank's log (--from-run once per log) or --gpus")
    elif gpus is None and run and run.ranks:
        gpus = run.ranks
        notes.append(f"GPUs: {gpus}, the ranks in the run's event log")
    elif gpus is None:
        gpus = gpn
        notes.append(f"--gpus not given: one node of {_count(gpn, 'GPU')}")
    if opts["state_size"] is not None and opts["params"] is not None:
        raise click.UsageError("give --params (with --preset) or --state-size, not both")
    per_param = "--preset" if opts["preset"] else "--bytes-per-param" if opts["bytes_per_param"] is not None else None
    if per_param and opts["params"] is None and opts["state_size"] is not None:  # it sizes --params only
        raise click.UsageError(f"{per_param} sizes --params (the state is parameters x bytes each), and --state-size "
                               f"gives the state's size: leave {per_param} out, or give --params (e.g. 1.4T) instead "
                               "of --state-size")
    if per_param and opts["params"] is None and run:
        raise click.UsageError(f"{per_param} sizes --params (the state is parameters x bytes each), and without "
                               f"--params the state is one checkpoint of the run (--from-run): leave {per_param} out, "
                               "or give --params (e.g. 70B) with it")
    if opts["state_size"] is not None:
        state = float(opts["state_size"])
    elif opts["params"] is not None:
        state = sizing.state_bytes(opts["params"], bpp)
    elif run and run.state_bytes:
        state = run.state_bytes
        notes.append(f"state {fmt_bytes(state)}: one checkpoint of the run")
    elif run:
        raise click.UsageError(f"the event log {', '.join(from_run)} has no completed save to size the state from "
                               f"({run.events} events): give --params (e.g. 70B) or --state-size (e.g. 1.4TB)")
    else:
        raise click.UsageError("give --params (e.g. 70B), --state-size (e.g. 1.4TB) or --from-run events.jsonl")
    bandwidth = opts["bandwidth"]
    if bandwidth is None and run:
        per_rank = run.replicate_Bps if run.write_tier != "direct" else run.write_Bps
        if per_rank:
            bandwidth = per_rank * gpus
            notes.append(f"bandwidth {fmt_rate(bandwidth)}: the run's {fmt_rate(per_rank)} per process x {gpus} "
                         "(assumes every process writes at that rate at once)")
    if bandwidth is None:
        raise click.UsageError("give --bandwidth (aggregate persistent write, e.g. 10GB/s)")
    interval = opts["interval"]
    if interval is None and run and run.interval_s:
        interval = run.interval_s
        notes.append(f"interval {fmt_seconds(interval)}: the run's median time between saves; give --interval "
                     "for the one you will train with")
    elif interval is None:
        interval = DEFAULT_INTERVAL_S
        if run:
            notes.append(f"interval {fmt_seconds(interval)}, the default: the run has fewer than two saves to "
                         "measure one from; give --interval")
    snap = opts["snapshot_bandwidth"]
    if snap is None and run and run.snapshot_Bps:
        snap = run.snapshot_Bps
        lazy = (f" ({run.lazy_snapshots} lazy save(s) timed from the call to the end of the copy, when the write "
                "started: the training waits for it only at fence())") if run.lazy_snapshots else ""
        notes.append(f"snapshot {fmt_rate(snap)} per GPU: measured in the run{lazy}")
    elif snap is None:
        snap = sizing.DEFAULT_SNAPSHOT_Bps
        notes.append(f"snapshot bandwidth {fmt_rate(snap)} per GPU assumed (pinned device-to-host); "
                     "set --snapshot-bandwidth")
    local = opts["local_bandwidth"]
    if local is None and run and run.write_tier in ("nvme", "gds") and run.write_Bps:
        local = run.write_Bps * min(gpn, gpus)
        notes.append(f"local tier {fmt_rate(local)} per node: the run's {fmt_rate(run.write_Bps)} per process "
                     f"x {min(gpn, gpus)}")
    try:
        inputs = sizing.PlanInputs(
            state_bytes=state, bandwidth_Bps=bandwidth, gpus=gpus, gpus_per_node=gpn, interval_s=interval,
            budget_s=opts["budget"], days=opts["days"], gpu_hour_cost=opts["gpu_hour_cost"], mtbf_s=opts["mtbf"],
            mtbf_per=opts["mtbf_per"], local_bandwidth_Bps=local, snapshot_bandwidth_Bps=snap,
            overhead_budget=opts["overhead_budget"], host_memory_bytes=opts["host_memory"])
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    return inputs, notes


def _strategy_json(s: sizing.Strategy) -> dict:
    d = dataclasses.asdict(s)
    d["young_daly_interval_seconds"] = d.pop("young_daly_interval_s")
    d["stall_seconds"] = d.pop("stall_s")
    return d


def to_json(p: sizing.Plan, notes: list[str], run: RunProfile | None) -> dict:
    s = p.synchronous
    return {
        "state_bytes": p.state_bytes, "state_bytes_per_node": p.state_bytes_per_node,
        "state_bytes_per_gpu": p.state_bytes_per_gpu, "staging_bytes_per_node": p.state_bytes_per_node,
        "nodes": p.nodes, "gpus": p.inputs.gpus,
        "write_seconds": p.write_s, "required_write_Bps": p.required_write_Bps,
        "required_write_Bps_per_node": p.required_write_Bps_per_node, "checkpoints": p.checkpoints,
        "overhead_fraction": s.overhead_fraction, "campaign_stall_hours": s.campaign_stall_hours,
        "campaign_gpu_hours_lost": s.campaign_gpu_hours_lost, "campaign_cost_lost": s.campaign_cost_lost,
        "young_daly_interval_seconds": s.young_daly_interval_s, "job_mtbf_seconds": p.job_mtbf_s,
        "synchronous": _strategy_json(s), "fastckpt": _strategy_json(p.fastckpt), "passed": p.passed,
        "inputs": dataclasses.asdict(p.inputs), "notes": notes + list(p.notes),
        "measured": dataclasses.asdict(run) if run else None,
    }


def _non_finite(data: dict, at: str = "") -> list[str]:
    """The keys (``fastckpt.stall_seconds`` for nested ones) whose value is an infinity or a NaN."""
    out = []
    for k, v in data.items():
        if isinstance(v, dict):
            out += _non_finite(v, f"{at}{k}.")
        elif isinstance(v, float) and not math.isfinite(v):
            out.append(f"{at}{k}")
    return out


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def render(p: sizing.Plan, notes: list[str]) -> None:
    out = console()
    i = p.inputs
    out.print(table("State (SI units: GB = 1e9 bytes)", ["", "value"], [
        ["total", fmt_bytes(p.state_bytes)],
        [f"per node ({_count(p.nodes, 'node')})", fmt_bytes(p.state_bytes_per_node)],
        [f"per GPU ({_count(i.gpus, 'GPU')})", fmt_bytes(p.state_bytes_per_gpu)],
        [f"synchronous write at {fmt_rate(i.bandwidth_Bps)}", fmt_seconds(p.write_s)],
        [f"bandwidth for a {fmt_seconds(i.budget_s)} write budget",
         f"{fmt_rate(p.required_write_Bps)} ({fmt_rate(p.required_write_Bps_per_node)} per node)"],
        [f"checkpoints in {i.days:g} days every {fmt_seconds(i.interval_s)}", f"{sig(p.checkpoints, 4)}"],
        ["job MTBF", fmt_seconds(p.job_mtbf_s)],
    ]))
    s, f = p.synchronous, p.fastckpt
    cost = [] if i.gpu_hour_cost is None else \
        [["cost lost", f"{s.campaign_cost_lost:,.0f}", f"{f.campaign_cost_lost:,.0f}"]]
    rework = [] if s.campaign_failures is None else [
        ["failures in the campaign", f"{sig(s.campaign_failures, 3)}", f"{sig(f.campaign_failures, 3)}"],
        ["GPU-hours redone after failures", f"{s.campaign_rework_gpu_hours:,.0f}",
         f"{f.campaign_rework_gpu_hours:,.0f}"]]
    out.print(table("Synchronous vs fastckpt", ["", "synchronous", "fastckpt"], [
        ["training stall per checkpoint", fmt_seconds(s.stall_s), f"{fmt_seconds(f.stall_s)} (snapshot)"],
        ["local tier write per checkpoint", "-", fmt_seconds(f.local_write_s)],
        ["drain to persistent storage", "-", f"{fmt_seconds(f.drain_s)} (needs {fmt_rate(f.drain_required_Bps)})"],
        ["overhead (stall / interval)", fmt_pct(s.overhead_fraction), fmt_pct(f.overhead_fraction)],
        ["stall over the campaign", fmt_seconds(s.campaign_stall_hours * 3600),
         fmt_seconds(f.campaign_stall_hours * 3600)],
        ["GPU-hours lost to stalls", f"{s.campaign_gpu_hours_lost:,.1f}", f"{f.campaign_gpu_hours_lost:,.1f}"],
        *cost, *rework,
        ["Young/Daly interval", fmt_seconds(s.young_daly_interval_s), fmt_seconds(f.young_daly_interval_s)],
        [f"verdict (budget {fmt_pct(i.overhead_budget)})", "PASS" if s.passed else "MISS",
         "PASS" if f.passed else "MISS"],
    ]))
    for line in [*s.problems, *s.advice, *f.problems, *f.advice, *notes, *p.notes]:
        out.print(f"- {line}", markup=False)


@click.command()
@click.option("--params", type=PARAMS,
              help=f"Model parameters, a count (not bytes): 70B is 70 billion, also 7e9, 1.3T, 350M ({PARAMS_UNITS}); "
                   "times --preset's bytes per parameter is the state.")
@click.option("--preset", type=click.Choice(sorted(sizing.PRESETS)),
              help="Bytes per parameter: " + "; ".join(f"{k} {v[0]:g} B ({v[1]})" for k, v in sizing.PRESETS.items())
              + ". Default mixed-adam.")
@click.option("--bytes-per-param", type=FINITE_POSITIVE, help="Bytes per parameter, instead of --preset.")
@click.option("--state-size", type=SIZE, help="The whole checkpoint, instead of --params (e.g. 1.4TB).")
@click.option("--gpus", type=count_range(), help="GPUs in the job (default: one node).")
@click.option("--gpus-per-node", type=count_range(1, 4096), default=8, show_default=True)
@click.option("--interval", type=DURATION, default=None,
              help="Time between checkpoints [default: the run's with --from-run, else 2h].")
@click.option("--bandwidth", type=BANDWIDTH, help="Aggregate persistent write bandwidth, e.g. 10GB/s.")
@click.option("--budget", type=DURATION, default="60s", show_default=True, help="Write budget per checkpoint.")
@click.option("--days", type=FINITE_POSITIVE, default=30.0, show_default=True, help="Length of the training campaign.")
@click.option("--gpu-hour-cost", type=FINITE_POSITIVE, help="Cost of one GPU-hour (any currency).")
@click.option("--mtbf", type=DURATION, help="Mean time between failures, e.g. 5000h (see --mtbf-per).")
@click.option("--mtbf-per", type=click.Choice(["node", "job"]), default="node", show_default=True,
              help="Whether --mtbf is one node's (the job's is that / nodes) or the whole job's.")
@click.option("--local-bandwidth", type=BANDWIDTH, help="Per-node burst buffer (NVMe) write bandwidth.")
@click.option("--snapshot-bandwidth", type=BANDWIDTH,
              help="Per-GPU device-to-host (or memcpy) bandwidth [default: 20GB/s].")
@click.option("--host-memory", type=SIZE, help="Host memory per node (e.g. 2TB): checks that the staging buffers fit.")
@click.option("--overhead-budget", type=OVERHEAD_BUDGET, default=0.02,
              show_default=True,
              help="Largest acceptable fraction of wall time spent stalled.")
@click.option("--from-run", type=click.Path(exists=True, dir_okay=False), multiple=True,
              help="A run's event log (Checkpointer(event_log=...)): measured sizes and bandwidths. Once per log "
                   "when each rank (or node) has its own.")
@json_option
def plan(as_json: bool, from_run: tuple[str, ...], **opts: object) -> None:
    """Size checkpoint storage: state, write time, bandwidth needed, overhead, cost, Young/Daly.

    Shows a synchronous save and fastckpt (snapshot, local tier, drain) side by side. SI
    units (GB = 1e9 bytes). Exit 0 when fastckpt meets the overhead budget, its tiers keep
    up with the interval and (with --mtbf) the interval is shorter than the job's MTBF, 1 when
    not (the output names the smallest change that fixes it).
    """
    run = None
    if from_run:
        skipped: list[str] = []
        try:
            logs = {p: read_events(p, skipped) for p in unique_paths(from_run)}
        except ValueError as exc:
            raise click.UsageError(str(exc)) from exc
        if empty := [p for p, events in logs.items() if not events]:  # a wrong path, or a rank that never saved
            raise click.UsageError(f"the event log {', '.join(empty)} is empty (no event): give the file the run's "
                                   "Checkpointer(event_log=...) wrote, once it has saved, or leave --from-run out "
                                   "and give --params or --state-size")
        run = profile(sorted((e for events in logs.values() for e in events), key=lambda e: (e.start, e.end)),
                      len(skipped))
    inputs, notes = _resolve(opts, run, from_run)
    result = sizing.plan(inputs)
    data = to_json(result, notes, run)
    overflowed = _non_finite(data)
    if overflowed:  # JSON has no infinity: a number too large or too small in the inputs
        raise click.UsageError(f"the inputs give non-finite {', '.join(overflowed)}: check the sizes and "
                               "bandwidths for a value far too large or too small")
    if as_json:
        emit_json(data)
    else:
        render(result, notes)
    exit_with(result.passed)
