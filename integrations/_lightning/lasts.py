"""ModelCheckpoint(save_last=True): a top-k file is not deleted while the last file at its path
names it (as ``best_model_path`` or in ``best_k_models``), or may yet.

Why: ``ModelCheckpoint`` saves ``step=N.ckpt``, asks to delete the top-k file it replaces, then
saves ``last.ckpt``. With a burst buffer the ``last.ckpt`` at the path trails the saves (the
oldest queued version lands in its turn, ``fastckpt.save.versions``), so a deletion that waits
only for the saves before it left a durable ``last.ckpt`` naming a deleted best file, and a kill
there resumed with a missing ``best_model_path`` (``validate(ckpt_path="best")`` raised).

How: every save to a ModelCheckpoint(save_last=True)'s ``last_model_path`` (Lightning sets it
before the save) is noted with the files it names (``LastFiles.saved``, training thread). A
deletion notes how many saves each such path had when it was asked for (``LastFiles.mark``), and,
once the saves before it are durable, is judged on the remover thread (``LastFiles.named``): a
version of a last file that names it and is pending, or landed with no newer version landed
after it, holds it back. So does the file that was at the path when the fit began (a resumed
fit's ``last.ckpt``: read once, on the remover thread, from the path itself, never the
burst-buffer copy, its pickle only: ``commit.foreign.pickle_plain``) until a save of this fit
lands there. Paths are compared as ``fastckpt.urls.normalize`` writes them, so a URL dirpath and
a last file in a subfolder (``CHECKPOINT_NAME_LAST = "last/last"``) are covered alike.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from fastckpt.records import SaveHandle
from fastckpt.urls import normalize

#: The key of the remover's runs of the deletions waiting for a newer last file (``link.TrainerLink._flush``).
AFTER_LAST = "the top-k files waiting for a newer last.ckpt"
#: names that stand for every file: the last file there when the fit began could not be read
ANY = frozenset({"*"})


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


def last_paths(trainer: Any) -> list[str]:
    """The last files of the Trainer's ModelCheckpoint(save_last=True) callbacks known so far; none
    under DeepSpeedStrategy, whose saves do not pass through CheckpointIO.save_checkpoint (what its
    last files name is not seen here, and a deletion waiting for one to land would wait for good)."""
    if "DeepSpeedStrategy" in {c.__name__ for c in type(getattr(trainer, "strategy", None)).__mro__}:
        return []
    return [normalize(cb.last_model_path) for cb in getattr(trainer, "checkpoint_callbacks", None) or ()
            if getattr(cb, "save_last", None) is True and isinstance(getattr(cb, "last_model_path", None), str)
            and cb.last_model_path]


def _state(handle: SaveHandle, wait: bool) -> str:
    """'pending', 'landed' (at its path) or 'gone' (failed, skipped, cancelled, dropped for a newer save)."""
    if not wait and not handle.done():
        return "pending"
    try:
        rec = handle.result()
    except BaseException:  # noqa: BLE001 (never at its path; the training thread raises it once)
        return "gone"
    return "landed" if rec.durable_s is not None and not rec.superseded else "gone"


class LastFiles:
    """One fit's last files: each one's saves (oldest first) with the files each names, and what the
    file there when the fit began names (read once, by ``read``: None if it cannot be read)."""

    def __init__(self, read: Callable[[str], frozenset[str] | None]) -> None:
        self._read = read
        self._lock = threading.Lock()
        self._saves: dict[str, list[tuple[SaveHandle, frozenset[str]]]] = {}
        self._dropped: dict[str, int] = {}  # saves forgotten from the front of each list (``saved``)
        self._before: dict[str, frozenset[str]] = {}

    def saved(self, path: str, handle: SaveHandle, checkpoint: object) -> None:
        """The training thread: ``handle`` saves the last file ``path``. The saves done before the
        newest one that landed are forgotten: none is at the path, or will be (a long fit's list
        stays short)."""
        with self._lock:
            saves = self._saves.setdefault(path, [])
            cut = max((i for i, (h, _) in enumerate(saves) if h.done() and _state(h, False) == "landed"), default=0)
            if all(h.done() for h, _ in saves[:cut]):
                del saves[:cut]
                self._dropped[path] = self._dropped.get(path, 0) + cut
            saves.append((handle, named_files(checkpoint)))

    def mark(self, trainer: Any) -> dict[str, int]:
        """The training thread, as a deletion is asked for: each last file's count of saves so far."""
        with self._lock:
            for path in last_paths(trainer):
                self._saves.setdefault(path, [])
            return {path: self._dropped.get(path, 0) + len(saves) for path, saves in self._saves.items()}

    def named(self, path: str, mark: dict[str, int], wait: bool = False) -> str | None:
        """The remover thread: which last file names ``path`` now or may yet (None: none does).
        ``wait``: wait for the saves to end (teardown) instead of counting a pending one."""
        for last, count in mark.items():
            with self._lock:
                saves, dropped = list(self._saves.get(last, ())), self._dropped.get(last, 0)
            states = [_state(h, wait) for h, _ in saves]
            for i, (_, names) in enumerate(saves[:max(0, count - dropped)]):
                if path in names and (states[i] == "pending"
                                      or (states[i] == "landed" and "landed" not in states[i + 1:])):
                    return last
            if "landed" not in states:  # the file there when the fit began is there still
                before = self._names_before(last)
                if path in before or before is ANY:
                    return last
        return None

    def _names_before(self, last: str) -> frozenset[str]:
        if last not in self._before:  # (the remover thread only)
            names = self._read(last)
            self._before[last] = ANY if names is None else names
        return self._before[last]
