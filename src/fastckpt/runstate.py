"""A run rebuilt from its events: each save's phases, the overhead curve, what is still pending.

``fastckpt report`` draws and summarises it; ``fastckpt serve-metrics`` exports its live numbers.
Both see only the event log, so some numbers are reconstructions (docs/report.md says how):

- overhead: the Monitor's rule replayed (blocked time = the ``snapshot`` phases; checked at the
  end of each save from the second one on; the window of ``overhead_window_s``), the clock
  starting when the Checkpointer was built (``replay``); the files of a ``one_save()`` block are
  one save, at its ``one_save`` event; a lazy save at its ``fence`` event, with the fence's wait
  (in its ``blocked_s`` too). Each rank's budget, window and clock are its job's (its ``start``
  event), unless given.
- a save is durable at the end of its ``replicate`` phase (burst buffer), or of its ``commit``
  when written straight to its path; a file of a group (its snapshot names it) at its rank's
  group ``commit`` (not durable until then; failed with it, or with another file of the attempt;
  abandoned when the group was ``remove()``d first). A replication dropped for a newer save
  (``replicate_policy='coalesce'``, or a newer save to its path) is superseded at its ``superseded``
  event. A log written before that event existed: a save that a later one to its path overtook
  is superseded (one path's uploads never overlap); one that coalescing dropped for another
  path stays pending (abandoned at its rank's next session): with several workers, another
  path's replication ending first says nothing (events are logged as they end).
- pending (``status()``): what ``stats().pending`` counts, work still running: a group's file at its
  path waits for a ``commit()`` call, not for work, so it is not pending; a group commit is, from its
  ``committing`` event (the call) to its group ``commit``, or ``uncommitted`` (it ended without one).
- sessions: a job killed and resumed with the same ``event_log`` appends to it. Events carry
  their Checkpointer's session (``JsonlSink``), and are matched only with saves of their own
  session; when a new session of a rank starts, that rank's saves left open by earlier ones
  count as abandoned (their job died), not pending, and its overhead replay starts over, as the
  new Checkpointer's Monitor does. Logs without sessions read as one session.
"""

from __future__ import annotations

import re
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace

from .eventlog import error_type
from .events import LAZY, Event
from .replay import OverheadPoint, RankOverheads, saved_at
from .urls import untagged

# a re-saved group's files are written beside it, in .TAG.fastckpt-next-<digest> (commit.protocol.NEXT_TAG)
_RESAVE = re.compile(r"/\.([^/]+)\.fastckpt-next(?:-[0-9a-f]+)?(/|$)")


def resave_home(path: str) -> str:
    """``path`` with a re-save directory (``.TAG.fastckpt-next-<digest>``) named as its group ``TAG``."""
    return _RESAVE.sub(r"/\1\2", path)


_OUTCOMES_KEPT = 4096  # groups' outcomes remembered (per rank and group)


@dataclass(frozen=True)
class Phase:
    """One phase of a save as logged: snapshot, write, commit, queued or replicate."""

    name: str
    start: float
    end: float
    error: str | None = None


@dataclass(frozen=True)
class SaveTrace:
    """One save rebuilt from the log. Times are wall-clock seconds (``time.time()``)."""

    rank: int
    path: str
    tier: str
    bytes: int  # the file's bytes (its first commit); 0 until it is committed somewhere
    start: float
    blocked_s: float
    phases: tuple[Phase, ...]
    durable_at: float | None  # None: not (yet) durable at its path
    error: str | None = None
    superseded: bool = False
    abandoned: bool = False  # left open by a session of its rank that a newer one followed
    session: str | None = None  # its Checkpointer's session (None: a log written without)
    block: str | None = None  # the one_save() block it was saved in: one save with the block's other files
    unfenced: bool = False  # a lazy save whose fence event has not come: its copy never ended in the log

    @property
    def durable_s(self) -> float | None:
        """Seconds from the save call to durable at its path."""
        return None if self.durable_at is None else self.durable_at - self.start

    def phase(self, name: str) -> Phase | None:
        return next((p for p in self.phases if p.name == name), None)

    @property
    def replication_lag_s(self) -> float | None:
        """Seconds from committed in the burst buffer to replicated (None without replication)."""
        q, r = self.phase("queued"), self.phase("replicate")
        return None if q is None or r is None or r.error else r.end - q.start


@dataclass(frozen=True)
class RankStatus:
    """What a rank's Checkpointer reports now: from ``stats()`` in process, or from its log."""

    rank: int
    overhead: float
    window_overhead: float
    budget: float
    over_budget: bool
    alarms: int
    pending: int
    replication_pending: int
    replication_lag_s: float | None
    rpo_s: float | None


