"""Re-saving a published group: the new attempt never unpublishes the old one until it is itself
published (issue #9, item 1).

Loaders read ``save_dir/TAG/<file>`` by name (DeepSpeed, Megatron), so a group's files must end
up at their names. A new attempt at a published tag therefore writes beside it, into the hidden
directory ``.TAG.fastckpt-next`` (``protocol.staged_place``; its markers and records too), and
rank 0, once every rank's files are there, writes the new manifest inside it and exchanges the
two directories in one ``renameat2(RENAME_EXCHANGE)``: a reader sees the old complete group or
the new complete group, and a crash at any moment leaves one of them published. Files of the
old directory that no manifest names (DeepSpeed's ``zero_to_fp32.py``, Megatron's
``metadata.json``) are hard-linked into the new one first; files a crashed earlier attempt
left in ``.TAG.fastckpt-next`` that the new manifest does not name are deleted. The old
attempt, now at the hidden name, is deleted last.

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

log = logging.getLogger("fastckpt")


def refusal(home: Place) -> ConfigError:
    return ConfigError(
        f"checkpoint group {home.label} is already published, and an object store cannot replace a group "
        "atomically: a new attempt there would leave a mix of old and new files visible. Remove it first "
        "(Checkpointer.remove), or save under a new tag.")


def _ours(rel: str, manifest: dict, world_size: int) -> bool:
    """Whether ``rel`` in the new attempt's directory belongs there: a file the manifest names,
    or this attempt's markers and records."""
    if rel in manifest["files"] or rel == P.GROUP_MANIFEST:
        return True
    return posixpath.dirname(rel) == P.MARKER_DIR and (
        rel in (P.ATTEMPT, P.OUTCOME) or any(rel == P.marker_rel(r) for r in range(world_size)))


def swap_in(home: Place, staged: Place, manifest: dict, old: dict | None) -> None:
    """Rank 0: publish the new attempt in ``staged`` as the group at ``home``.

    Args:
        home: the published group's place.
        staged: ``protocol.staged_place(home)``, holding every file of the new attempt.
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
    staged.delete_all()  # the previous attempt, now at the hidden name
    log.info("fastckpt: %s re-saved: the new attempt replaced the published one", home.label)


def _internal(rel: str) -> bool:
    return rel == P.GROUP_MANIFEST or rel.startswith(f"{P.MARKER_DIR}/")
