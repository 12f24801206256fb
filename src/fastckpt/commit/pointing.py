"""Moving a directory's ``latest`` pointer to the group rank 0 has just published
(``attempt.publish``): the pointer is a hint that ``latest()`` reads first; the group's manifest
is what publishes it."""

from __future__ import annotations

import logging

from ..storage.places import Place
from . import protocol as P

log = logging.getLogger("fastckpt")


def move_latest(home: Place, manifest: dict) -> None:
    """Move the parent's ``latest`` to the group just published. A pointer that cannot be written
    (a full disk, EIO, a directory standing at ``parent/latest``) fails the commit only while it
    names an older complete checkpoint, which ``latest()`` answers then; else ``latest()`` finds
    the group (absent, stale or no file: by its scan), so it is committed: a WARNING says so."""
    try:
        P.move_pointer(home.parent(), manifest["tag"], P.group_order(manifest))
    except OSError as exc:
        if P.never_latest(home, manifest):
            raise
        log.warning("fastckpt: %s is committed, but its directory's pointer %s was not moved to it (%s): latest() "
                    "finds it by scanning the directory. Fix that (a directory named %r there: rename it) so that "
                    "commits move the pointer again", home.url(), home.parent().url(P.LATEST), exc, P.LATEST)
