"""The Replicator's checks of a burst-buffer copy before it is uploaded, and right before the upload is
published: is it still the save its job was committed with, or did a newer save of the same path
replace it (its own job sends that)?

``source`` is the file the upload reads: the copy itself, or its version link (``save.versions``),
which no newer save replaces; ``local`` names the copy in messages.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import CheckpointWriteError, CorruptCheckpointError, ReplicationError
from ..inflight import raise_as_write_error
from ..records import SaveRecord
from ..storage.homes import Homes


def local_manifest(homes: Homes, source: str, local: str, rec: SaveRecord) -> dict | None:
    """The burst-buffer copy's manifest, checked against what was committed; None when a newer
    save to the same path replaced the copy (its own job sends it)."""
    loc = homes.resolve(source)
    try:
        manifest = loc.target.read_manifest(loc.key)
    except OSError as exc:
        raise_as_write_error(exc, rec.path)
    except CorruptCheckpointError as exc:  # (a ValueError: it named the local copy only, as if loaded)
        raise CheckpointWriteError(f"local copy {local} of {rec.path} has a damaged manifest ({exc}): it was "
                                   "damaged after it was committed; not replicating it") from exc
    if manifest is None:
        raise CheckpointWriteError(f"local copy {local} of {rec.path} has no manifest: it was replaced "
                                   "or damaged after it was committed; not replicating it")
    if rec.checksum and manifest["checksum"]["value"] != rec.checksum:
        if not replaced_by_newer(homes, source, rec, manifest):
            raise CheckpointWriteError(f"local copy {local} of {rec.path} no longer has the checksum it was "
                                       "committed with: it changed after it was committed; not replicating it")
        return None
    return manifest


def check_publishable(homes: Homes, source: str, rec: SaveRecord, closed: bool, own_newer: Callable[[], bool]) -> None:
    """Right before an upload is published (renamed into place; at S3, before the object is visible):
    raises when it must not be. ``closed``: ``close()`` gave up on it, and another Checkpointer of the
    process may have saved the path since. A local copy a newer save replaced meanwhile, where that save
    is not this Replicator's (``own_newer``: one of its jobs, whose upload follows this one): another
    Checkpointer sharing the burst buffer, whose own upload may have landed already.

    Raises:
        ReplicationError: ``closed`` (the Replicator says why, with the local copy).
        CheckpointWriteError: another Checkpointer's newer save (the Replicator resolves it as superseded).
    """
    if closed:
        raise ReplicationError(f"{rec.path}: its Checkpointer was closed before the copy ended; not publishing it")
    if replaced_by_newer(homes, source, rec) and not own_newer():
        raise CheckpointWriteError(f"the local copy of {rec.path} was replaced by another Checkpointer's newer save "
                                   "while it was copied; not publishing the older one")


def replaced_by_newer(homes: Homes, source: str, rec: SaveRecord, manifest: dict | None = None) -> bool:
    """Whether the local copy (its ``manifest``, read again if not given) is another save's,
    written after ``rec`` was called: a newer save to the same path, whose own job sends it."""
    if manifest is None:
        try:
            loc = homes.resolve(source)
            manifest = loc.target.read_manifest(loc.key)
        except (OSError, CorruptCheckpointError):
            return False
    if manifest is None or manifest["checksum"]["value"] == rec.checksum:
        return False
    return float(manifest.get("written_at", 0.0)) >= rec.requested_at
