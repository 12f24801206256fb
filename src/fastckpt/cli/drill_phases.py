"""When to kill the drill's job, and what it was doing when it died.

Both come from the job's event log (one ``fastckpt.events.Event`` per finished phase of each
file, and one ``commit`` per group) and its ``save``/``durable`` lines. Pure functions: the
drill feeds them what it has read.

A checkpoint of step s goes: for each file in turn, ``snapshot`` (the training thread
copies it), then in the background ``write`` (to the burst buffer, or straight home),
``commit`` (rename into place) and, with a burst buffer, ``replicate`` (copy home, verify);
finally the group ``commit`` (rank marker, manifest, the ``latest`` pointer). Between
checkpoints the job is ``idle`` (training).
"""

from __future__ import annotations

import random
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from ..events import Event

PHASES = ("snapshot", "write", "commit", "replicate", "idle")
_STEP = re.compile(r"(?:^|/)step-(\d+)(?=/|$)")


def step_of_path(path: str) -> int | None:
    """The step of the drill job's checkpoint ``path`` is in: its last ``step-N`` component (the
    directory the drill saves into may hold one too: ``--dir /scratch/step-7/ckpt``)."""
    found = _STEP.findall(path)
    return int(found[-1]) if found else None


def _by_step(events: Iterable[Event]) -> dict[int, list[Event]]:
    out: dict[int, list[Event]] = {}
    for e in events:
        s = step_of_path(e.path)
        if s is not None and e.error is None:
            out.setdefault(s, []).append(e)
    return out


def _file_of(e: Event) -> str:
    return e.path.rsplit("/", 1)[-1]


def _phase_spans(evs: list[Event]) -> dict[str, tuple[float, float]]:
    """Wall-time (start, end) of each phase of one finished checkpoint."""
    spans: dict[str, tuple[float, float]] = {}
    files = [e for e in evs if e.detail != "group"]
    for name in ("snapshot", "write", "replicate"):
        xs = [e for e in files if e.name == name]
        if xs:
            spans[name] = (min(e.start for e in xs), max(e.end for e in xs))
    group = [e for e in evs if e.name == "commit" and e.detail == "group"]
    if group:
        before = [e.end for e in files if e.name in ("commit", "replicate")]
        spans["commit"] = (max(before) if before else group[0].start, group[0].end)
    return spans


@dataclass(frozen=True)
class Windows:
    """Median offsets (seconds) of each phase from the ``save`` line of its checkpoint, and
    of the idle time from a ``durable`` line to the next ``save``."""

    phases: dict[str, tuple[float, float]]
    idle: tuple[float, float] | None

    def pick(self, phase: str, rng: random.Random) -> tuple[str, float] | None:
        """(the anchor line to wait for: "save" or "durable", seconds after it), or None
        when this phase has not been seen (e.g. replicate without a burst buffer)."""
        if phase == "idle":
            if self.idle is None or self.idle[1] <= self.idle[0]:
                return None
            return "durable", rng.uniform(*self.idle)
        if phase not in self.phases:
            return None
        lo, hi = self.phases[phase]
        return "save", rng.uniform(lo, max(lo, hi))


def windows(events: list[Event], saves: dict[int, float], durables: dict[int, float], last: int = 5) -> Windows | None:
    """Windows from the newest ``last`` durable checkpoints; None before the first one."""
    by = _by_step(events)
    done = sorted(s for s in durables if s in saves and s in by)[-last:]
    if not done:
        return None
    offsets: dict[str, list[tuple[float, float]]] = {}
    for s in done:
        for name, (a, b) in _phase_spans(by[s]).items():
            offsets.setdefault(name, []).append((a - saves[s], b - saves[s]))
    phases = {n: (statistics.median(a for a, _ in xs), statistics.median(b for _, b in xs))
              for n, xs in offsets.items()}
    gaps = [min((t for s2, t in saves.items() if s2 > s), default=None) for s in done]
    idle = [g - durables[s] for s, g in zip(done, gaps) if g is not None]
    return Windows(phases, (0.0, statistics.median(idle)) if idle else None)


def in_progress(events: list[Event], saves: dict[int, float], durables: dict[int, float],
                files: tuple[str, ...], replicated: bool) -> tuple[str, ...]:
    """The phases under way when the job died (sorted, in pipeline order); ("idle",) when
    no checkpoint was in flight."""
    by = _by_step(events)
    pipeline = ["snapshot", "write", "commit"] + (["replicate"] if replicated else [])
    under_way: set[str] = set()
    newest_durable = max(durables, default=-1)  # older ones never made it (superseded or failed)
    for s in sorted(x for x in saves if x > newest_durable):
        evs = by.get(s, [])
        done = {(e.name, _file_of(e)) for e in evs if e.detail != "group"}
        started = True  # the first file's snapshot starts at the save line
        all_done = True
        for f in files:
            nxt = next((p for p in pipeline if (p, f) not in done), None)
            if nxt is not None:
                all_done = False
                if started:
                    under_way.add(nxt)
            started = ("snapshot", f) in done  # the next file's snapshot follows this one's
        if all_done:
            under_way.add("commit")  # the group commit: markers, manifest, latest pointer
    if not under_way:
        return ("idle",)
    return tuple(p for p in PHASES if p in under_way)
