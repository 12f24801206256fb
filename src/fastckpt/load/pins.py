"""``Checkpointer.reading``: a thread's loads of a group's files checked against the manifest
published when the reading began, so that a re-save of the tag swapped in meanwhile is never
mixed with the files read before it (``GroupChangedError`` instead)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..commit.protocol import incomplete_group_error, read_group_manifest
from ..errors import GroupChangedError
from ..storage.homes import Homes


class Pins:
    """The groups this thread reads (``reading``), each with its pinned manifest."""

    def __init__(self, homes: Homes) -> None:
        self._homes = homes
        self._local = threading.local()  # .groups: group -> the manifest ``reading`` pinned

    def _groups(self) -> dict[str, dict]:
        return self._local.__dict__.setdefault("groups", {})

    @contextmanager
    def reading(self, group: str) -> Iterator[dict]:
        """Pin the published manifest of ``group`` (normalised) for this thread's loads of its
        files; yields it. Nested for the same group: the outer pin holds.

        Raises:
            IncompleteCheckpointError: ``group`` has no published manifest.
        """
        pins = self._groups()
        if group in pins:
            yield pins[group]
            return
        place = self._homes.resolve(group).place()
        manifest = read_group_manifest(place)
        if manifest is None:
            raise incomplete_group_error(place, None)
        pins[group] = manifest
        try:
            yield manifest
        finally:
            del pins[group]

    def pinned(self, path: str) -> bool:
        """Whether ``path`` lies in a group this thread reads: ``check`` decides for it, against the
        pinned manifest, instead of the group's manifest as it is now."""
        return any(path.startswith(group.rstrip("/") + "/") for group in self._groups())

    def check(self, path: str, checksum: str | None) -> None:
        """A file of a pinned group (its verified ``checksum``) must be the one its pinned
        manifest names at ``path``.

        Raises:
            GroupChangedError: it is not (the group was saved again and swapped in since).
        """
        for group, manifest in self._groups().items():
            if checksum is None or not path.startswith(group.rstrip("/") + "/"):
                continue
            entry = (manifest.get("files") or {}).get(path[len(group.rstrip("/")) + 1:])
            if entry is None or entry.get("checksum") != checksum:
                raise GroupChangedError(
                    f"{path} is not the file group {group} held when reading it began (committed at "
                    f"{manifest.get('committed_at')}, attempt {manifest.get('attempt')}): the group was saved again "
                    "and swapped in since, so the files loaded before are of the earlier save. Nothing was mixed: "
                    "load the group again (all its files, in a new reading()).")
