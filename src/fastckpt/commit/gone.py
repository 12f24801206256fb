"""Records of published groups deleted since (retention, ``remove``).

Without a store, a rank learns that its group was published by reading the group's manifest.
Rank 0 may publish the group, publish the next one and delete this one (``keep_persistent=1``)
before a slow rank looks: the rank then found no manifest and no marker of its own, and said
the group was removed unpublished. Before it deletes a published group, the deleter records
the attempt that was published there: ``PARENT/.fastckpt-gone/TAG@SECONDS.json``. Records
older than ``KEEP_S`` go at the next deletion in that directory (their time is in the name:
one listing, no reads).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable

from ..errors import CorruptCheckpointError
from ..storage.places import Place

GONE_DIR = ".fastckpt-gone"
KEEP_S = 3 * 3600.0  # longer than any commit_timeout_s a rank waits for its manifest


def _tag(place: Place) -> str:
    return place.key.rsplit("/", 1)[-1]


def record(place: Place, read_manifest: Callable[[Place], dict | None]) -> None:
    """The group at ``place`` is about to be deleted: record its attempt if it is published (its
    manifest, by ``read_manifest``); a failure to read or write the record never stops the
    deletion."""
    try:
        manifest = read_manifest(place)
    except (OSError, CorruptCheckpointError):
        return
    if manifest is None:
        return
    parent, now = place.parent(), time.time()
    body = json.dumps({"attempt": manifest.get("attempt")}).encode()
    try:
        parent.put(f"{GONE_DIR}/{_tag(place)}@{int(now)}.json", body)
        names = parent.names(GONE_DIR)
    except OSError:
        return
    for name in names:
        with contextlib.suppress(ValueError, OSError):
            if now - int(name.rsplit("@", 1)[1].removesuffix(".json")) > KEEP_S:
                parent.delete(f"{GONE_DIR}/{name}")


def was_published(place: Place, token: str | None) -> bool:
    """Whether attempt ``token`` of the group at ``place`` was published before it was deleted."""
    if token is None:
        return False
    parent = place.parent()
    for name in parent.names(GONE_DIR):
        if name.rsplit("@", 1)[0] == _tag(place):
            with contextlib.suppress(ValueError, OSError, AttributeError):
                if json.loads(parent.get(f"{GONE_DIR}/{name}") or b"{}").get("attempt") == token:
                    return True
    return False
