"""The arithmetic behind ``fastckpt plan``: pure functions over frozen dataclasses, no I/O.

Every number is one a reviewer can redo by hand (SI units: GB = 1e9 bytes):

- state = parameters x bytes per parameter; per node = state / nodes; per GPU = state / GPUs.
- synchronous: the training stalls for the whole write, ``write_s = state / bandwidth``.
- ``required_write_Bps = state / budget_s`` (the write budget, default 60 s).
- overhead = stall per checkpoint / interval (the interval is wall time from one checkpoint to
  the next); checkpoints = campaign / interval; stall hours = checkpoints x stall / 3600;
  GPU-hours lost = stall hours x GPUs.
- rework: failures = campaign / MTBF_job, each losing the work since the last checkpoint; with
  failures at random (exponential, mean M) and an interval t that is ``E[T | T < t] =
  M - t / (e^(t/M) - 1)``, about t/2 when t << M and never more than M, so the rework stays
  under the campaign. An interval of M or more misses: most intervals end in a failure.
- Young/Daly: the interval that minimises checkpoint cost plus rework after failures is
  ``sqrt(2 x stall x MTBF_job)`` (Young 1974, Daly 2006's first order), where the job's MTBF
  is a node's MTBF / nodes.
- fastckpt (async): the stall is the snapshot, ``(state / GPUs) / snapshot bandwidth``; the
  node-local tier absorbs a checkpoint in ``(state / nodes) / local bandwidth``; the burst
  buffer drains to persistent storage in ``state / bandwidth``; both must finish within the
  interval, else the next checkpoint waits for them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..units import fmt_bytes, sig

# bytes per parameter in a checkpoint, and where they come from
PRESETS: dict[str, tuple[float, str]] = {
    "mixed-adam": (16, "bf16 weights 2 + bf16 gradients 2 + fp32 master 4 + Adam m 4 + Adam v 4"),
    "no-grads": (14, "bf16 weights 2 + fp32 master 4 + Adam m 4 + Adam v 4"),
    "weights-bf16": (2, "bf16 weights 2"),
    "fp8-adam": (11, "fp8 weights 1 + bf16 gradients 2 + fp32 master 4 + bf16 Adam m 2 + bf16 Adam v 2"),
}
#: the share of a node's host memory the staging buffers may pin (the rest: the job, its loaders, the OS)
STAGING_SHARE = 0.5
DEFAULT_SNAPSHOT_Bps = 20e9  # per GPU: pinned device-to-host over PCIe Gen4 x16, about 20-25 GB/s
HOUR, DAY = 3600.0, 86400.0


def _s(seconds: float) -> str:
    return f"{seconds:,.0f} s" if seconds >= 100 else f"{sig(seconds, 3)} s"


def _flag_s(seconds: float) -> str:
    """As ``--interval`` takes it: ``477s``, ``8.34s`` (no thousands separator, no space), rounded
    up to 3 significant figures: the interval advised is the least that works (58.909 s: 59.0s)."""
    unit = 10.0 ** (math.floor(math.log10(seconds)) - 2) if seconds > 0 else 1.0
    return f"{sig(math.ceil(seconds / unit - 1e-9) * unit, 3).replace(',', '')}s"


@dataclass(frozen=True)
class PlanInputs:
    """What ``plan`` is given; units in the names (bytes, seconds, bytes per second).

    ``bandwidth_Bps`` is the aggregate persistent write bandwidth; ``local_bandwidth_Bps``
    the per-node burst buffer (NVMe) write bandwidth (None: no burst buffer, fastckpt's
    direct tier); ``snapshot_bandwidth_Bps`` the per-GPU device-to-host (or memcpy) rate.
    ``mtbf_s`` is per node or per job as ``mtbf_per`` says; ``host_memory_bytes`` a node's
    host memory (None: not checked), which holds fastckpt's pinned staging buffers.
    """

    state_bytes: float
    bandwidth_Bps: float
    gpus: int = 8
    gpus_per_node: int = 8
    interval_s: float = 2 * HOUR
    budget_s: float = 60.0
    days: float = 30.0
    gpu_hour_cost: float | None = None
    mtbf_s: float | None = None
    mtbf_per: str = "node"
    local_bandwidth_Bps: float | None = None
    snapshot_bandwidth_Bps: float = DEFAULT_SNAPSHOT_Bps
    overhead_budget: float = 0.02
    host_memory_bytes: float | None = None

    def __post_init__(self) -> None:
        positive = {"state_bytes": self.state_bytes, "bandwidth_Bps": self.bandwidth_Bps, "gpus": self.gpus,
                    "gpus_per_node": self.gpus_per_node, "interval_s": self.interval_s, "budget_s": self.budget_s,
                    "days": self.days, "snapshot_bandwidth_Bps": self.snapshot_bandwidth_Bps}
        for name in ("mtbf_s", "local_bandwidth_Bps", "gpu_hour_cost", "host_memory_bytes"):
            if getattr(self, name) is not None:
                positive[name] = getattr(self, name)
        for name, v in positive.items():
            if not v > 0:
                raise ValueError(f"{name}={v!r} must be > 0")
        if self.mtbf_per not in ("node", "job"):
            raise ValueError(f"mtbf_per={self.mtbf_per!r} must be 'node' (one node's MTBF) or 'job' (the whole job's)")
        if not 0 < self.overhead_budget < 1:
            raise ValueError(f"overhead_budget={self.overhead_budget!r} must be a fraction in (0, 1), e.g. 0.02")

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def node_state_bytes(self) -> float:
        """The state on a full node: its GPUs' share (``state / nodes`` when the GPUs fill whole
        nodes; a job of 12 GPUs at 8 per node holds 8/12 of it on one node, not half)."""
        return self.state_bytes * min(self.gpus, self.gpus_per_node) / self.gpus

    @property
    def campaign_s(self) -> float:
        return self.days * DAY

    @property
    def job_mtbf_s(self) -> float | None:
        """A failure of any node stops the job: its MTBF is a node's divided by the nodes."""
        if self.mtbf_s is None:
            return None
        return self.mtbf_s / self.nodes if self.mtbf_per == "node" else self.mtbf_s