@dataclass
class _Building:
    trace: SaveTrace
    phases: list[Phase] = field(default_factory=list)
    session: str | None = None
    group: str | None = None  # saved into this group


class RunState:
    """Feed it events (in any order of ranks, each rank's in time order); ask for the run.

    Args:
        budget: the overhead budget the alarm is replayed against (None: each rank's job's, which
            its log's ``start`` event records; ``DEFAULT_BUDGET`` for a log written without).
        window_s: the sliding window of the overhead (the Checkpointer's ``overhead_window_s``;
            None: the job's, as ``budget``).
        keep_done: how many finished saves, failures, loads... to keep (None: all, as a report
            needs; a long-running exporter keeps few).
    """

    def __init__(self, budget: float | None = None, window_s: float | None = None,
                 keep_done: int | None = None) -> None:
        self._open: dict[tuple[int, str], list[_Building]] = {}
        self._overtaken: deque[_Building] = deque(maxlen=64)  # by a later replication, unless their own comes
        self._abandoned: deque[_Building] = deque(maxlen=keep_done)  # open when a newer session started
        self._sessions: set[tuple[int, str | None]] = set()  # (rank, session) seen
        self._done: deque[SaveTrace] = deque(maxlen=keep_done)
        self._overhead = RankOverheads(budget, window_s, None if keep_done is None else max(1, keep_done))  # its curve
        self._newest_durable_start: dict[int, float] = {}
        # (rank, group) -> its files durable at their paths, waiting for the group's commit
        self._awaiting: dict[tuple[int, str], list[_Building]] = {}
        # (rank, group) -> how the rank's attempt ended: its commit's (end, error) or a file's failure (the commit
        # can come first: read_events sorts by start, and a group's commit is called before its files replicate)
        self._outcomes: OrderedDict[tuple[int, str], tuple[float, str | None]] = OrderedDict()
        self.events: dict[str, int] = {}
        self.failures: deque[Event] = deque(maxlen=keep_done)
        self.retries: deque[Event] = deque(maxlen=keep_done)
        self.loads: deque[Event] = deque(maxlen=keep_done)
        self.group_commits: deque[Event] = deque(maxlen=keep_done)
        self._committing: dict[tuple[int, str], str | None] = {}  # (rank, group) -> session: commits running
        self.first_start: float | None = None  # the log's first start and last end
        self.last_end: float | None = None
        self._finished: list[SaveTrace] = []  # by the event being fed

    # ------------------------------------------------------------------ feeding
    def feed(self, ev: Event) -> list[SaveTrace]:
        """Take one event; returns the saves it finished (durable or failed): a group's commit
        finishes each file of the rank's attempt."""
        self._finished = []
        self.events[ev.name] = self.events.get(ev.name, 0) + 1
        self.first_start = ev.start if self.first_start is None else min(self.first_start, ev.start)
        self.last_end = ev.end if self.last_end is None else max(self.last_end, ev.end)
        if ev.error is not None and ev.name != "retry":
            self.failures.append(ev)
        if (ev.rank, ev.session) not in self._sessions:
            self._new_session(ev.rank, ev.session)
        if ev.name == "snapshot":
            self._snapshot(ev)
        elif ev.name in ("committing", "uncommitted"):  # a group commit began, or ended with no group ``commit``
            self._committing.pop((ev.rank, ev.path), None)
            if ev.name == "committing":
                self._committing[(ev.rank, ev.path)] = ev.session
        elif ev.name == "commit" and ev.detail == "group":
            self._committing.pop((ev.rank, ev.path), None)
            if ev.error is None:  # published; a failed one is in ``failures``
                self.group_commits.append(ev)
            self._outcome((ev.rank, ev.path), ev.end, ev.error)
        elif ev.name in ("write", "commit", "queued", "replicate"):
            self._phase(replace(ev, path=resave_home(ev.path)))  # a re-save's files: the group's
        elif ev.name in ("cancel", "superseded"):  # its replication was dropped: by remove(), or for a newer save
            if (b := self._owner(replace(ev, path=resave_home(ev.path)))) is not None:
                b.trace = replace(b.trace, **{"abandoned" if ev.name == "cancel" else "superseded": True})
                self._close(b)
        elif ev.name in ("retry", "load"):
            (self.retries if ev.name == "retry" else self.loads).append(ev)
        elif ev.name in ("one_save", "fence"):  # a block of files ended, or a lazy save's fence: for the overhead
            self._overhead.feed(ev)
            if ev.name == "fence" and (b := self._owner(ev)) is not None:  # a lazy save: blocked while fenced too
                b.trace = replace(b.trace, blocked_s=b.trace.blocked_s + ev.duration_s, unfenced=False)
        elif ev.name == "start":  # a Checkpointer's first line: its overhead_budget and overhead_window_s
            self._overhead.started(ev)
        return self._finished

    def _snapshot(self, ev: Event) -> None:
        trace = SaveTrace(ev.rank, ev.path, ev.tier, 0, ev.start, ev.duration_s, (), None, ev.error,
                          session=ev.session, block=ev.block, unfenced=ev.detail == LAZY)
        b = _Building(trace, [Phase("snapshot", ev.start, ev.end, ev.error)], ev.session, ev.group)
        if ev.error is not None:
            return self._failed(b)
        if ev.group is not None:  # a new attempt at the group
            self._outcomes.pop((ev.rank, ev.group), None)
        self._open.setdefault((ev.rank, ev.path), []).append(b)
        self._overhead.feed(ev)

    def _new_session(self, rank: int, session: str | None) -> None:
        """A Checkpointer of ``rank`` logs its first event: the saves that the rank's earlier
        sessions left open were abandoned (that job was killed and this one resumed it)."""
        self._sessions.add((rank, session))
        self._committing = {k: s for k, s in self._committing.items() if k[0] != rank or s == session}
        for key in [k for k in self._awaiting if k[0] == rank]:
            self._awaiting[key] = [b for b in self._awaiting[key] if b.session == session]
        for key in [k for k in self._open if k[0] == rank]:
            for b in list(self._open[key]):
                if b.session != session:
                    self._unlist(b)
                    self._abandoned.append(b)
        self._overhead.new_session(rank)  # a new Monitor, but the curve and the alarm count go on

    def _owner(self, ev: Event) -> _Building | None:
        """The oldest open save (for a replicate, the newest queued) of this rank and session that the event
        belongs to: same path, or a burst-buffer copy (its path, ``urls.untagged``, ends with the save's path, or
        ``scheme/rest``); for a ``superseded`` or a ``fence``, the save it names by its call (``saved_at``)."""
        at = saved_at(ev) if ev.name in ("superseded", "fence") else None  # the save it names by its call

        def takes(b: _Building) -> bool:
            return b.session == ev.session and all(p.name != ev.name for p in b.phases) and at in (None, b.trace.start)

        copy = untagged(ev.path)  # a copy's path ends with its home URL's ``scheme/rest`` (``urls.untagged``)
        cands = self._open.get((ev.rank, ev.path))
        if cands is None:
            hits = [k for k in self._open if k[0] == ev.rank and copy.endswith(k[1].replace("://", "/"))]
            cands = self._open[max(hits, key=lambda k: len(k[1]))] if hits else []
        found = next((b for b in cands if takes(b)), None)
        if ev.name == "replicate":  # the newest queued by then (a newer save to a path supersedes older queued ones)
            found = max((b for b in cands if takes(b) and (_queued_at(b) or 0.0) <= ev.start),
                        key=lambda b: _queued_at(b) or 0.0, default=found)
        for kept, matches in ((self._overtaken, ev.name == "replicate"), (self._abandoned, True)):
            if found is None and matches:  # overtaken, or abandoned, but its own session went on after all
                found = next((b for b in kept if b.trace.rank == ev.rank and takes(b) and (
                    b.trace.path == ev.path or copy.endswith(b.trace.path.replace("://", "/")))), None)
                if found is not None:
                    kept.remove(found)
                    self._open.setdefault((ev.rank, found.trace.path), []).append(found)
        return found

    def _phase(self, ev: Event) -> None:
        b = self._owner(ev)
        if b is None:
            return  # its snapshot is before the log's start
        b.phases.append(Phase(ev.name, ev.start, ev.end, ev.error))
        if ev.name == "commit" and not b.trace.bytes:
            b.trace = replace(b.trace, bytes=ev.bytes)
        if ev.error is not None:
            b.trace = replace(b.trace, error=ev.error)
            return self._failed(b)
        if ev.name == "replicate":
            self._overtake(b)
        if ev.name == "replicate" or (ev.name == "commit" and ev.path == b.trace.path):
            key = (b.trace.rank, b.group or "")
            if b.group is None or key in self._outcomes:  # ended (a file failed: no commit follows)
                return self._ended(b, *self._outcomes.get(key, (ev.end, None)))
            self._awaiting.setdefault(key, []).append(b)  # durable once its group is published

    def _failed(self, b: _Building) -> None:
        """``b`` failed, and so did the rank's attempt at its group, if any (no commit event follows)."""
        if b.group is not None:
            self._outcome((b.trace.rank, b.group), b.trace.start, f"{b.group} was not committed: {b.trace.error}")
        self._close(b)

    def _outcome(self, key: tuple[int, str], end: float, error: str | None) -> None:
        """The rank's attempt at the group ended: its files waiting, and those still to come, end with it."""
        self._outcomes[key] = (end, error)
        while len(self._outcomes) > _OUTCOMES_KEPT:
            self._outcomes.popitem(last=False)
        for o in self._awaiting.pop(key, []):
            self._ended(o, end, error)

    def _ended(self, b: _Building, end: float, error: str | None) -> None:
        """``b`` is durable at ``end`` (its own path, or its group's commit), or failed with ``error``
        (abandoned, not failed, when its group was ``remove()``d before it committed)."""
        b.trace = replace(b.trace, durable_at=end) if error is None else replace(b.trace, abandoned=True) \
            if error_type(error) == "GroupRemovedError" else replace(b.trace, error=error)
        if error is None:  # what a node loss goes back to, if the newest
            rank, start = b.trace.rank, b.trace.start
            self._newest_durable_start[rank] = max(start, self._newest_durable_start.get(rank, start))
        self._close(b)

    def _overtake(self, b: _Building) -> None:
        """``b`` replicated: saves to its path queued before it and not replicated yet were dropped
        (one path's uploads never overlap); they stop counting as pending. A log with ``superseded``
        events has ended them already; in one without, a save queued before ``b`` for another path
        may still be replicating on another worker: it stays pending (docs/report.md)."""
        queued = _queued_at(b)
        for o in list(self._open.get((b.trace.rank, b.trace.path), [])):
            q = _queued_at(o)
            if o is not b and o.session == b.session and q is not None and queued is not None and q < queued \
                    and all(p.name != "replicate" for p in o.phases):  # not one waiting for its group
                self._unlist(o)
                self._overtaken.append(o)

    def _unlist(self, b: _Building) -> None:
        key = (b.trace.rank, b.trace.path)
        if b in (cands := self._open.get(key, [])):
            cands.remove(b)
            if not cands:
                del self._open[key]

    def _close(self, b: _Building) -> None:
        self._unlist(b)
        done = replace(b.trace, phases=tuple(b.phases))
        self._done.append(done)
        self._finished.append(done)

    # ------------------------------------------------------------------ asking
    def budget_of(self, rank: int | None = None) -> tuple[float, str]:
        """The budget ``rank``'s alarm is replayed against (None: the lowest rank's): the one given, else its job's,
        and where it comes from: "given", "job" (its ``start`` event) or "default" (a log without)."""
        return self._overhead.budget_of(min(self._overhead.logged, default=0) if rank is None else rank)

    def saves(self) -> list[SaveTrace]:
        """Every save seen, finished or not, in order of their start."""
        out = list(self._done)
        out += [replace(b.trace, phases=tuple(b.phases)) for cands in self._open.values() for b in cands]
        out += [replace(b.trace, phases=tuple(b.phases), superseded=True) for b in self._overtaken]
        out += [replace(b.trace, phases=tuple(b.phases), abandoned=True) for b in self._abandoned]
        return sorted(out, key=lambda s: (s.start, s.rank))

    def ranks(self) -> list[int]:
        seen = {k[0] for k in (*self._open, *self._committing)} | {s.rank for s in self._done}
        return sorted(set(self._overhead.replays) | seen)

    def overhead_points(self, rank: int) -> list[OverheadPoint]:
        o = self._overhead.replays.get(rank)
        return list(o.points) if o is not None else []

    def alarms(self, rank: int) -> int:
        return o.alarms if (o := self._overhead.replays.get(rank)) is not None else 0

    def status(self, now: float) -> list[RankStatus]:
        """Each rank's numbers as its Checkpointer's ``stats()`` would give them at ``now``."""
        out = []
        for rank in self.ranks():
            o = self._overhead.replays.get(rank) or self._overhead.new(rank)
            at_home = {id(b) for k, files in self._awaiting.items() if k[0] == rank for b in files}
            waiting = [b for k, cands in self._open.items() if k[0] == rank for b in cands if id(b) not in at_home]
            queued = [q for b in waiting if (q := _queued_at(b)) is not None and b.phases[-1].name == "queued"]
            newest = self._newest_durable_start.get(rank)
            overhead = o.blocked / (now - o.t0) if o.t0 is not None and now > o.t0 else 0.0
            pending = len(waiting) + sum(1 for k in self._committing if k[0] == rank)  # saves, and commits
            out.append(RankStatus(rank, overhead, o.window(now), o.budget, o.over, o.alarms, pending,
                                  len(queued), now - min(queued) if queued else 0.0,
                                  None if newest is None else now - newest))
        return out


def _queued_at(b: _Building) -> float | None:
    return next((p.start for p in b.phases if p.name == "queued"), None)
