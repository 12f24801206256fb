"""Group attempts that failed on this rank, for ``Retention`` (docs/burst-buffer.md, step 6).

A group whose attempt failed (a file's write ran out of room in the burst buffer, a commit that
raised) never publishes, so it can never load; yet the files this rank did write into its
burst-buffer copy stayed there for the rest of the run (the restart sweep, ``restarts``, looks
once per directory, and only at what earlier runs left). Once a group of a later step beside
it, begun after it, is durable, they go, as a dropped group's do. A group saved or committed
again since (in flight: its newest token in ``busy`` is another) stays, and so does one that is
published after all (a failed re-save leaves the group published before it in place).
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable

from ..commit.protocol import read_group_manifest
from ..storage.homes import Homes
from .restarts import delete_own_group_files


class FailedGroups:
    """Retention's record of them. Its methods run under Retention's lock; ``busy`` is Retention's
    name -> token of the newest save or commit in flight (a failed one's stays there)."""

    def __init__(self, keep_local: int | None) -> None:
        self._on = keep_local is not None  # without keep_local nothing in the burst buffer is deleted
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


def delete_failed(homes: Homes, copies: Callable[[str], list[str]], group: str, rank: int) -> None:
    """``rank``'s files of the failed ``group``'s burst-buffer copies, unless it is published."""
    if read_group_manifest(homes.resolve(group).place()) is None:
        delete_own_group_files(homes, copies, group, rank)
