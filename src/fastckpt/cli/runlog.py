"""What a real run measured, read from its event log (``Checkpointer(event_log=...)``).

Each line is one ``fastckpt.events.Event`` as JSON: ``name`` (snapshot, write, commit, queued,
replicate, retry, load), ``rank``, ``path``, ``bytes``, ``start``, ``end``, ``tier``. Rates are
medians over events of bytes / duration, per process (one process per GPU).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

from ..events import Event

CLUSTER_GAP_S = 1.0  # single-file saves starting within this of each other are one checkpoint


@dataclass(frozen=True)
class RunProfile:
    """Measured on one run. Rates are per process; None where the log has no such phase.

    ``state_bytes``: one checkpoint (all ranks: a group's committed total, else the bytes of
    the saves that started together). ``write_tier``: where ``write`` events wrote (nvme or gds:
    the local tier; direct: persistent storage). ``interval_s``: median time between checkpoints.
    """

    events: int
    ranks: int
    checkpoints: int
    state_bytes: float | None
    snapshot_Bps: float | None
    write_Bps: float | None
    write_tier: str | None
    replicate_Bps: float | None
    interval_s: float | None


def read_events(path: str) -> list[Event]:
    """Parse an event log; a torn last line (the writer was killed) is skipped.

    Raises:
        ValueError: a line in the middle does not parse (names the line).
    """
    events: list[Event] = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            d.pop("duration_s", None)
            events.append(Event(**d))
        except (ValueError, TypeError) as exc:
            if i == len(lines):
                break
            raise ValueError(f"{path}:{i} is not a fastckpt event ({exc}); pass the file given as "
                             "Checkpointer(event_log=...)") from exc
    return events


def _rate(events: list[Event]) -> float | None:
    rates = [e.bytes / e.duration_s for e in events if e.error is None and e.duration_s > 0 and e.bytes > 0]
    return statistics.median(rates) if rates else None


def _checkpoints(events: list[Event]) -> list[tuple[float, float]]:
    """(start, bytes) of each checkpoint: group commits, else clusters of snapshots."""
    commits = [e for e in events if e.name == "commit" and e.detail == "group" and e.error is None]
    if commits:  # one per rank and group: the first commit call of each group starts it
        first: dict[str, Event] = {}
        for e in sorted(commits, key=lambda e: e.start):
            first.setdefault(e.path, e)
        return sorted((e.start, float(e.bytes)) for e in first.values())
    out: list[tuple[float, float]] = []
    for e in sorted((e for e in events if e.name == "snapshot" and e.error is None), key=lambda e: e.start):
        if out and e.start - out[-1][0] <= CLUSTER_GAP_S:
            out[-1] = (out[-1][0], out[-1][1] + e.bytes)
        else:
            out.append((e.start, float(e.bytes)))
    return out


def profile(events: list[Event]) -> RunProfile:
    """Summarise an event log (see ``RunProfile``)."""
    by = {name: [e for e in events if e.name == name] for name in ("snapshot", "write", "replicate")}
    ckpts = _checkpoints(events)
    gaps = [b[0] - a[0] for a, b in zip(ckpts, ckpts[1:])]
    tiers = [e.tier for e in by["write"]]
    return RunProfile(
        events=len(events), ranks=len({e.rank for e in events}), checkpoints=len(ckpts),
        state_bytes=statistics.median(b for _, b in ckpts) if ckpts else None,
        snapshot_Bps=_rate(by["snapshot"]), write_Bps=_rate(by["write"]),
        write_tier=max(set(tiers), key=tiers.count) if tiers else None,
        replicate_Bps=_rate(by["replicate"]), interval_s=statistics.median(gaps) if gaps else None)
