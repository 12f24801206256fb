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

A tag directory DeepSpeed's own engine wrote (``foreign.written_by_deepspeed``: its per-rank
files have no fastckpt manifest) is published too, though it has no manifest of its own: saved
in place, its files would be replaced one at a time, and a crash between two of them would leave
a mix of the two saves and no complete checkpoint. Its new attempt is staged and swapped in the
same way; those files are the ones the new attempt replaces (``stand_in``), so they are not
carried over (a tag saved at another world size has other ZeRO files, which would make
DeepSpeed's loader see two saves).

Only a mounted file system can exchange directories. On an object store a re-save of a
published group is refused at its first save (``refusal``): remove the group first, or save
under a new tag.
"""

from __future__ import annotations

import logging
import posixpath

from ..errors import ConfigError, CorruptCheckpointError
from ..storage.places import Place
from . import protocol as P
from .claim import claim_rel
from .foreign import written_by_deepspeed

log = logging.getLogger("fastckpt")


FOREIGN = "written-by-deepspeed"  # the attempt of a ``stand_in``


def refusal(home: Place, old: dict | None = None) -> ConfigError:
    what = (f"holds a tag DeepSpeed's own engine saved ({', '.join(sorted(old['files'])[:3])})"
            if old is not None and old.get("attempt") == FOREIGN else "is already published")
    return ConfigError(
        f"checkpoint group {home.label} {what}, and an object store cannot replace a group "
        "atomically: a new attempt there would leave a mix of old and new files visible. Remove it first "
        "(Checkpointer.remove), or save under a new tag.")


def stand_in(files: list[str]) -> dict:
    """What a new attempt at a tag DeepSpeed's own engine saved replaces, in place of a manifest:
    its files (``swap_in`` does not carry them over)."""
    return {"attempt": FOREIGN, "files": dict.fromkeys(files, {})}


def place_of(home: Place) -> tuple[Place, dict | None]:
    """Where a new attempt at the group ``home`` writes, and the manifest of what it replaces (None:
    nothing, or a damaged manifest): ``home`` when nothing is published there, else its re-save
    directory ``protocol.staged_place``. Published: a manifest (also a damaged one), or
    DeepSpeed's own files of a tag (``stand_in``).

    Raises:
        ConfigError: ``home`` is published on an object store (unless its commit died before
            moving ``latest``: ``protocol.never_latest``; then its manifest goes, and it is
            re-saved in place, like a failed attempt).
    """
    try:
        old = P.read_group_manifest(home)
        published = old is not None
    except CorruptCheckpointError:  # a damaged manifest: still replaced only by a whole new attempt
        old, published = None, True
    if not published:
        prefix = f"{home.key}/" if home.key else ""
        files = written_by_deepspeed(home.target, prefix, home.files())
        old, published = (stand_in(files), True) if files else (None, False)
    if published and not home.target.mounted:
        if old is None or old.get("attempt") == FOREIGN or not P.never_latest(home, old):
            raise refusal(home, old)
        home.delete(P.GROUP_MANIFEST)  # never reported nor the latest: re-saved in place, like a failed one
        old, published = None, False
    return (P.staged_place(home, old) if published else home), old


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
