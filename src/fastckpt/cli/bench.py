"""``fastckpt bench``: a gdsio-style write/read stress test of checkpoint storage.

N workers per node (threads or processes) each write, then read, one file per worker in
fixed blocks, striped over the ``--dir`` mounts, through fastckpt's own IO path (bench_io.py).
Under ``torchrun`` every node runs its workers between two barriers, and rank 0 divides all
nodes' bytes by the time between the barriers: the aggregate is what the fabric sustained.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import socket
import threading
import time
from dataclasses import dataclass

import click

from .. import sysinfo
from ..errors import WRITE_FIXES
from ._common import (
    BANDWIDTH,
    DURATION,
    SIZE,
    FiniteRange,
    console,
    emit_json,
    exit_with,
    fmt_bytes,
    fmt_pct,
    fmt_rate,
    json_option,
    progress,
    table,
)
from ._localdir import distinct_dirs
from ._signals import sigterm_interrupts
from .bench_dist import Dist
from .bench_io import ALIGN, START_TIMEOUT_S, Job, Phase, WorkerResult, percentiles

PASS_FRACTION = 0.8  # the readiness checklist's gate: >= 80 % of the fabric's capacity
FREE_SHARE = 0.95  # of a drive's free space, the most a bench fills (the rest: the filesystem, other writers)


@dataclass(frozen=True)
class Settings:
    dirs: tuple[str, ...]
    workers: int
    engine: str
    block_bytes: int
    file_bytes: int
    duration_s: float | None
    mode: str
    direct: bool
    gds: bool
    verify: bool


def _failed(s: Settings, exc: OSError | MemoryError) -> str:
    """``bench failed:`` and the worker's error, with the fix a save's write names for it (a
    read-only --dir, no permission, a full drive); out of memory says what holds it and the fix
    (a MemoryError's message is empty)."""
    if isinstance(exc, MemoryError) or exc.errno == errno.ENOMEM:
        return (f"bench failed: out of memory ({str(exc) or type(exc).__name__}): each of the {s.workers} "
                f"worker(s) holds its --block-size block of {fmt_bytes(s.block_bytes)} twice (the aligned buffer "
                "and its pattern); lower --block-size or --workers")
    fix = WRITE_FIXES.get(exc.errno) if exc.errno is not None else None  # a read-only --dir, no permission...
    return f"bench failed: {exc}" + (f": {fix}" if fix else "")


@dataclass(frozen=True)
class PhaseResult:
    """One op over all nodes: bytes, rank 0's seconds between the barriers, the workers."""

    op: str
    bytes: int
    seconds: float
    workers: tuple[WorkerResult, ...]

    @property
    def Bps(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


def _run_dirs(s: Settings, rank: int) -> list[str]:
    """This run's folders: host and PID can repeat (containers sharing a --dir), so a random suffix too."""
    tag = f"fastckpt-bench-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}-r{rank}"
    return [os.path.join(d, tag) for d in s.dirs]


def _jobs(s: Settings, op: str, run_dirs: list[str], d: Dist, timed: bool) -> list[Job]:
    return [Job(op, d.rank, w, os.path.join(run_dirs[w % len(run_dirs)], f"worker-{w:03d}.dat"), s.file_bytes,
                s.block_bytes, s.direct, s.duration_s if timed else None, s.verify, s.gds, d.local_rank)
            for w in range(s.workers)]


def _phase(s: Settings, op: str, run_dirs: list[str], d: Dist, show: bool) -> PhaseResult:
    """One op on every node: "prepare" writes the files a read-only run reads (one pass, untimed)."""
    timed = s.duration_s is not None and op != "prepare"
    jobs = _jobs(s, "write" if op == "prepare" else op, run_dirs, d, timed)
    phase = Phase(jobs, s.engine)
    label = {"prepare": "preparing files", "write": "writing", "read": "reading"}[op]
    if d.world > 1:
        label += f" (rank {d.rank} of {d.world})"
    try:
        phase.launch()
        phase.ready()
        d.barrier()
        t0 = phase.go()
        with progress(label, s.duration_s if timed else s.workers * s.file_bytes, enabled=show) as bar:
            while not phase.done():
                bar.update(time.perf_counter() - t0 if timed else phase.poll())
        results = phase.results()
        d.barrier()
        seconds = time.perf_counter() - t0
    finally:
        phase.close()
    everyone = [r for rs in d.gather(results) for r in rs]
    return PhaseResult(op, sum(r.bytes for r in everyone), seconds, tuple(everyone))


def run(s: Settings, d: Dist, show_progress: bool = True) -> list[PhaseResult]:
    """Run the phases ``s.mode`` asks for; files are removed afterwards, also on Ctrl-C."""
    run_dirs = _run_dirs(s, d.rank)
    show = show_progress and d.rank == 0
    created: list[str] = []  # removed at the end: only what this run made, never another's folder
    try:
        with sigterm_interrupts():
            for rd in run_dirs:
                os.mkdir(rd)
                created.append(rd)
            ops = {"write": ["write"], "read": ["prepare", "read"], "both": ["write", "read"]}[s.mode]
            results = [_phase(s, op, run_dirs, d, show) for op in ops]
    finally:
        for rd in created:
            if os.path.exists(rd):
                shutil.rmtree(rd)
    return [r for r in results if r.op != "prepare"]


def _check_space(s: Settings) -> None:
    """Per filesystem: two --dir on one drive share its free space (``FREE_SHARE`` of it); a ramfs
    (no size) the memory available; another that reports no size has no limit to check."""
    need: dict[int, int] = {}
    dirs: dict[int, list[str]] = {}
    for w in range(s.workers):
        dev = os.stat(d := s.dirs[w % len(s.dirs)]).st_dev
        need[dev] = need.get(dev, 0) + s.file_bytes
        if d not in dirs.setdefault(dev, []):
            dirs[dev].append(d)
    for dev, n in need.items():
        sp = sysinfo.space(dirs[dev][0])
        free = sysinfo.room(sp) if sp is not None else None
        if free is not None and n > free * FREE_SHARE:  # (None: no size limit it can tell, or no statvfs)
            where = dirs[dev][0] if len(dirs[dev]) == 1 else f"{', '.join(dirs[dev])} (one filesystem)"
            has = "free" if sp.free is not None else "of memory available (a ramfs keeps its files in memory)"
            raise click.UsageError(f"{where} has {fmt_bytes(free)} {has}, and a bench fills at most "
                                   f"{FREE_SHARE:.0%} of it ({fmt_bytes(free * FREE_SHARE)}: the rest is left for the "
                                   f"filesystem and other writers); this one needs {fmt_bytes(n)} there (--workers x "
                                   "--size): lower them or add a --dir on another drive")


def _refusal(s: Settings) -> tuple[int, str, dict | None] | None:
    """Why this node cannot run: (exit code, message, its --json body), before any file is made."""
    for x in s.dirs:
        if not os.path.isdir(x):  # click's check, made here: a node without the mount must tell its peers
            why = (" (bench measures a mounted directory; for an object store, `fastckpt doctor --target URL` "
                   "probes it)") if "://" in x else ""
            return 2, f"Invalid value for '--dir': Directory '{x}' does not exist{why}.", None
    if s.gds:
        from ..save.tiers import gds_unavailable_reason

        why = gds_unavailable_reason(True)
        if why is not None:
            return 1, f"GDS is not usable here: {why}", {"gds": True, "gds_unavailable_reason": why, "passed": False}
    try:
        _check_space(s)
    except click.UsageError as exc:
        return 2, exc.message, None
    return None


def _agree_to_run(s: Settings, d: Dist, as_json: bool) -> None:
    """Every node runs, or none: a node that refused ended alone, and its peers waited for it in
    the group's set-up for 30 minutes. A refusing node says why; the others name it."""
    mine = _refusal(s)
    every = d.gather(None if mine is None else (*mine, socket.gethostname()))
    if mine is not None:
        code, message, body = mine
        if code == 2:
            raise click.UsageError(message)
        emit_json(body) if as_json and body else click.echo(message, err=True)
        raise SystemExit(code)
    refused = [(rank, x) for rank, x in enumerate(every) if x is not None]
    if refused:
        rank, (code, message, _, host) = refused[0]
        text = f"bench not run: rank {rank} ({host}) refused to: {message}"
        emit_json({"passed": False, "refused": {"rank": rank, "host": host, "error": message}}) if as_json \
            else click.echo(text, err=True)
        raise SystemExit(code)


def to_json(s: Settings, phases: list[PhaseResult], world: int, capacity: float | None, pass_fraction: float) -> dict:
    out: dict = {"world_size": world, "workers_per_node": s.workers, "engine": s.engine, "dirs": list(s.dirs),
                 "block_bytes": s.block_bytes, "size_bytes": s.file_bytes, "duration_s": s.duration_s,
                 "direct": s.direct, "gds": s.gds, "verify": s.verify, "fabric_capacity_Bps": capacity,
                 "pass_fraction": pass_fraction, "write_Bps": None, "read_Bps": None, "workers": [], "latency": {}}
    for ph in phases:
        out[f"{ph.op}_Bps"] = ph.Bps
        out[f"{ph.op}_bytes"] = ph.bytes
        out[f"{ph.op}_seconds"] = ph.seconds
        out["latency"][ph.op] = percentiles([x for r in ph.workers for x in r.latencies_s])
        if capacity:
            out[f"{ph.op}_fraction_of_capacity"] = ph.Bps / capacity
        for r in ph.workers:
            out["workers"].append({"op": r.op, "rank": r.rank, "worker": r.worker, "path": r.path, "bytes": r.bytes,
                                   "seconds": r.seconds, "Bps": r.Bps, "odirect": r.odirect,
                                   "odirect_reason": r.odirect_reason, "checked_blocks": r.checked_blocks,
                                   "bad_blocks": r.bad_blocks, **percentiles(r.latencies_s)})
    bad = [f"rank {r.rank} worker {r.worker} ({r.path}): {r.bad_blocks} of {r.checked_blocks} blocks"
           for ph in phases for r in ph.workers if r.bad_blocks]
    missed = [ph.op for ph in phases if capacity and ph.Bps < pass_fraction * capacity]
    out.update(verify_failures=bad, missed=missed, passed=not bad and not missed)
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def render(data: dict) -> None:
    out = console()
    rows = [[w["op"], w["rank"], w["worker"], os.path.dirname(os.path.dirname(w["path"])), fmt_rate(w["Bps"]),
             _ms(w["p50_s"]), _ms(w["p99_s"]), _ms(w["max_s"]),
             "yes" if w["odirect"] else f"no ({w['odirect_reason']})"] for w in data["workers"]]
    out.print(table("Workers", ["op", "rank", "worker", "dir", "throughput", "p50 ms", "p99 ms", "max ms",
                                "O_DIRECT"], rows, right_from=4, text=(8,)))
    cap = data["fabric_capacity_Bps"]
    agg = []
    for op in ("write", "read"):
        if data[f"{op}_Bps"] is None:
            continue
        lat = data["latency"][op]
        frac = data.get(f"{op}_fraction_of_capacity")
        verdict = "-" if frac is None else ("PASS" if frac >= data["pass_fraction"] else "MISS")
        agg.append([op, fmt_bytes(data[f"{op}_bytes"]), f"{data[f'{op}_seconds']:.3f}", fmt_rate(data[f"{op}_Bps"]),
                    _ms(lat["p50_s"]), _ms(lat["p99_s"]), _ms(lat["max_s"]), fmt_pct(frac), verdict])
    title = f"Aggregate over {data['world_size']} node(s) x {data['workers_per_node']} workers"
    if cap:
        title += f" (fabric capacity {fmt_rate(cap)}, pass at >= {data['pass_fraction'] * 100:.0f} %)"
    out.print(table(title, ["op", "bytes", "seconds", "throughput", "p50 ms", "p99 ms", "max ms", "of capacity",
                            "verdict"], agg, text=(8,)))
    for line in data["verify_failures"]:
        out.print(f"- verify FAILED: {line}", markup=False)
    if data["verify"] and not data["verify_failures"]:
        out.print("- verify: every block read back as written")


@click.command()
@click.option("--dir", "dirs", multiple=True, required=True, type=click.Path(file_okay=False),
              callback=distinct_dirs,
              help="Directory to test (repeat to stripe workers over several mounts or drives).")
@click.option("--workers", type=click.IntRange(1, 1024), default=4, show_default=True, help="Workers per node.")
@click.option("--engine", type=click.Choice(["threads", "processes"]), default="threads", show_default=True)
@click.option("--block-size", type=SIZE, default="8MiB", show_default=True, help="Bytes per I/O call.")
@click.option("--size", type=SIZE, default="1GiB", show_default=True, help="File size per worker.")
@click.option("--duration", type=DURATION,
              help="Run each phase this long, passing over the files again (each write pass: a new file, the last one "
                   "written to its end).")
@click.option("--mode", type=click.Choice(["write", "read", "both"]), default="both", show_default=True)
@click.option("--direct/--buffered", default=True, show_default=True, help="O_DIRECT, or through the page cache.")
@click.option("--gds", is_flag=True, help="GPUDirect Storage through kvikio (says why not when it cannot).")
@click.option("--fabric-capacity", type=BANDWIDTH, help="What the storage fabric should sustain, e.g. 25GB/s.")
@click.option("--pass-fraction", type=FiniteRange(0, 1, min_open=True, want="a fraction, e.g. 0.8 for 80 %"),
              default=PASS_FRACTION, show_default=True, help="Pass at this fraction of --fabric-capacity.")
@click.option("--verify", is_flag=True, help="Check every block read (needs a read phase).")
@json_option
def bench(dirs: tuple[str, ...], workers: int, engine: str, block_size: int, size: int, duration: float | None,
          mode: str, direct: bool, gds: bool, fabric_capacity: float | None, pass_fraction: float, verify: bool,
          as_json: bool) -> None:
    """Stress-test storage: per-worker and aggregate GB/s, latency p50/p99/max, % of capacity.

    Run it under torchrun for several nodes (one process per node; --workers each). Exit 0
    when every phase reached --pass-fraction of --fabric-capacity (or none was given) and
    --verify found no bad block; 1 otherwise.
    """
    if block_size % ALIGN:
        raise click.UsageError(f"--block-size must be a multiple of {ALIGN} bytes (O_DIRECT alignment)")
    if size < block_size:  # no whole block to write: the run would move nothing
        smaller = size // ALIGN * ALIGN  # the largest block --size holds (blocks are whole O_DIRECT units)
        raise click.BadParameter(f"{size:,} bytes per worker is smaller than one --block-size block ({block_size:,} "
                                 f"bytes), so no block would be written: give --size {block_size} or more"
                                 + (f", or --block-size {smaller} or less" if smaller else ""), param_hint="--size")
    if verify and mode == "write":
        raise click.UsageError("--verify checks reads: use --mode both or read")
    s = Settings(tuple(dirs), workers, engine, block_size, size // block_size * block_size, duration, mode,
                 direct, gds, verify)
    try:
        d = Dist()  # under torchrun the group first: a node that refuses to run then ends every node's run
    except RuntimeError as exc:  # the master's port in use, a rendezvous that fails (gloo, the store)
        raise click.ClickException(f"bench failed: the nodes could not form their process group: {exc}") from exc
    try:
        _agree_to_run(s, d, as_json)
    except RuntimeError as exc:  # a peer gone while the nodes compared what each can run
        d.close()
        raise click.ClickException(f"bench failed: a node left before the run started: {exc}") from exc
    except BaseException:
        d.close()
        raise
    try:
        phases = run(s, d, show_progress=not as_json)
    except (OSError, MemoryError) as exc:  # ENOSPC, EIO, EMFILE, permission: the storage (or the node) failed it
        raise click.ClickException(_failed(s, exc)) from exc
    except threading.BrokenBarrierError as exc:  # no worker failed: one is still opening its file
        raise click.ClickException(f"bench failed: a worker did not open its file within {START_TIMEOUT_S:.0f} s "
                                   "(is the storage hung?)") from exc
    except RuntimeError as exc:  # a worker process died without a word (killed, out of memory)
        raise click.ClickException(f"bench failed: {exc}") from exc
    try:
        if d.rank == 0:
            data = to_json(s, phases, d.world, fabric_capacity, pass_fraction)
            emit_json(data) if as_json else render(data)
            passed = data["passed"]
        else:
            passed = None
        passed = d.gather(passed)[0]
    finally:
        d.close()
    exit_with(bool(passed))
