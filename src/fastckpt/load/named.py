"""A file without a fastckpt manifest that a published group names (``Loader._read``).

A group's manifest records each of its files by path, size and checksum. A file at such a path
whose bytes carry no manifest of their own (a plain ``torch.save`` written over it after the
commit, a tool that rewrote it) is not the file the group published: it is damage, whatever
``verify`` says, since ``verify=False`` accepts files nothing vouches for, not one the group
vouches for as other bytes. So is a framework's file of the group (``FRAMEWORK_FILES``: a
plain file, recorded by the checksum of its whole bytes) whose bytes no longer match. A plain
file the group does not name (the user's own file beside the group's) loads unverified as
before.

Only a file without a manifest pays for this: the manifests of its directory and the ones above
it (``MAX_UP``, as ``commit.membership.group_entry`` searches for a copied file's group), read
once per load (``load.fallback.home_group``); the nearest published one decides. Within
``Checkpointer.reading`` the pinned manifest stands for its group's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..commit.membership import MAX_UP
from ..commit.names import framework_files
from ..errors import CorruptCheckpointError
from ..format.checksum import checksum_bytes
from ..storage.homes import Homes
from .deserialize import fetcher
from .fallback import home_group

if TYPE_CHECKING:
    from ..io.engine import ReadResult

log = logging.getLogger("fastckpt")


def _published_above(homes: Homes, path: str, pinned: Mapping[str, dict]) -> tuple[str, dict] | None:
    """The nearest directory above ``path`` (``MAX_UP`` at most) with a published group manifest
    (or a pinned one), and that manifest. The search stops at a folder the user may not read
    (the plain file loads as a plain file, as before); a manifest that is damaged or does not read
    for another reason raises, as it may be the file's own group's (a replaced file must not load
    unverified because its group's manifest is damaged too)."""
    floor = path.index("://") + 3 if "://" in path else 1
    d = path.rsplit("/", 1)[0]
    for _ in range(MAX_UP):
        if len(d) <= floor:
            return None
        try:
            published = pinned[d] if d in pinned else home_group(homes.resolve(d).place())
        except PermissionError as exc:  # a folder above the user may not read (a prefix-scoped key): no
            log.debug("fastckpt: %s: no group manifest read there (%s)", d, exc)  # group of the file's can
            return None  # be told there nor above it (a damaged manifest or EIO raises: it may be its group's)
        if published is not None:
            return d, published
        d = d.rsplit("/", 1)[0]
    return None


def check_named(homes: Homes, res: ReadResult, url: str, path: str, pinned: Mapping[str, dict]) -> None:
    """Raise when the file at ``path`` (read from ``url``: it or its burst-buffer copy), which
    has no fastckpt manifest, is one its published group records as other bytes.

    Raises:
        CorruptCheckpointError: naming the file, the group, what the group recorded and the fix.
    """
    found = _published_above(homes, path, pinned)
    if found is None:
        return
    group, published = found
    rel = path[len(group) + 1:]
    entry = (published.get("files") or {}).get(rel)
    fix = (f"Restore {rel} of the group from another copy (the burst buffer, a replica), or load an earlier "
           "checkpoint (fastckpt.latest(<parent dir>)).")
    if isinstance(entry, dict):
        raise CorruptCheckpointError(
            f"{url} has no fastckpt manifest, but checkpoint group {group} published {rel!r} as a fastckpt file "
            f"({entry.get('size')} bytes, checksum {entry.get('checksum')}): it was replaced after the commit (a "
            f"plain torch.save over it?), so it is not the group's file, and loading it would mix it with the "
            f"group's other files. {fix}")
    digest = framework_files(published).get(rel)
    if digest is not None and checksum_bytes(fetcher(res.buffer)(0, res.size)) != digest:
        raise CorruptCheckpointError(
            f"{url} is not the file checkpoint group {group} committed as {rel!r}: its bytes' checksum is not "
            f"{digest}, which the group recorded (a framework wrote it again in place: a killed save into this "
            f"checkpoint?). {fix}")
