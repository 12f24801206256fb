"""Everything the DeepSpeed integration uses from fastckpt beyond its stable names, in one place
(the core's modules are being regrouped; re-point these imports when they move).

The integration needs the group protocol's small files (manifest, rank markers, the ``latest``
pointer) at a directory or a URL, and a group's files downloaded into the burst buffer.
"""

from __future__ import annotations

import json
import os

from fastckpt.commit import GROUP_MANIFEST, LATEST, MARKER_DIR, group_order
from fastckpt.places import LocalPlace, Place, TargetPlace, is_url, normalize
from fastckpt.replicate import TargetCache

__all__ = ["GROUP_MANIFEST", "is_url", "normalize", "Store"]

RETRY_DEADLINE_S = 300.0


class Store:
    """The small files of checkpoints under one root (a directory or URL).

    Args:
        storage_options: fsspec options for URLs (the Checkpointer's).
    """

    def __init__(self, storage_options: dict | None) -> None:
        self._targets = TargetCache(storage_options, RETRY_DEADLINE_S, 4)

    def place(self, where: str) -> Place:
        if is_url(where):
            target, key = self._targets.get(where)
            return TargetPlace(target, key)
        return LocalPlace(where)

    def pointer(self, root: str) -> str | None:
        """What ``root/latest`` says (stripped), or None when there is none."""
        data = self.place(root).get(LATEST)
        name = data.decode().strip() if data is not None else ""
        return name or None

    def set_pointer(self, root: str, name: str) -> None:
        """Point ``root/latest`` at ``name`` (atomic: temp, fsync, rename; one PUT at a URL)."""
        self.place(root).put(LATEST, name.encode())

    def manifest(self, group: str) -> dict | None:
        data = self.place(group).get(GROUP_MANIFEST)
        return json.loads(data) if data is not None else None

    def attempted(self, group: str) -> bool:
        """fastckpt started saving ``group`` (rank markers or a manifest exist)."""
        place = self.place(group)
        return bool(place.names(MARKER_DIR)) or place.get(GROUP_MANIFEST) is not None

    def download_group(self, url: str, local: str, names: list[str]) -> None:
        """Copy ``names`` (files of the committed group at ``url``) that are missing in
        ``local``, then its manifest, so loads there read the burst buffer."""
        target, key = self._targets.get(url)
        os.makedirs(local, exist_ok=True)
        for name in names:
            dest = os.path.join(local, *name.split("/"))
            if not os.path.exists(dest):
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                target.download(f"{key}/{name}", dest)
        data = self.place(url).get(GROUP_MANIFEST)
        if data is not None:
            LocalPlace(local).put(GROUP_MANIFEST, data)


def order(manifest: dict) -> float:
    """When a group was committed, for ordering (rank 0's commit call)."""
    return group_order(manifest)
