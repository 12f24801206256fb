"""What failed, for ``Retention`` (docs/burst-buffer.md, step 6): group attempts of this rank, and
keep_persistent deletions.

A group whose attempt failed (a file's write ran out of room in the burst buffer, a commit that
raised) never publishes, so it can never load; yet the files this rank did write into its
burst-buffer copy stayed there for the rest of the run (the restart sweep, ``restarts``, looks
once per directory, and only at what earlier runs left). Once a group of a later step beside
it, begun after it, is durable, they go, as a dropped group's do. A group saved or committed
again since (in flight: its newest token in ``busy`` is another) stays, and so does one that is
published after all (a failed re-save leaves the group published before it in place).

A keep_persistent deletion that fails (EIO, an object store down for longer than
``retry_deadline_s``) was forgotten: the name had left the persistent list before it was
deleted, so no later trim tried again and the home kept that checkpoint for good. It goes back
into the list as its oldest entry, so the next trim tries it again, up to ``TRIM_TRIES`` times.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable

from ..commit.protocol import read_group_manifest
from ..storage.homes import Homes
from .restarts import delete_own_group_files

TRIM_TRIES = 3  # failed keep_persistent deletions of one checkpoint before it is left to the user


class FailedGroups:
    """Retention's record of them. Its methods but ``delete`` run under Retention's lock; ``busy`` is Retention's
    name -> token of the newest save or commit in flight (a failed one's stays there)."""

    def __init__(self, keep_local: int | None, homes: Homes, copies: Callable[[str], list[str]], rank: int) -> None:
        self._on = keep_local is not None  # without keep_local nothing in the burst buffer is deleted
        self._homes, self._copies, self._rank = homes, copies, rank
        self._failed: dict[str, tuple[int, int]] = {}  # group -> (token, step) of the attempt that failed

    def mark(self, busy: dict[str, int], group: str, token: int | None, step: int | None) -> None:
        """This rank's attempt ``token`` (None: its newest) at ``group``, of ``step``, failed."""
        mine = busy.get(group)
        if self._on and step is not None and mine is not None and token in (None, mine):
            self._failed[group] = (mine, step)

    def forget(self, group: str) -> None:
        self._failed.pop(group, None)

    def beside(self, busy: dict[str, int], path: str, token: int, step: int | None) -> list[str]:
        """The failed groups beside group ``path`` (commit ``token`` of ``step``, durable), of
        earlier steps and begun before it, that are not in flight again: they leave ``busy``."""
        parent = posixpath.dirname(path)
        ended = {g: t for g, (t, s) in self._failed.items() if step is not None and t < token and s < step
                 and posixpath.dirname(g) == parent}
        for g in ended:
            del self._failed[g]
        gone = [g for g, t in ended.items() if busy.get(g) == t]
        for g in gone:
            del busy[g]
        return gone

    def delete(self, group: str) -> None:
        """This rank's files of the failed ``group``'s burst-buffer copies, unless it is published
        (not under the lock: it reads the home, and deletes)."""
        if read_group_manifest(self._homes.resolve(group).place()) is None:
            delete_own_group_files(self._homes, self._copies, group, self._rank)


class FailedTrims:
    """The keep_persistent deletions that failed, by name; its methods run under Retention's lock."""

    def __init__(self) -> None:
        self._tries: dict[str, int] = {}

    def failed(self, listed: dict[str, int], path: str) -> str:
        """Deleting ``path`` failed: list it again in ``listed`` (name -> token), the oldest, unless
        it failed ``TRIM_TRIES`` times. Returns what happens next, for the warning."""
        tries = self._tries[path] = self._tries.get(path, 0) + 1
        if tries >= TRIM_TRIES:
            self.done(path)
            return (f"; gave up after {tries} tries: it stays at its home (delete it yourself, or with "
                    "Checkpointer.remove)")
        listed.setdefault(path, min(listed.values(), default=0) - 1)
        return f"; the next trim tries again ({tries} of {TRIM_TRIES})"

    def done(self, path: str) -> None:
        self._tries.pop(path, None)
