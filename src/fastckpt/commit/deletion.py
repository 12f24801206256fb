"""Deleting a checkpoint (retention, ``remove``): a single file or a group, its publication
record first, so that no reader sees it partial while its bytes go.

At a URL a single file's publication also moved its folder's ``latest`` to it
(``protocol.publish_file``): a pointer naming a deleted file names nothing, so it goes with the
file. In a folder of its own (``run/step-N/state.pt``) nothing else is left to name."""

from __future__ import annotations

import errno
import posixpath

from ..storage.homes import Location
from .discovery import scan
from .names import GROUP_MANIFEST, LATEST, MARKER_DIR, SIDECAR
from .protocol import staged_places
from .trimmed import record

DELETE_ATTEMPTS = 5  # tree deletions of a group that concurrent writers disturbed, before giving up


def delete_checkpoint(loc: Location, trimmed_keep_s: float | None = None) -> None:
    """Delete a checkpoint (a single file or a group): its publication record first, so that it
    is invisible before any of its bytes go; a group's unpublished new attempt goes too.
    ``trimmed_keep_s``: retention trims it, so a group's published attempt is recorded first
    (``trimmed.record``, kept that long), for the ranks that may still wait for it."""
    target, key = loc.target, loc.key
    if target.exists(key) or target.exists(key + SIDECAR):
        _drop_pointer(loc)
        target.delete(key + SIDECAR)
        target.delete(key)
    else:
        if trimmed_keep_s is not None:
            record(loc.place(), trimmed_keep_s)
        _delete_group(loc)
        if key:
            for staged in staged_places(loc.place()):
                staged.delete_all()


def only_checkpoint(loc: Location) -> bool:
    """Whether the single file at ``loc`` is the only checkpoint in its folder and below it (one
    save per folder, ``run/step-N/state.pt``): its folder's ``latest`` then names no resume point
    that the run's own folder would not find by a scan; deleted, nothing of that folder is left."""
    parent = Location(loc.target, posixpath.dirname(loc.key))
    return all(found.path == loc.url for found in scan(parent))


def _drop_pointer(loc: Location) -> None:
    """Delete the ``latest`` of the folder of the single file ``loc`` (a URL) when it names that
    file: first, so that a deletion cut short leaves a file that is still a checkpoint, and its
    trim is tried again. Another save moving it meanwhile loses its pointer, not its answer: a
    folder without one is scanned (``discovery``)."""
    if loc.target.mounted:  # a single file writes no pointer there
        return
    parent = loc.place().parent()  # (no lock: an object store has none, ``Place.exclusive``)
    if (parent.get(LATEST) or b"").decode(errors="replace").strip() == posixpath.basename(loc.key):
        parent.delete(LATEST)


def _delete_group(loc: Location) -> None:
    """``delete_tree`` of a group, again while a writer of the group (another rank still saving
    or committing into it) adds or removes entries under it meanwhile."""
    for attempt in range(1, DELETE_ATTEMPTS + 1):
        try:
            loc.target.delete_tree(loc.key, first=(GROUP_MANIFEST,), last=(MARKER_DIR,))
            return
        except OSError as exc:
            if getattr(exc, "errno", None) not in (errno.ENOTEMPTY, errno.ENOENT, errno.EISDIR, errno.EEXIST) \
                    or attempt == DELETE_ATTEMPTS:
                raise
