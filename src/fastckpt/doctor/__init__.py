"""``fastckpt doctor``: probe each tier on this machine and say what ``auto`` would pick and why.

``diagnose(DoctorOptions(...))`` runs the checks in order (GPU, burst buffer, target, tiers)
and returns a Diagnosis: one Finding per check with its status and fix. docs/doctor.md.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field, replace

from ..errors import TierUnavailableError
from ..urls import is_url, local_path
from . import _core, gpu, local, remote
from .findings import STATUSES, Diagnosis, Finding

__all__ = ["STATUSES", "Diagnosis", "DoctorOptions", "Finding", "diagnose"]


@dataclass(frozen=True)
class DoctorOptions:
    """What to check.

    Args:
        local_dir: the burst buffer (Checkpointer ``local_dir``: a directory, or several striped,
            each checked and measured on its own), or None.
        target: where checkpoints are saved: a directory or a URL (None: the current directory).
        tier: the tier asked for; a tier other than "auto" that cannot work here is a failure.
        state_size: bytes of one checkpoint (per node), for the free-space checks.
        keep: checkpoints each place must hold at once (the newest, plus one being written).
        probe_bytes: size of the bandwidth probe (0: skip it).
        storage_options: fsspec options for a URL target (credentials are never printed).
        target_deadline_s: how long a URL target may take to answer (its retries included).
        progress: the progress display for the bandwidth probe ("auto", "log", "off"...).
    """

    local_dir: str | tuple[str, ...] | None = None
    target: str | None = None
    tier: str = "auto"
    state_size: int | None = None
    keep: int = 2
    probe_bytes: int = 256 << 20
    storage_options: dict = field(default_factory=dict)
    target_deadline_s: float = 20.0
    progress: str = "auto"

    @property
    def local_dirs(self) -> tuple[str, ...]:
        if not self.local_dir:
            return ()
        return (self.local_dir,) if isinstance(self.local_dir, str) else tuple(self.local_dir)


def _directory_checks(role: str, path: str, o: DoctorOptions, burst_buffer: bool, drives: int = 1) -> list[Finding]:
    out = [local.filesystem(role, path, burst_buffer), local.writable(role, path)]
    space = local.free_space(role, path, o.state_size, o.keep, drives)
    if out[-1].status == "fail":  # a full one still gets its free-space finding (how much a save needs)
        full = out[-1].data.get("errno") in (errno.ENOSPC, errno.EDQUOT)
        return out + ([space] if full else [])
    out += [local.odirect(role, path), space]
    if o.probe_bytes > 0:
        out.append(local.bandwidth(role, path, o.probe_bytes, o.state_size, o.progress))
    return out


def _same_device(a: str, b: str) -> bool:
    try:
        return os.stat(local.sysinfo.existing_parent(a)).st_dev == os.stat(local.sysinfo.existing_parent(b)).st_dev
    except OSError:
        return False


def _choices(o: DoctorOptions, tier: str, dest: str, cuda: bool) -> list[tuple[str | None, _core.TierChoice]]:
    """The tier selector's choice for a save to ``dest`` on each drive of the burst buffer (a save
    chooses per drive; each is probed here, as its first save there probes it), or without one."""
    return [(d, _core.TierSelector(tier, d, True).choose(dest, cuda)) for d in o.local_dirs or (None,)]


def _described(choices: list[tuple[str | None, _core.TierChoice]]) -> tuple[str, dict]:
    """The choices as a summary and data: one drive's (or none's) as the selector describes it; a
    striped burst buffer's with its drives counted, each one written buffered named with why."""
    first = choices[0][1]
    data = {"tier": first.tier, "rejected": dict(first.reasons), "odirect": all(c.odirect for _, c in choices)}
    if choices[0][0] is not None:
        data["drives"] = [{"local_dir": d, "tier": c.tier, "odirect": c.odirect, "odirect_reason": c.odirect_reason}
                          for d, c in choices]
    if len(choices) == 1:
        return first.describe(), data
    tiers = {c.tier for _, c in choices}
    tier = first.tier if len(tiers) == 1 else ", ".join(f"{c.tier} on {d}" for d, c in choices)
    buffered = [f"buffered on {d}: {c.odirect_reason}" for d, c in choices if not c.odirect]
    how = "; ".join([f"O_DIRECT on {len(choices) - len(buffered)} of {len(choices)} drives", *buffered])
    reasons: dict[str, list[str]] = {}
    for _, c in choices:
        for t, why in c.reasons.items():
            if why not in reasons.setdefault(t, []):
                reasons[t].append(why)
    data["rejected"] = {t: " / ".join(whys) for t, whys in reasons.items()}
    rejected = "".join(f"; {t} rejected: {why}" for t, why in data["rejected"].items())
    return f"tier={tier} ({how}){rejected}", data


