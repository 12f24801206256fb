"""What a real run measured, read from its event log (``Checkpointer(event_log=...)``).

Each line is one ``fastckpt.events.Event`` as JSON: ``name`` (snapshot, write, commit, queued,
replicate, retry, load), ``rank``, ``path``, ``bytes``, ``start``, ``end``, ``tier``. Rates are
medians over events of bytes / duration, per process (one process per GPU). The log is read
with ``eventlog.read_events``, as ``fastckpt report`` reads it.
"""

from __future__ import annotations

import bisect
import posixpath
import re
import statistics
from dataclasses import dataclass, field

from ..events import LAZY, Event
from ..runstate import RunState, resave_home
from ..urls import untagged

_LAZY = (LAZY, "lazy")  # a lazy save's snapshot detail, now and before its fence event was logged
CLUSTER_GAP_S = 1.0  # single files further apart than this (end to next start) are separate checkpoints
# a directory named for a step (step-5, global_step10, iter_0000100, Hugging Face's checkpoint-500,
# ckpt_500): its files form one checkpoint (docs/plan.md)
_STEP_DIR = re.compile(r"(step|iter|iteration|epoch|checkpoint|ckpt)[-_=]?(\d+)$", re.IGNORECASE)
# a file joins its directory's checkpoint across a gap under this share of the run's save interval
JOIN_SHARE = 0.1
SHARD_NUMBERS = 64  # a number below this (or its folder's step) in a save folder's file names is a shard's
_LAST_NUMBER = re.compile(r"(\d+)\D*$")  # the number a file's name ends in: model_500.pt, optimizer-0.pt


