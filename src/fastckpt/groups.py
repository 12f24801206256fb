"""Group commits: several files from one or many ranks become one checkpoint.

Calls, all on the training thread: ``begin`` (first save into a group by this rank),
``add``/``skipped`` (each save), ``commit`` (every rank, once per attempt). The work of a
commit runs on the committer pool: wait for this rank's saves (and their replication) ->
write this rank's marker -> rank 0: wait for every marker, publish the manifest and the
``latest`` pointer; other ranks: wait for that manifest. See commit.py for the protocol.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

from . import commit as C
from .errors import FastCkptError
from .places import Place
from .pipeline import reraise
from .records import SaveHandle, SaveRecord


@dataclass
class _Attempt:
    """This rank's part of one attempt at a group: its saves, skips, token and start time."""

    token: str | None
    started_at: float
    place: Place
    handles: list[SaveHandle] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def rel_to(path: str, group: str) -> str:
    return path[len(group):].lstrip("/")


class Groups:
    def __init__(self, pool: Executor, stop: threading.Event, timeout_s: float,
                 place_for: Callable[[str], Place], emit: Callable[..., None]) -> None:
        self._pool, self._stop, self._timeout = pool, stop, timeout_s
        self._place_for, self._emit = place_for, emit
        self._attempts: dict[str, _Attempt] = {}

    def begin(self, group: str, rank: int, world: int) -> None:
        """First touch of ``group`` by this rank in this attempt.

        An earlier attempt at the same tag (a resumed run re-saving ``global_step{N}``) is
        invalidated first: its manifest goes, so no reader mixes old and new files, and this
        rank's old marker goes. Markers and the manifest carry the attempt's token, agreed
        through the process group's key-value store (not a collective) when there is one.
        """
        if group in self._attempts:
            return
        place = self._place_for(group)
        self._attempts[group] = _Attempt(C.attempt_token(group, world), time.time(), place)
        place.delete(C.GROUP_MANIFEST)
        place.delete(f"{C.MARKER_DIR}/rank-{rank:05d}.json")

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
                reraise(exc, group)
                raise  # unreachable: reraise always raises

        return self._pool.submit(run)

    def _run(self, group: str, att: _Attempt, rank: int, world: int, extra: dict,
             t_call: float, requested_at: float, move_latest: bool) -> SaveRecord:
        c0 = time.time()
        recs = [h._future.result() for h in att.handles]  # a failed save stops the commit here
        if att.skipped:
            raise FastCkptError(
                f"checkpoint group {group} not committed: this rank skipped {att.skipped} "
                "(when_busy='skip' found the staging buffer busy); the group stays incomplete")
        tier = recs[0].tier if recs else "direct"
        blocked = sum(r.blocked_s for r in recs)
        if any(r.superseded for r in recs):  # replication coalesced this attempt away
            C.write_marker(None, att.place, rank, world, {}, att.token, att.started_at, superseded=True)
            return SaveRecord(group, tier, 0, blocked, 0.0, time.monotonic() - t_call, None,
                              rank=rank, group=group, superseded=True)
        files = {rel_to(r.path, group): {"size": r.bytes, "checksum": r.checksum} for r in recs}
        C.write_marker(None, att.place, rank, world, files, att.token, att.started_at)
        if rank == 0:
            markers = C.wait_for_markers(att.place, world, self._timeout, self._stop, att.token,
                                         att.started_at - C.STALE_MARKER_S)
            if any(m.get("superseded") for m in markers.values()):
                manifest = {"superseded": True, "files": {}}
            else:
                manifest = C.publish_group(None, att.place, world, markers, extra, requested_at, att.token, move_latest)
            C.announce_outcome(group, att.token, superseded=bool(manifest.get("superseded")))
        else:
            manifest = C.wait_for_manifest(att.place, self._timeout, self._stop, att.token, files, group=group)
        done = time.monotonic() - t_call
        if manifest.get("superseded"):
            return SaveRecord(group, tier, 0, blocked, 0.0, done, None, rank=rank, group=group, superseded=True)
        total = sum(f["size"] for f in manifest["files"].values())
        self._emit("commit", group, total, c0, tier, detail="group")
        return SaveRecord(group, tier, total, blocked, 0.0, done, done, rank=rank, group=group)