def _tier_findings(o: DoctorOptions, dest: str, has_cuda: bool) -> tuple[list[Finding], dict[str, str]]:
    out, auto = [], {}
    dest = os.path.join(os.path.abspath(dest), "probe")  # choose() takes a save's path: it probes its directory
    for state, cuda in (("cpu", False), ("cuda", True)) if has_cuda else (("cpu", False),):
        summary, data = _described(_choices(o, "auto", dest, cuda))
        auto[state] = data["tier"]
        out.append(Finding(f"tier.auto.{state}", "info", f"auto picks for a {state.upper()} state: {summary}",
                           data=data))
    if o.tier != "auto":
        try:
            summary, data = _described(_choices(o, o.tier, dest, o.tier == "gds"))
        except TierUnavailableError as exc:
            out.append(Finding("tier.requested", "fail", f"tier={o.tier!r} cannot work here: {exc}",
                               "use tier='auto', or fix what the message names", {"tier": o.tier}))
        else:
            out.append(Finding("tier.requested", "ok", f"tier={o.tier!r} works here: {summary}",
                               data={"tier": data["tier"]}))
    return out, auto


def diagnose(o: DoctorOptions) -> Diagnosis:
    """Run every check that applies to ``o``."""
    findings: list[Finding] = []
    cuda_finding, has_cuda = gpu.cuda()
    dirs = o.local_dirs
    findings += [cuda_finding, gpu.libcuda(), gpu.kvikio(), gpu.gds(has_cuda, dirs[0] if dirs else None)]
    drives = len({sp.mountpoint for d in dirs if (sp := local.sysinfo.space(d)) is not None}) or 1
    for i, d in enumerate(dirs):  # striped: each drive's own checks and bandwidth, and its share of the space
        findings += _directory_checks("local_dir" if len(dirs) == 1 else f"local_dir[{i}]", d, o, True, drives)
    if len(dirs) > 1 and (whole := local.stripe_space(dirs, o.state_size, o.keep)) is not None:
        findings.append(whole)
    url = is_url(target := o.target or os.getcwd())
    target = target if url else local_path(target)  # file:///data/ckpt is the directory /data/ckpt, as in save()
    if url:
        if not dirs:
            findings.append(Finding("target.burst_buffer", "fail", f"{target} is a URL: saves there go through a "
                                    "burst buffer", "pass --local-dir (Checkpointer(local_dir=...))"))
        findings += [remote.credentials(target, o.storage_options),
                     remote.reachable(target, o.storage_options, o.target_deadline_s)]
    else:
        # the target's bandwidth matters when saves write there directly (no burst buffer)
        findings += _directory_checks("target", target, o if not dirs else replace(o, probe_bytes=0),
                                      burst_buffer=False)
        shared = [d for d in dirs if _same_device(d, target)]
        if shared:
            findings.append(Finding("target.separate", "warn", f"{target} and the burst buffer {shared[0]} are on "
                                    "the same filesystem: losing it loses both copies",
                                    "save to a persistent filesystem (or URL) other than the burst buffer's"))
        if (both := local.shared_space(target, shared, o.state_size, o.keep, drives)) is not None:
            findings.append(both)
    blocked = any(f.status == "fail" for f in findings
                  if f.check.startswith(("local_dir", "target")) and f.check.endswith(".writable"))
    dest = target if not url and not blocked else (dirs[0] if dirs else os.getcwd())
    if blocked or (url and not dirs):  # nothing a save could write to: no tier to name
        tier_findings, auto = [], {}
    else:
        tier_findings, auto = _tier_findings(o, dest, has_cuda)
    return Diagnosis(tuple(findings + tier_findings), auto)
