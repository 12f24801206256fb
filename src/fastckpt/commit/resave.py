"""Re-saving a published group: the new attempt never unpublishes the old one until it is itself
published (issue #9, item 1).

Loaders read ``save_dir/TAG/<file>`` by name (DeepSpeed, Megatron), so a group's files must end
up at their names. A new attempt at a published tag therefore writes beside it, into the hidden
directory ``.TAG.fastckpt-next-<digest of the attempt it replaces>`` (``protocol.staged_place``;
its markers and records too), and rank 0, once every rank's files are there, writes the new
manifest inside it and exchanges the two directories in one ``renameat2(RENAME_EXCHANGE)``: a
reader sees the old complete group or the new complete group, and a crash at any moment leaves
one of them published. Files of the old directory that no manifest names (DeepSpeed's
``zero_to_fp32.py``, Megatron's ``metadata.json``) are hard-linked into the new one first;
files a crashed earlier attempt left in the directory that the new manifest does not name are
deleted.

The old attempt, now at the hidden name, is deleted last (``clear``), after ``latest`` moved: a
slow or failed delete never holds back or fails a checkpoint that is published (a failure is
logged; the next re-save of the tag sweeps what is left). The next re-save, which other ranks
may start as soon as they see the new manifest, writes into the directory named after the new
attempt, never into the one being deleted.

Only a mounted file system can exchange directories. On an object store a re-save of a
published group is refused at its first save (``refusal``): remove the group first, or save
under a new tag.
"""

from __future__ import annotations

import logging
import posixpath

from ..errors import ConfigError
from ..storage.places import Place
from . import protocol as P
from .claim import claim_rel

log = logging.getLogger("fastckpt")


def refusal(home: Place) -> ConfigError:
    return ConfigError(
        f"checkpoint group {home.label} is already published, and an object store cannot replace a group "
        "atomically: a new attempt there would leave a mix of old and new files visible. Remove it first "
        "(Checkpointer.remove), or save under a new tag.")


def _ours(rel: str, manifest: dict, world_size: int) -> bool:
    """Whether ``rel`` in the new attempt's directory belongs there: a file the manifest names,
    or this attempt's markers and records."""
    if rel in manifest["files"] or rel in (P.GROUP_MANIFEST, claim_rel(manifest.get("attempt"))):
        return True
    return posixpath.dirname(rel) == P.MARKER_DIR and (
        rel in (P.ATTEMPT, P.OUTCOME) or any(rel == P.marker_rel(r) for r in range(world_size)))


def swap_in(home: Place, staged: Place, manifest: dict, old: dict | None) -> None:
    """Rank 0: publish the new attempt in ``staged`` as the group at ``home``.

    Args:
        home: the published group's place.
        staged: ``protocol.staged_place(home, old)``, holding every file of the new attempt.
        manifest: the new attempt's manifest.
        old: the published manifest the new attempt replaces (None if it is gone by now).
    """
    world = int(manifest["world_size"])
    for rel in staged.files():
        if not _ours(rel, manifest, world):
            staged.delete(rel)  # left by an earlier attempt that never got this far
    named = set((old or {}).get("files", ())) | set(manifest["files"])
    have = set(staged.files())
    for rel in home.files():
        if rel not in named and rel not in have and not _internal(rel):
            home.link(rel, staged, rel)
    staged.put(P.GROUP_MANIFEST, P.manifest_bytes(manifest))
    home.swap(staged)
    log.info("fastckpt: %s re-saved: the new attempt replaced the published one", home.label)


def clear(home: Place, staged: Place, manifest: dict) -> None:
    """Rank 0, after ``swap_in`` (and after ``latest`` moved): delete the replaced attempt, now
    in ``staged``, and any re-save directory of the tag an earlier clear left, except the one
    the next re-save writes to. A failure is only logged: the group is published."""
    keep = P.staged_place(home, manifest).key
    for place in [staged] + [p for p in P.staged_places(home) if p.key not in (staged.key, keep)]:
        try:
            place.delete_all()
        except OSError as exc:
            log.warning("fastckpt: %s is published, but the attempt it replaced could not be deleted from %s "
                        "(%s); the next re-save of the tag deletes it, or remove it by hand", home.label,
                        place.url(), exc)


def _internal(rel: str) -> bool:
    return rel == P.GROUP_MANIFEST or rel.startswith(f"{P.MARKER_DIR}/")