@dataclass(frozen=True)
class Strategy:
    """One way of checkpointing (synchronous, or fastckpt's tiers), costed over the campaign.

    ``problems`` name what misses the budget or cannot keep up; ``advice`` the smallest change
    that fixes each.
    """

    name: str
    stall_s: float
    overhead_fraction: float
    campaign_stall_hours: float
    campaign_gpu_hours_lost: float
    campaign_cost_lost: float | None
    young_daly_interval_s: float | None
    campaign_failures: float | None
    campaign_rework_gpu_hours: float | None
    passed: bool
    problems: tuple[str, ...] = ()
    advice: tuple[str, ...] = ()
    snapshot_s: float | None = None
    local_write_s: float | None = None
    drain_s: float | None = None
    drain_required_Bps: float | None = None
    drain_shortfall_Bps: float | None = None


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    state_bytes: float
    state_bytes_per_node: float
    state_bytes_per_gpu: float
    nodes: int
    write_s: float
    required_write_Bps: float
    required_write_Bps_per_node: float
    checkpoints: float
    job_mtbf_s: float | None
    synchronous: Strategy
    fastckpt: Strategy
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def passed(self) -> bool:
        """The plan passes when fastckpt's tiers meet the overhead budget and keep up."""
        return self.fastckpt.passed


def young_daly_interval(stall_s: float, job_mtbf_s: float | None) -> float | None:
    """``sqrt(2 x stall x MTBF_job)``: the checkpoint interval that minimises lost time."""
    if job_mtbf_s is None:
        return None
    return math.sqrt(2.0 * stall_s * job_mtbf_s)


def lost_per_failure(interval_s: float, job_mtbf_s: float) -> float:
    """The work a failure loses on average: the time since the last checkpoint, ``E[T | T <
    interval]`` for failures at random (exponential, mean ``job_mtbf_s``). About half an interval
    when the interval is much shorter than the MTBF; never more than the MTBF."""
    x = interval_s / job_mtbf_s
    if x < 1e-6:  # its series: the formula below cancels to noise, and to 0/0 for an infinite MTBF
        return interval_s * (0.5 - x / 12)
    return job_mtbf_s - interval_s * math.exp(-x) / -math.expm1(-x)  # no overflow for a large x