@dataclass(frozen=True)
class RunProfile:
    """Measured on one run. Rates are per process; None where the log has no such phase.

    ``state_bytes``: one checkpoint (all ranks: a group's committed total, else the bytes of
    the snapshots of one checkpoint, see ``_checkpoints``). ``write_tier``: where ``write``
    events wrote (nvme or gds: the local tier; direct: persistent storage). ``interval_s``:
    median time between checkpoints. ``skipped_lines``: lines of the log that were not events.
    ``logged_share``: the median share of a committed group's bytes that the log's own saves
    hold (about 1 when the log has every rank's events; 1/8 for one of 8 ranks' logs); None
    without group commits. ``lazy_snapshots``: the lazy saves in ``snapshot_Bps``, each timed
    from its call to the end of its copy (``_snapshot_rate``).
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
    skipped_lines: int = 0
    logged_share: float | None = None
    lazy_snapshots: int = 0


def _snapshot_rate(events: list[Event]) -> tuple[float | None, int]:
    """The median snapshot rate per process, and how many lazy saves it counts. A lazy save's
    ``snapshot`` event spans its call only (the copy runs on in the background, until
    ``fence()``): its copy is timed from the call to its ``write``'s start, which waits for the
    copy (at most: a write queued behind an earlier one starts later). A lazy save whose write
    is not in the log is left out."""
    snaps = [e for e in events if e.name == "snapshot" and e.error is None and e.bytes > 0]
    lazy = {(e.rank, e.path, e.start): e.bytes for e in snaps if e.detail in _LAZY}
    eager = _rates([e for e in snaps if e.detail not in _LAZY])
    copies: list[float] = []
    if lazy:
        state = RunState()
        for e in events:
            state.feed(e)
        copies = [lazy[k] / (w.start - s.start) for s in state.saves() if (k := (s.rank, s.path, s.start)) in lazy
                  and (w := s.phase("write")) is not None and w.error is None and w.start > s.start]
    rates = eager + copies
    return (statistics.median(rates) if rates else None), len(copies)


def _rates(events: list[Event]) -> list[float]:
    return [e.bytes / e.duration_s for e in events if e.error is None and e.duration_s > 0 and e.bytes > 0]


def _rate(events: list[Event]) -> float | None:
    rates = _rates(events)
    return statistics.median(rates) if rates else None


@dataclass
class _Cluster:
    """One checkpoint being gathered from snapshots: its start, bytes, latest end, and what each
    rank saved into it (the files, the units: a group directory, or a single file, and the
    ``one_save()`` block, if its files were saved in one)."""

    start: float
    bytes: float = 0.0
    end: float = 0.0
    files: set[tuple[int, str]] = field(default_factory=set)
    units: dict[int, set[str]] = field(default_factory=dict)
    blocks: dict[int, str | None] = field(default_factory=dict)


def _unit(path: str, groups: set[str]) -> str:
    """What a file is saved as part of: its group directory (one the log commits as a group, or
    one named for a step: its directory, or that one's parent, as Megatron's
    iter_0000100/mp_rank_00/), else the file itself. A file named for another step than its
    directory's (ckpt1/step-200.pt: a run directory may be named ckpt1 too), or for a step
    outside any step directory, is a checkpoint of its own; one named for its directory's step
    (step_100/model_step100.pt) is part of that directory."""
    d = posixpath.dirname(path)
    if d in groups:
        return d
    own = _STEP_DIR.search(posixpath.splitext(posixpath.basename(path))[0])
    for up in (d, posixpath.dirname(d)):
        if (m := _STEP_DIR.search(posixpath.basename(up))) and (own is None or int(own[2]) == int(m[2])):
            return up
    return path


def _name_number(path: str) -> int | None:
    m = _LAST_NUMBER.search(posixpath.splitext(posixpath.basename(path))[0])
    return int(m[1]) if m else None


def _join_bounds(snaps: list[Event], groups: set[str]) -> dict[str, float]:
    """Per unit, ``JOIN_SHARE`` of the median time between a rank's saves of one path in it
    (ckpt3/last.pt every 100 s: best.pt 30 s after one is another save); no limit where no path
    is saved again. Per unit: a small file re-saved every 30 s elsewhere bounds nothing here."""
    last: dict[tuple[int, str], float] = {}
    gaps: dict[str, list[float]] = {}
    for e in snaps:
        if (e.rank, e.path) in last:
            gaps.setdefault(_unit(e.path, groups), []).append(e.start - last[e.rank, e.path])
        last[e.rank, e.path] = e.start
    return {unit: statistics.median(g) * JOIN_SHARE for unit, g in gaps.items()}


def _same_save(home: _Cluster, e: Event, unit: str, last_unit: dict[int, str], bound: float) -> bool:
    """Whether ``e`` joins its directory's newest checkpoint ``home`` however far apart: its
    rank saved neither that file there nor, after its files there, a file of another unit; the
    gap is under ``bound`` (``_join_bounds``); and its name carries no other number than the
    rank's files there (epoch_1/model_500.pt, then model_1000.pt: two saves; so in a run folder
    named ckpt1), unless both are shard numbers of a folder named for one save (step_100/,
    checkpoint-500/, global_step500/): below its step, or ``SHARD_NUMBERS`` (model_shard_0.pt
    ... 3, rng_state_0.pth)."""
    n, mine = _name_number(e.path), [p for r, p in home.files if r == e.rank]
    if (e.rank, e.path) in home.files or home.blocks.get(e.rank, e.block) != e.block or e.start - home.end >= bound:
        return False
    folder = _STEP_DIR.search(posixpath.basename(unit))
    shards = 0 if folder is None or folder[1].lower() == "epoch" else max(int(folder[2]), SHARD_NUMBERS)

    def same(p: str) -> bool:
        m = _name_number(p)
        return m is None or m == n or (m < shards and n < shards)  # type: ignore[operator]

    return not mine or (last_unit[e.rank] == unit and (n is None or all(same(p) for p in mine)))


def _group_commits(events: list[Event]) -> dict[tuple[int, str], list[Event]]:
    """Each rank's published group commits, per group path, in order. Every commit is a checkpoint,
    as ``fastckpt report`` counts a group's commits per rank: a group re-saved under one path (a
    ``last`` group, a DeepSpeed tag) is committed once per save, and its n-th commit from each rank
    is the same n-th checkpoint."""
    out: dict[tuple[int, str], list[Event]] = {}
    for e in sorted((e for e in events if e.name == "commit" and e.detail == "group" and e.error is None),
                    key=lambda e: e.start):
        out.setdefault((e.rank, e.path), []).append(e)
    return out


def _checkpoints(events: list[Event]) -> list[tuple[float, float]]:
    """(start, bytes) of each checkpoint: group commits, else snapshots gathered into checkpoints.

    Without a group commit, a snapshot starts a new checkpoint when its rank already saved the
    same file in the current one, or a file of another unit (the next single file, the next
    step's directory), or when it starts more than ``CLUSTER_GAP_S`` after the last one ended.
    Files of one group directory, from one rank or many, are one checkpoint whatever the gaps
    between them (a rank saves model.pt, waits seconds for it, then saves optimizer.pt): a file
    joins its directory's newest checkpoint unless ``_same_save`` tells it is another save. The
    single files of different ranks saved together are one checkpoint. The files of one
    ``one_save()`` block (their snapshots name it) are one checkpoint whatever their names and
    gaps, and a rank's file outside that block starts the next."""
    commits = _group_commits(events)
    if commits:  # the n-th checkpoint of a group starts with the first of its ranks' n-th commit calls
        first: dict[tuple[str, int], Event] = {}
        for (_, path), calls in commits.items():
            for n, e in enumerate(calls):
                if (path, n) not in first or e.start < first[path, n].start:
                    first[path, n] = e
        return sorted((e.start, float(e.bytes)) for e in first.values())
    groups = {e.path for e in events if e.name == "commit" and e.detail == "group"}  # failed ones name them too
    out: list[_Cluster] = []
    newest: dict[str, _Cluster] = {}  # each group directory's newest checkpoint
    last_unit: dict[int, str] = {}  # each rank's unit of its last snapshot
    snaps = sorted((e for e in events if e.name == "snapshot" and e.error is None), key=lambda e: e.start)
    bounds = _join_bounds(snaps, groups)
    for e in snaps:
        unit, c = _unit(e.path, groups), out[-1] if out else None
        home = newest.get(unit)
        joins = c is not None and e.block is not None and c.blocks.get(e.rank) == e.block
        if home is not None and _same_save(home, e, unit, last_unit, bounds.get(unit, float("inf"))):
            c = home
        elif not joins and (c is None or e.start - c.end > CLUSTER_GAP_S or (e.rank, e.path) in c.files or
                            unit not in c.units.get(e.rank, {unit}) or c.blocks.get(e.rank, e.block) != e.block):
            c = _Cluster(e.start)
            out.append(c)
        if unit != e.path:
            newest[unit] = c
        c.bytes += e.bytes
        c.end = max(c.end, e.end)
        c.files.add((e.rank, e.path))
        c.units.setdefault(e.rank, set()).add(unit)
        c.blocks.setdefault(e.rank, e.block)
        last_unit[e.rank] = unit
    return [(c.start, c.bytes) for c in out]


def _logged_share(events: list[Event]) -> float | None:
    """See ``RunProfile.logged_share``: each group commit's total (its files' sizes) against the
    sizes of the files the log wrote into it (each file's last ``write`` before that commit, so a
    group re-saved under one path is not summed over its saves). A snapshot's bytes are the
    tensors' alone: a file also holds its pickle, zip records and alignment, so a log of every
    rank with many small tensors, or none, once read as a share of a rank's."""
    commits = _group_commits(events)
    totals = {(path, n): e.bytes for (_, path), calls in commits.items() for n, e in enumerate(calls)}
    # a burst-buffer copy's path, its store's tag dropped (urls.untagged), ends with its home's
    plain = {g.replace("://", "/").lstrip("/"): g for _, g in commits}
    saved: dict[tuple[str, int], dict[tuple[int, str], int]] = {}
    for e in events:
        if e.name != "write" or e.error is not None:
            continue
        parts = untagged(resave_home(posixpath.dirname(e.path))).lstrip("/").split("/")  # a re-save's: its group's
        group = next((plain[t] for k in range(len(parts)) if (t := "/".join(parts[k:])) in plain), None)
        # a write belongs to its rank's next commit of the group: each re-save is compared with its own commit
        n = bisect.bisect_left([c.end for c in commits.get((e.rank, group), [])], e.end)
        if (group, n) in totals:
            saved.setdefault((group, n), {})[(e.rank, e.path)] = e.bytes
    shares = [sum(saved[k].values()) / t for k, t in totals.items() if t > 0 and sum(saved.get(k, {}).values()) > 0]
    return statistics.median(shares) if shares else None


def profile(events: list[Event], skipped_lines: int = 0) -> RunProfile:
    """Summarise an event log (see ``RunProfile``); ``skipped_lines``: lines of it that were not
    events (``eventlog.read_events``)."""
    by = {name: [e for e in events if e.name == name] for name in ("write", "replicate")}
    ckpts = _checkpoints(events)
    gaps = [b[0] - a[0] for a, b in zip(ckpts, ckpts[1:])]
    tiers = [e.tier for e in by["write"]]
    snapshot_Bps, lazy = _snapshot_rate(events)
    return RunProfile(
        events=len(events), ranks=len({e.rank for e in events}), checkpoints=len(ckpts),
        state_bytes=statistics.median(b for _, b in ckpts) if ckpts else None,
        snapshot_Bps=snapshot_Bps, write_Bps=_rate(by["write"]),
        write_tier=max(set(tiers), key=tiers.count) if tiers else None,
        replicate_Bps=_rate(by["replicate"]), interval_s=statistics.median(gaps) if gaps else None,
        skipped_lines=skipped_lines, logged_share=_logged_share(events), lazy_snapshots=lazy)
