"""Deleting a checkpoint (retention, ``remove``): a single file or a group, its publication
record first, so that no reader sees it partial while its bytes go."""

from __future__ import annotations

import errno

from ..storage.homes import Location
from .names import GROUP_MANIFEST, MARKER_DIR, SIDECAR
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
        target.delete(key + SIDECAR)
        target.delete(key)
    else:
        if trimmed_keep_s is not None:
            record(loc.place(), trimmed_keep_s)
        _delete_group(loc)
        if key:
            for staged in staged_places(loc.place()):
                staged.delete_all()


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