def _mtbf_miss(p: PlanInputs, shortest_s: float, young_daly_s: float | None) -> tuple[str, str] | None:
    """An interval of the job's MTBF or more: most intervals end in a failure before their
    checkpoint, so the run mostly redoes work. Returns the problem and the fix: the Young/Daly
    interval, or ``shortest_s`` (what the background tiers need) where that is longer."""
    mtbf = p.job_mtbf_s
    if mtbf is None or young_daly_s is None or p.interval_s < mtbf:
        return None
    share = lost_per_failure(p.interval_s, mtbf) / mtbf  # of all GPU-hours: rework = campaign / M x lost
    problem = (f"the {_s(p.interval_s)} interval is not shorter than the job's MTBF ({_s(mtbf)}): "
               f"{sig(-math.expm1(-p.interval_s / mtbf) * 100, 3)} % of intervals end in a failure, and "
               f"{sig(share * 100, 3)} % of the GPU-hours are redone")
    if max(young_daly_s, shortest_s) >= mtbf:
        return problem, ("interval: no interval shorter than the job's MTBF keeps up (the Young/Daly interval "
                         f"{_s(young_daly_s)}, the background tiers {_s(shortest_s)}): more bandwidth, or fewer "
                         "failures (fewer nodes, or more reliable ones)")
    fix = f"--interval {_flag_s(young_daly_s)}, the Young/Daly interval" if young_daly_s >= shortest_s else (
        f"--interval {_flag_s(shortest_s)}, what the background tiers need (the Young/Daly {_s(young_daly_s)} "
        "is shorter)")
    return problem, f"interval: shorter than the job's MTBF, e.g. {fix}"


def _costed(name: str, p: PlanInputs, stall_s: float) -> dict:
    """The campaign totals for a stall of ``stall_s`` per checkpoint (shared by both strategies)."""
    overhead = stall_s / p.interval_s
    stall_hours = (p.campaign_s / p.interval_s) * stall_s / HOUR
    gpu_hours = stall_hours * p.gpus
    mtbf = p.job_mtbf_s
    failures = rework = None
    if mtbf is not None:
        failures = p.campaign_s / mtbf
        rework = failures * lost_per_failure(p.interval_s, mtbf) / HOUR * p.gpus
    return {"name": name, "stall_s": stall_s, "overhead_fraction": overhead, "campaign_stall_hours": stall_hours,
            "campaign_gpu_hours_lost": gpu_hours,
            "campaign_cost_lost": gpu_hours * p.gpu_hour_cost if p.gpu_hour_cost is not None else None,
            "young_daly_interval_s": young_daly_interval(stall_s, mtbf), "campaign_failures": failures,
            "campaign_rework_gpu_hours": rework}


def _budget_advice(stall_s: float, p: PlanInputs, what: str, rate_name: str, rate_Bps: float) -> str:
    """The two single changes that bring the overhead within budget (both scale the stall by
    the same factor): a faster rate at this interval, or a longer interval at this rate."""
    factor = stall_s / (p.overhead_budget * p.interval_s)
    return (f"{what}: {rate_name} {sig(rate_Bps * factor / 1e9, 4)} GB/s at this interval ({sig(factor, 3)}x), "
            f"or an interval of {sig(p.interval_s * factor / HOUR, 4)} h at this rate")


def synchronous(p: PlanInputs) -> Strategy:
    write_s = p.state_bytes / p.bandwidth_Bps
    c = _costed("synchronous", p, write_s)
    problems: list[str] = []
    advice: list[str] = []
    if c["overhead_fraction"] > p.overhead_budget:
        problems.append(f"stall {_s(write_s)} per checkpoint is {sig(c['overhead_fraction'] * 100, 3)} % of the "
                        f"interval (budget {sig(p.overhead_budget * 100, 3)} %)")
        advice.append(_budget_advice(write_s, p, "synchronous", "bandwidth", p.bandwidth_Bps))
    if miss := _mtbf_miss(p, 0.0, c["young_daly_interval_s"]):
        problems.append(miss[0])
        advice.append(miss[1])
    return Strategy(**c, passed=not problems, problems=tuple(problems), advice=tuple(advice))


