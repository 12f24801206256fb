"""Group commits: several files from one or many ranks become one checkpoint.

Calls, all on the training thread: ``begin`` (first save into a group by this rank),
``add``/``skipped`` (each save), ``commit`` (every rank, once per attempt). The work of a commit
runs on the committer pool: wait for this rank's saves (and their replication) -> write this
rank's marker -> rank 0: wait for every marker of this attempt, publish the manifest and move
the ``latest`` pointer; other ranks: wait for that manifest (or rank 0's announced outcome).
Waiting polls the group's place with backoff; ``stop`` (set by ``close``) ends it early.
See ``protocol.py`` for the files and ``attempts.py`` for the tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

from ..errors import CommitTimeoutError, FastCkptError
from ..inflight import raise_as_write_error
from ..records import SaveHandle, SaveRecord
from ..storage.places import Place
from . import protocol as P
from .attempts import announce_outcome, attempt_token, outcome

POLL_FIRST_S = 0.005
POLL_MAX_S = 0.5


@dataclass
class _Attempt:
    """This rank's part of one attempt at a group: its saves, skips, token and start time."""

    token: str | None
    started_at: float
    place: Place
    handles: list[SaveHandle] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _poll(until: Callable[[], object], deadline: float, stop: threading.Event) -> object:
    """Call ``until`` with backoff until it returns something other than None; None on timeout."""
    delay = POLL_FIRST_S
    while True:
        got = until()
        if got is not None:
            return got
        if time.monotonic() >= deadline or stop.is_set():
            return None
        stop.wait(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, POLL_MAX_S)


def _current(marker: dict, world_size: int, token: str | None, not_before: float) -> bool:
    return (marker["world_size"] == world_size and marker.get("attempt") == token
            and float(marker.get("written_at", 0.0)) >= not_before)


def wait_for_markers(place: Place, world_size: int, timeout_s: float, stop: threading.Event,
                     token: str | None = None, not_before: float = 0.0) -> dict[int, dict]:
    """Rank 0: every rank's marker of this attempt (or one that dropped it).

    Raises:
        CommitTimeoutError: naming the ranks that never committed.
    """
    seen: dict[int, dict] = {}

    def ready() -> dict[int, dict] | None:
        seen.clear()
        seen.update({r: m for r, m in P.read_markers(place).items() if _current(m, world_size, token, not_before)})
        done = all(r in seen for r in range(world_size)) or any(m.get("superseded") for m in seen.values())
        return dict(seen) if done else None

    got = _poll(ready, time.monotonic() + timeout_s, stop)
    if got is None:
        missing = [r for r in range(world_size) if r not in seen]
        raise CommitTimeoutError(
            f"checkpoint group {place.label} not committed: ranks {missing} of {world_size} did "
            f"not commit within {timeout_s:.0f} s. The group stays incomplete (readers skip it); "
            "check those ranks' logs, or raise commit_timeout_s for slow storage.")
    return got  # type: ignore[return-value]


def wait_for_manifest(place: Place, timeout_s: float, stop: threading.Event, token: str | None = None,
                      mine: dict | None = None, group: str | None = None) -> dict:
    """Other ranks: this attempt's manifest, listing this rank's files with the checksums just
    written (an older attempt's manifest does not count), or rank 0's announced outcome."""
    def ready() -> dict | None:
        m = P.read_group_manifest(place)
        if m is not None and m.get("attempt") == token and all(
                m["files"].get(rel, {}).get("checksum") == info["checksum"] for rel, info in (mine or {}).items()):
            return m
        said = outcome(group, token)
        if said == b"superseded":
            return {"superseded": True, "files": {}}
        if said == b"published":  # published, then deleted or replaced before this rank looked
            return {"files": dict(mine or {}), "attempt": token, "retired": True}
        if any(mk.get("superseded") and mk.get("attempt") == token for mk in P.read_markers(place).values()):
            return {"superseded": True, "files": {}}  # a rank dropped this attempt: it will not be published
        return None

    got = _poll(ready, time.monotonic() + timeout_s, stop)
    if got is None:
        raise CommitTimeoutError(
            f"checkpoint group {place.label}: rank 0 did not publish {P.GROUP_MANIFEST} within "
            f"{timeout_s:.0f} s; some rank did not commit (see rank 0's error).")
    return got  # type: ignore[return-value]


