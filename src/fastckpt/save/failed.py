"""What failed, for ``Retention`` (docs/burst-buffer.md, step 6): keep_local and keep_persistent
deletions, and group attempts of this rank.

A keep_persistent deletion that fails (EIO, an object store down for longer than
``retry_deadline_s``) was forgotten: the name had left the persistent list before it was
deleted, so no later trim tried again and the home kept that checkpoint for good. It goes back
into the list as its oldest entry, so the next trim tries it again, up to ``TRIM_TRIES`` times.
So does a keep_local deletion that fails (a drive remounted read-only for a moment, EPERM on an
immutable file): the burst buffer kept that copy for the rest of the run.

A group whose attempt failed on this rank (a file's write ran out of room in the burst buffer,
its commit raised) never publishes, so it can never load; yet the files this rank wrote into its
burst-buffer copy stayed there for the rest of the run (the restart sweep, ``restarts``, looks
once per directory, and only at what earlier runs left). They go once a group of a later step
beside it, begun after it, is durable, and every save, upload and commit of the group that was
in flight when it failed has ended: a file whose upload is still queued, running or retried is
read by it (deleting it failed that upload, and its unseen failure sank a later, healthy
commit). A group saved or committed again since stays (that save owns the files now, and
``Retention.replacing`` waits for a deletion already decided), and so does one published after
all (a failed re-save leaves the group published before it in place). Killed midway, the copy
holds fewer of this rank's files and no manifest (``leftovers.set_aside`` took it when the
attempt opened): never complete, it is what the restart sweep removes.
"""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

from ..commit.protocol import read_group_manifest
from ..storage.homes import Homes
from .restarts import delete_own_group_files

TRIM_TRIES = 3  # failed keep_local or keep_persistent deletions of one checkpoint before it is left to the user


class FailedTrims:
    """The deletions of one retention list that failed, by name; its methods run under Retention's
    lock. ``listed``: that list (name -> token); ``where``: where a copy it gives up on stays, and how to delete it."""

    def __init__(self, listed: dict[str, int], where: str) -> None:
        self._tries: dict[str, int] = {}
        self._listed, self._where = listed, where

    def failed(self, path: str) -> str:
        """Deleting ``path`` failed: list it again, the oldest, unless it failed ``TRIM_TRIES``
        times. Returns what happens next, for the warning."""
        tries = self._tries[path] = self._tries.get(path, 0) + 1
        if tries >= TRIM_TRIES:
            self.done(path)
            return f"; gave up after {tries} tries: it stays {self._where}"
        self._listed.setdefault(path, min(self._listed.values(), default=0) - 1)
        return f"; the next trim tries again ({tries} of {TRIM_TRIES})"

    def done(self, path: str) -> None:
        self._tries.pop(path, None)


def push(listed: dict[str, int], path: str, token: int, keep: int | None) -> list[str]:
    """List ``path`` (save ``token``) in a retention list; return the names beyond the ``keep`` newest
    saves (removed from it, to be deleted: a failed deletion lists one again, ``FailedTrims``)."""
    if keep is None:
        return []
    listed[path] = token
    over = sorted(listed, key=listed.__getitem__)[:max(0, len(listed) - keep)]
    for p in over:
        del listed[p]
    return over


@dataclass(eq=False)
class _Failed:
    token: int  # Retention's token of the save or commit that failed (the group's newest then)
    step: int
    left: int  # its futures in flight when it failed that have not ended, + 1 until all are watched
    ripe: bool = False  # a group of a later step beside it, begun after it, is durable


class FailedGroups:
    """This rank's failed group attempts. ``lock`` and ``busy`` are Retention's (name -> token of
    the newest save or commit; a failed one's stays there); ``in_flight(group)``: the futures of
    the group's saves (write and upload) and commits not ended (``InFlight.of_group``);
    ``decide(names)`` (under the lock) and ``delete(group)`` (after it): Retention's deletion."""

    def __init__(self, on: bool, lock: threading.Lock, busy: dict[str, int],
                 in_flight: Callable[[str], list[Future]], decide: Callable[[list[str]], None],
                 delete: Callable[[str], None]) -> None:
        self._on, self._lock, self._busy, self._in_flight = on, lock, busy, in_flight
        self._decide, self._delete = decide, delete
        self._failed: dict[str, _Failed] = {}

    @contextmanager
    def failing(self, group: str, step: int | None) -> Iterator[None]:
        """An error raised in the block ends this rank's attempt at ``group`` (of ``step``): the
        newest save or commit of it as the block began."""
        with self._lock:
            token = self._busy.get(group)
        try:
            yield
        except Exception:  # not a Ctrl-C or SystemExit: the attempt may stay open for close(), its files too
            self.mark(group, token, step)
            raise

    def mark(self, group: str, token: int | None, step: int | None) -> None:
        """This rank's save or commit ``token`` of ``group`` (of ``step``: a series that moves
        ``latest``; without keep_local nothing in the burst buffer is deleted) failed."""
        if not self._on or step is None or token is None:
            return
        futures = self._in_flight(group)  # a save begun after this changes busy: then nothing is marked
        with self._lock:
            if self._busy.get(group) != token or getattr(self._failed.get(group), "token", None) == token:
                return
            failed = self._failed[group] = _Failed(token, step, len(futures) + 1)
        for f in futures:
            f.add_done_callback(lambda _: self._ended(group, failed))
        self._ended(group, failed)  # each is watched: the + 1 goes

    def forget(self, group: str) -> None:
        """(Under the lock.) ``group`` is saved again, or removed."""
        self._failed.pop(group, None)

    def beside(self, path: str, token: int, step: int | None) -> list[str]:
        """(Under the lock.) Group ``path`` (commit ``token`` of ``step``) is durable: the failed
        groups beside it, of earlier steps and begun before it, may go. Returns those that go now
        (decided): every future they waited for has ended; the others go as their last one ends."""
        parent = posixpath.dirname(path)
        for g, f in self._failed.items():
            f.ripe = f.ripe or (step is not None and f.token < token and f.step < step
                                and posixpath.dirname(g) == parent)
        return [g for g, f in list(self._failed.items()) if self._goes(g, f)]

    def _ended(self, group: str, failed: _Failed) -> None:
        with self._lock:
            failed.left -= 1
            goes = self._goes(group, failed)
        if goes:
            self._delete(group)

    def _goes(self, group: str, failed: _Failed) -> bool:
        """(Under the lock.) Whether ``failed`` goes now; if so it leaves ``busy`` and is decided."""
        if failed.left or not failed.ripe or self._failed.get(group) is not failed:
            return False
        del self._failed[group]
        if self._busy.get(group) != failed.token:  # committed again since: that attempt's files
            return False
        del self._busy[group]
        self._decide([group])
        return True


def delete_failed(homes: Homes, copies: Callable[[str], list[str]], group: str, rank: int) -> None:
    """``rank``'s files of the failed ``group``'s burst-buffer copies, unless it is published."""
    if read_group_manifest(homes.resolve(group).place()) is None:
        delete_own_group_files(homes, copies, group, rank)