def tiered(p: PlanInputs) -> Strategy:
    """fastckpt: blocked for the snapshot only; the local tier and the drain run in the background."""
    snapshot_s = (p.state_bytes / p.gpus) / p.snapshot_bandwidth_Bps
    c = _costed("fastckpt", p, snapshot_s)
    problems: list[str] = []
    advice: list[str] = []
    if c["overhead_fraction"] > p.overhead_budget:
        problems.append(f"snapshot {_s(snapshot_s)} is {sig(c['overhead_fraction'] * 100, 3)} % of the interval")
        advice.append(_budget_advice(snapshot_s, p, "snapshot", "snapshot bandwidth per GPU",
                                     p.snapshot_bandwidth_Bps))
    local_s = None
    if p.local_bandwidth_Bps is not None:
        local_s = p.node_state_bytes / p.local_bandwidth_Bps
        if local_s > p.interval_s:
            need = p.node_state_bytes / p.interval_s
            problems.append(f"the local tier needs {_s(local_s)} per checkpoint, longer than the interval")
            advice.append(f"local tier: {sig(need / 1e9, 4)} GB/s per node, or an interval of "
                          f"{sig(local_s / HOUR, 4)} h")
    drain_s = p.state_bytes / p.bandwidth_Bps
    drain_need = p.state_bytes / p.interval_s
    shortfall = max(0.0, drain_need - p.bandwidth_Bps)
    if drain_s > p.interval_s:
        problems.append(f"draining to persistent storage takes {_s(drain_s)}, longer than the "
                        f"{_s(p.interval_s)} interval: bandwidth falls short by {sig(shortfall / 1e9, 4)} GB/s")
        advice.append(f"drain: persistent bandwidth {sig(drain_need / 1e9, 4)} GB/s, or an interval of "
                      f"{sig(drain_s / HOUR, 4)} h")
    if miss := _mtbf_miss(p, max(drain_s, local_s or 0.0), c["young_daly_interval_s"]):
        problems.append(miss[0])
        advice.append(miss[1])
    staging = p.node_state_bytes  # one host copy of every rank's state on the fullest node
    if p.host_memory_bytes is not None and staging > p.host_memory_bytes * STAGING_SHARE:
        problems.append(f"the staging buffers pin {fmt_bytes(staging, 4)} per node, more than "
                        f"{STAGING_SHARE:.0%} of its {fmt_bytes(p.host_memory_bytes, 4)} of host memory")
        fit = math.floor(p.host_memory_bytes * STAGING_SHARE * p.gpus / p.state_bytes)  # GPUs' shares a node holds
        spread = (f"spread the job over {math.ceil(p.gpus / fit)} nodes or more (at most {fit} GPUs per node), "
                  if fit >= 1 else f"one GPU's share ({fmt_bytes(p.state_bytes / p.gpus, 4)}) is already over it, "
                  "so no number of nodes does: use ")
        advice.append(f"staging: {spread}nodes with more memory, or tier='gds' where GPUDirect Storage works "
                      "(no host copy)")
    return Strategy(**c, passed=not problems, problems=tuple(problems), advice=tuple(advice),
                    snapshot_s=snapshot_s, local_write_s=local_s, drain_s=drain_s,
                    drain_required_Bps=drain_need, drain_shortfall_Bps=shortfall)


def plan(p: PlanInputs) -> Plan:
    """Size the storage for ``p``: the state, the synchronous cost and fastckpt's, side by side."""
    notes = []
    fc = tiered(p)
    sync = synchronous(p)
    if not sync.passed and fc.passed:
        sync = dataclasses.replace(sync, advice=sync.advice + (
            f"or save asynchronously: fastckpt stalls {sig(fc.stall_s, 3)} s per checkpoint with these tiers",))
    if p.host_memory_bytes is None:
        notes.append(f"fastckpt pins {fmt_bytes(p.node_state_bytes, 4)} of host memory per node for its staging "
                     "buffers (one copy of each rank's state; staging_buffers=N holds N): give --host-memory to "
                     "check that it fits")
    if fc.young_daly_interval_s is not None and fc.drain_s is not None and fc.young_daly_interval_s < fc.drain_s:
        notes.append(f"fastckpt's Young/Daly interval ({_s(fc.young_daly_interval_s)}) is shorter than the drain "
                     f"({_s(fc.drain_s)}): checkpoints cannot come more often than the drain allows")
    return Plan(inputs=p, state_bytes=p.state_bytes, state_bytes_per_node=p.node_state_bytes,
                state_bytes_per_gpu=p.state_bytes / p.gpus, nodes=p.nodes, write_s=p.state_bytes / p.bandwidth_Bps,
                required_write_Bps=p.state_bytes / p.budget_s,
                required_write_Bps_per_node=p.node_state_bytes / p.budget_s,
                checkpoints=p.campaign_s / p.interval_s, job_mtbf_s=p.job_mtbf_s,
                synchronous=sync, fastckpt=fc, notes=tuple(notes))


def state_bytes(params: float, bytes_per_param: float) -> float:
    return params * bytes_per_param
