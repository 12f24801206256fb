"""``Checkpointer.reading``: a thread's loads of a group's files checked against the manifest
published when the reading began, so that a re-save of the tag swapped in meanwhile is never
mixed with the files read before it (``GroupChangedError`` instead)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..commit.membership import NotPublishedError, require_complete_group
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

    def held(self) -> dict[str, dict]:
        """The groups this thread reads, each with its pinned manifest."""
        return self._groups()

    def pinned(self, path: str) -> bool:
        """Whether ``path`` lies in a group this thread reads: ``check`` decides for it, against the
        pinned manifest, instead of the group's manifest as it is now."""
        return any(path.startswith(group + "/") for group in self._groups())

    def check(self, path: str, manifest: dict | None) -> None:
        """A verified file (its own ``manifest``) at ``path`` in a pinned group loads as the
        group's file only as ``require_complete_group`` allows, judged by the pinned manifest:
        a copy its checksum verifies and a standalone file load, a file moved over another is
        damage, and one the pinned manifest does not name is of a save swapped in since.

        Raises:
            GroupChangedError: the file is of a save of the group swapped in since the pin.
            CorruptCheckpointError, IncompleteCheckpointError: as ``require_complete_group``.
        """
        if manifest is None or not self.pinned(path):
            return
        pins = self._groups()
        try:
            require_complete_group(self._homes, path, manifest, pins)
        except NotPublishedError as exc:
            if exc.group not in pins:
                raise
            now = read_group_manifest(self._homes.resolve(exc.group).place()) or {}
            if (now.get("attempt"), now.get("committed_at")) == exc.seen:
                raise  # the pinned save is still the published one: a file left by another attempt
            pin = pins[exc.group]
            raise GroupChangedError(
                f"{path} is not the file group {exc.group} held when reading it began (committed at "
                f"{pin.get('committed_at')}, attempt {pin.get('attempt')}): the group was saved again "
                "and swapped in since, so the files loaded before are of the earlier save. Nothing was mixed: "
                "load the group again (all its files, in a new reading()).") from exc