class Coordinator:
    """This rank's attempts at groups, and their commits on the committer pool.

    Args:
        pool: the committer threads.
        stop: set by ``Checkpointer.close``: waits end early.
        timeout_s: how long a commit waits for the other ranks.
        place_for: the ``Place`` of a group name.
        emit: the Checkpointer's event emitter.
    """

    def __init__(self, pool: Executor, stop: threading.Event, timeout_s: float,
                 place_for: Callable[[str], Place], emit: Callable[..., None]) -> None:
        self._pool, self._stop, self._timeout = pool, stop, timeout_s
        self._place_for, self._emit = place_for, emit
        self._attempts: dict[str, _Attempt] = {}

    def begin(self, group: str, rank: int, world: int) -> None:
        """First touch of ``group`` by this rank in this attempt.

        An earlier attempt at the same tag is invalidated first: its manifest goes, so no
        reader mixes old and new files, and this rank's old marker goes.
        """
        if group in self._attempts:
            return
        place = self._place_for(group)
        self._attempts[group] = _Attempt(attempt_token(group, world), time.time(), place)
        place.delete(P.GROUP_MANIFEST)
        place.delete(P.marker_rel(rank))

    def add(self, group: str, handle: SaveHandle) -> None:
        self._attempts[group].handles.append(handle)

    def skipped(self, group: str, path: str) -> None:
        self._attempts[group].skipped.append(path)

    def commit(self, group: str, rank: int, world: int, extra: dict,
               finish: Callable[[SaveRecord], SaveRecord] = lambda r: r, move_latest: bool = True) -> Future:
        self.begin(group, rank, world)  # a rank that saved nothing into this group
        att = self._attempts.pop(group)
        t_call, requested_at = time.monotonic(), time.time()

        def run() -> SaveRecord:
            try:
                return finish(self._run(group, att, rank, world, extra, t_call, requested_at, move_latest))
            except OSError as exc:
                raise_as_write_error(exc, group)
                raise  # unreachable: raise_as_write_error always raises

        return self._pool.submit(run)

    def _run(self, group: str, att: _Attempt, rank: int, world: int, extra: dict,
             t_call: float, requested_at: float, move_latest: bool) -> SaveRecord:
        c0 = time.time()
        recs = [h.result() for h in att.handles]  # a failed save stops the commit here
        if att.skipped:
            raise FastCkptError(
                f"checkpoint group {group} not committed: this rank skipped {att.skipped} "
                "(when_busy='skip' found the staging buffer busy); the group stays incomplete")
        tier = recs[0].tier if recs else "direct"
        blocked = sum(r.blocked_s for r in recs)
        if any(r.superseded for r in recs):  # replication coalesced this attempt away
            P.write_marker(att.place, rank, world, {}, att.token, att.started_at, superseded=True)
            return SaveRecord(group, tier, 0, blocked, 0.0, time.monotonic() - t_call, None,
                              rank=rank, group=group, superseded=True)
        files = {r.path[len(group):].lstrip("/"): {"size": r.bytes, "checksum": r.checksum} for r in recs}
        P.write_marker(att.place, rank, world, files, att.token, att.started_at)
        if rank == 0:
            markers = wait_for_markers(att.place, world, self._timeout, self._stop, att.token,
                                       att.started_at - P.STALE_MARKER_S)
            if any(m.get("superseded") for m in markers.values()):
                manifest = {"superseded": True, "files": {}}
            else:
                manifest = P.publish_group(att.place, world, markers, extra, requested_at, att.token, move_latest)
            announce_outcome(group, att.token, superseded=bool(manifest.get("superseded")))
        else:
            manifest = wait_for_manifest(att.place, self._timeout, self._stop, att.token, files, group=group)
        done = time.monotonic() - t_call
        if manifest.get("superseded"):
            return SaveRecord(group, tier, 0, blocked, 0.0, done, None, rank=rank, group=group, superseded=True)
        total = sum(f["size"] for f in manifest["files"].values())
        self._emit("commit", group, total, c0, tier, detail="group")
        return SaveRecord(group, tier, total, blocked, 0.0, done, done, rank=rank, group=group)
