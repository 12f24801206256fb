"""ModelCheckpoint(save_last=True): a top-k file is not deleted while the ``last.ckpt`` at the path
names it (its ``best_model_path`` or ``best_k_models``), or may yet.

Why: ``ModelCheckpoint`` saves ``step=N.ckpt``, asks to delete the top-k file it replaces, then
saves ``last.ckpt``. With uploads behind, the ``last.ckpt`` at the path trails the saves (the
oldest queued one lands in its turn, ``fastckpt.save.versions``) while the deletion waited only
for the saves before it: for the whole backlog the durable ``last.ckpt`` named a deleted best
file, and a kill then resumed with a missing ``best_model_path`` (``validate(ckpt_path="best")``
raised). TorchCheckpointIO writes that ``last.ckpt`` right after the deletion.

How (all on the training thread, except ``landed``): the files each ``last*.ckpt`` save names
are noted as it is saved (``saved``). A deletion of a file in such a ModelCheckpoint's
``dirpath`` is held (``hold``) until the next ``last*.ckpt`` save there, the one Lightning makes
right after asking for it, and then queued with it (``take``), or at teardown (``drain``). On the
remover thread the deletion then also waits for that save to land if a ``last.ckpt`` saved
before it that names the file landed (``link.TrainerLink._remove_after``). A ``last.ckpt`` that
never landed (dropped for a newer save) holds nothing back, so the top-k files do not pile up
while uploads run behind; a kill leaves at most the file the durable ``last.ckpt`` names.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from fastckpt.records import SaveHandle
from fastckpt.urls import normalize

#: The key of the remover's runs of the deletions waiting for a newer last.ckpt (``link._flush_after_last``).
AFTER_LAST = "the top-k files waiting for a newer last.ckpt"
#: a held deletion: (path, the saves it waits for, the last*.ckpt saves before it that name it)
Held = tuple[str, list[SaveHandle], list[SaveHandle]]


def named_files(checkpoint: object) -> frozenset[str]:
    """The files a checkpoint's ModelCheckpoint states name (best_model_path, best_k_models)."""
    states = checkpoint.get("callbacks") if isinstance(checkpoint, Mapping) else None
    out: set[str] = set()
    for key, st in (states.items() if isinstance(states, Mapping) else ()):
        if isinstance(key, str) and key.startswith("ModelCheckpoint") and isinstance(st, Mapping):
            best_k = st.get("best_k_models")
            for p in (st.get("best_model_path"), *(best_k if isinstance(best_k, Mapping) else ())):
                if isinstance(p, str) and p:
                    out.add(normalize(p))
    return frozenset(out)


def landed(handle: SaveHandle) -> bool:
    """Whether ``handle``'s own save reached its path (waiting for it); a dropped one did not."""
    try:
        rec = handle.result()
    except BaseException:  # noqa: BLE001 (failed: never at the path; raised once by the training thread)
        return False
    return rec.durable_s is not None and not rec.superseded


def settled(handle: SaveHandle, after: Callable[[SaveHandle], SaveHandle | None]) -> bool:
    """Whether ``link.not_durable(handle, after)`` answers without waiting: every save it looks at is done."""
    first = handle
    while handle.done():
        try:
            rec = handle.result()
        except BaseException:  # noqa: BLE001 (failed: not_durable says so at once)
            return True
        if (rec.skipped and handle is first) or rec.cancelled or (not rec.superseded and rec.durable_s is not None):
            return True
        newer = after(handle)
        if newer is None:
            return True
        handle = newer
    return False


class LastSaves:
    """The ``last*.ckpt`` saves of one fit that may be at their path, and the deletions held for the next."""

    def __init__(self) -> None:
        self._saves: dict[str, list[tuple[SaveHandle, frozenset[str]]]] = {}  # last path -> oldest first
        self._held: list[Held] = []

    @staticmethod
    def _callbacks(trainer: Any) -> list[Any]:
        return [cb for cb in getattr(trainer, "checkpoint_callbacks", None) or ()
                if getattr(cb, "save_last", None) is True and isinstance(getattr(cb, "dirpath", None), str)]

    def is_last(self, trainer: Any, path: str) -> bool:
        """Whether ``path`` is being saved as a ModelCheckpoint(save_last=True)'s last*.ckpt
        (Lightning sets ``last_model_path`` before it saves it)."""
        return any(normalize(cb.last_model_path or "") == path for cb in self._callbacks(trainer))

    def holds(self, trainer: Any, path: str) -> bool:
        """Whether a deletion of ``path`` waits for the next last*.ckpt save: a file in the dirpath of
        a ModelCheckpoint(save_last=True) that is not one of its last*.ckpt files."""
        if path in self._saves or self.is_last(trainer, path):
            return False
        return any(path.startswith(normalize(os.path.abspath(cb.dirpath)).rstrip(os.sep) + os.sep)
                   for cb in self._callbacks(trainer))

    def hold(self, path: str, saves: list[SaveHandle]) -> None:
        """Hold the deletion of ``path`` (waiting for ``saves`` too) for the next last*.ckpt save in its folder."""
        namers = [h for entries in self._saves.values() for h, names in entries if path in names]
        self._held = [h for h in self._held if h[0] != path] + [(path, saves, namers)]

    def release(self, path: str) -> None:
        """``path`` is saved again: a deletion held for it is off (as for one deferred for a link)."""
        self._held = [h for h in self._held if h[0] != path]

    def saved(self, path: str, handle: SaveHandle, checkpoint: object) -> list[Held]:
        """A last*.ckpt save: note what it names, and hand back the deletions held for it. Saves of
        that path before the newest one that landed are forgotten: they are at the path no more."""
        entries = self._saves.setdefault(path, [])
        keep = max((i for i, (h, _) in enumerate(entries) if h.done() and landed(h)), default=0)
        entries[:] = [*entries[keep:], (handle, named_files(checkpoint))]
        inside = os.path.dirname(path).rstrip(os.sep) + os.sep  # the ModelCheckpoint's dirpath
        held = [h for h in self._held if h[0].startswith(inside)]
        self._held = [h for h in self._held if not h[0].startswith(inside)]
        return held

    def drain(self) -> list[Held]:
        """Teardown: the deletions still held (no last*.ckpt save followed them)."""
        held, self._held = self._held, []
        return held
