"""A rank other than 0, in a group commit through the store: how the attempt ended (``attempt.via_store``).

Rank 0 tells the outcome through the store. When it cannot (the store stopped answering, or its
connection failed while the store lives on), the group's manifest at its home tells whether
rank 0 published this attempt: its id, and this rank's files by checksum, once ``latest``
names it.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from ..errors import CommitTimeoutError, CorruptCheckpointError
from ..storage.places import Place
from . import claim as C
from . import protocol as P
from . import store as S
from .pointing import moved

if TYPE_CHECKING:
    from .attempt import Attempt


def verdict(att: Attempt, ch: S.Channel, rank: int, files: dict, deadline: float, stop: threading.Event,
            waited_s: float) -> str:
    """Another rank: rank 0's outcome of the attempt. One not in time ends the attempt on every rank
    (``Channel.give_up``) before this rank reports it not committed (else a late rank 0 would still publish it, with
    files this rank's next save may overwrite in place), unless rank 0 claimed it first: then, unless the home's
    manifest says rank 0 published it (its outcome could not reach the store), its outcome is waited for once more.
    When the store stops answering (rank 0's process hosted it), the home's manifest tells (this attempt's id, which
    a new launch's store gives again, and this rank's files by checksum), once latest names it."""
    try:
        try:
            return ch.hear(deadline, stop, att.home.label, waited_s)
        except CommitTimeoutError as exc:
            try:
                ended = ch.give_up(C.gave_up_why(att.home.label, rank, waited_s))
            except S.StoreError as store_exc:
                exc.add_note(f"the other ranks were not told: {store_exc}")
                raise exc from None
            if ended:
                raise
            m = _published(att, files)
            if m is not None and moved(att.place, m):  # (between the two: rank 0 publishes it now)
                return _said(m)
        return ch.hear(time.monotonic() + waited_s, stop, att.home.label, waited_s)
    except S.StoreError as exc:
        m = _published(att, files)
        if m is None:
            raise
        if not moved(att.place, m):  # rank 0 ended between the manifest and latest: a restart redoes the group
            raise S.StoreError(f"{exc} Rank 0 published its manifest, not latest: it is not committed") from exc
        return _said(m)


def _published(att: Attempt, files: dict) -> dict | None:
    """The home's manifest, if it is this attempt's and holds this rank's ``files`` (by checksum)."""
    m = manifest_of(att.home, att.token, unreadable=OSError)
    if m is None or not files or any(m["files"].get(rel, {}).get("checksum") != f.get("checksum")
                                     for rel, f in files.items()):
        return None
    return m


def _said(manifest: dict) -> str:
    return f"{S.PUBLISHED}:{sum(f['size'] for f in manifest['files'].values())}"


def manifest_of(place: Place, token: str | None, unreadable: type[Exception] = CorruptCheckpointError) -> dict | None:
    """The group manifest at ``place`` if it is attempt ``token``'s (None: none, another's, or damaged)."""
    try:
        m = P.read_group_manifest(place)
    except (CorruptCheckpointError, unreadable):
        return None
    return m if m is not None and m.get("attempt") == token else None
