"""ModelCheckpoint(save_top_k=k, save_last=True) on a burst buffer: a top-k file that the last
file at the path names is not deleted before a newer last file has landed there.

Why: ``ModelCheckpoint`` saves ``step=N.ckpt``, asks to delete the top-k file it pushed out, then
saves ``last.ckpt``. With uploads behind, the ``last.ckpt`` at the path trails the saves (each
lands in its turn, ``fastckpt.save.versions``), so a deletion that waited only for the saves
before it left a durable ``last.ckpt`` naming a deleted file as ``best_model_path`` (or in
``best_k_models``): after a kill, ``validate(ckpt_path="best")`` of the resumed fit raised.

How (rank 0; ``FastCkptIO`` calls in): each save a ModelCheckpoint(save_last=True) makes to its
``last_model_path`` is noted, per callback (its ``state_key``), with the files its own state in
that checkpoint names (``saved``). A deletion notes each callback's count of last saves when it
is asked for (``mark``); once the saves before it are durable, the remover thread judges it
(``holders``): the newest of those last saves that landed (none: the file at the path when the
fit began, its pickle read once) names it? Then it is parked until a last save of that callback
made after the request lands (``free``; deleted by a later run on the remover thread), or, at
teardown, once every save has ended, deleted or (the newest last file at the path still names
it) kept with a WARNING. Nothing changes without a burst buffer (a deletion already waits for the
saves before it), nor under a strategy whose saves bypass CheckpointIO (DeepSpeed,
ModelParallel, FSDP sharded: their last files are never seen to land).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from fastckpt.records import SaveHandle
from fastckpt.urls import normalize

log = logging.getLogger("fastckpt.lightning")

#: The key the remover's runs of parked deletions are tracked under (``TrainerLink._file``).
FLUSH = "the top-k files waiting for a newer last file"
#: Strategies whose saves do not pass through CheckpointIO.save_checkpoint (DeepSpeed's go through
#: fastckpt's engine hooks, as tag directories whose callback state this module does not read).
BYPASS = {"DeepSpeedStrategy"}


def owners(trainer: Any) -> list[Any]:
    """The Trainer's ModelCheckpoint(save_last=True) callbacks (subclasses too) whose last files
    this plugin sees saved; none where the strategy's saves bypass CheckpointIO."""
    strategy = getattr(trainer, "strategy", None)
    names = {c.__name__ for c in type(strategy).__mro__}
    if (names & BYPASS or ("FSDPStrategy" in names and getattr(strategy, "_state_dict_type", "full") == "sharded")
            or ("ModelParallelStrategy" in names and getattr(strategy, "_save_distributed_checkpoint", True))):
        return []  # (ModelParallel with save_distributed_checkpoint=False: rank 0 saves through CheckpointIO)
    return [cb for cb in getattr(trainer, "checkpoint_callbacks", None) or ()
            if getattr(cb, "save_last", None) is True and isinstance(getattr(cb, "state_key", None), str)]


def named_files(checkpoint: object, key: str) -> frozenset[str]:
    """The files the state of the callback ``key`` in ``checkpoint`` names (best_model_path, best_k_models)."""
    states = checkpoint.get("callbacks") if isinstance(checkpoint, Mapping) else None
    state = states.get(key) if isinstance(states, Mapping) else None
    if not isinstance(state, Mapping):
        return frozenset()
    best_k = state.get("best_k_models")
    paths = (state.get("best_model_path"), *(best_k if isinstance(best_k, Mapping) else ()))
    return frozenset(normalize(p) for p in paths if isinstance(p, str) and p)


def landed(handle: SaveHandle) -> bool:
    """Whether a save has ended at its path (not failed, skipped, dropped for a newer one)."""
    if not handle.done():
        return False
    try:
        rec = handle.result()
    except BaseException:  # noqa: BLE001 (never at its path; the training thread raises it once)
        return False
    return rec.durable_s is not None and not rec.superseded


class LastFiles:
    """One fit's last saves, per ModelCheckpoint(save_last=True), and the deletions they hold back.

    ``read(path, key)``: what the state ``key`` in the file at ``path`` names (the remover thread;
    an empty set for a file that is not there or cannot be read: nothing is held for it).
    ``enabled``: the plugin has a burst buffer."""

    def __init__(self, read: Callable[[str, str], frozenset[str]], enabled: bool) -> None:
        self._read, self.enabled = read, enabled
        self._lock = threading.Lock()
        self._saves: dict[str, list[tuple[SaveHandle, frozenset[str]]]] = {}  # state_key -> last saves, oldest first
        self._first: dict[str, str] = {}  # state_key -> its last file when the fit began ("" none)
        self._before: dict[str, frozenset[str]] = {}  # what that file names (read once, ``_first_names``)
        self._parked: list[tuple[Any, str, dict[str, int]]] = []  # (ck, path, the marks holding it)
        self._deleting: set[str] = set()  # parked deletions a run is doing now

    def start(self, trainer: Any) -> None:
        """The training thread, at on_fit_start (callbacks restored): each last file at its path now."""
        for cb in owners(trainer) if self.enabled else ():
            self._first[cb.state_key] = normalize(cb.last_model_path) if cb.last_model_path else ""

    def saved(self, trainer: Any, path: str, handle: SaveHandle, checkpoint: object) -> None:
        """The training thread: ``handle`` saves ``path``; note it if it is a callback's last file."""
        for cb in owners(trainer) if self.enabled else ():
            if cb.last_model_path and normalize(cb.last_model_path) == path:
                with self._lock:
                    self._saves.setdefault(cb.state_key, []).append((handle, named_files(checkpoint, cb.state_key)))

    def mark(self, trainer: Any) -> dict[str, int]:
        """The training thread, as a deletion is asked for: each callback's count of last saves."""
        out = {}
        for cb in owners(trainer) if self.enabled else ():
            self._first.setdefault(cb.state_key, normalize(cb.last_model_path) if cb.last_model_path else "")
            with self._lock:
                out[cb.state_key] = len(self._saves.get(cb.state_key, ()))
        return out

    def holders(self, path: str, mark: dict[str, int]) -> dict[str, str]:
        """The remover thread: the callbacks (key -> last file) whose last file at the path names
        ``path`` and has no newer last save landed after ``mark``."""
        out = {}
        for key, count in mark.items():
            with self._lock:
                saves = list(self._saves.get(key, ()))
            if any(landed(h) for h, _ in saves[count:]):
                continue
            now = [(h.path, names) for h, names in saves[:count] if landed(h)]
            last, names = now[-1] if now else (self._first.get(key, ""), self._first_names(key))
            if path in names:
                out[key] = last
        return out

    def _first_names(self, key: str) -> frozenset[str]:
        if key not in self._before:  # (the remover thread only)
            first = self._first.get(key, "")
            self._before[key] = self._read(first, key) if first else frozenset()
        return self._before[key]

    def park(self, ck: Any, path: str, mark: dict[str, int]) -> None:
        with self._lock:
            self._parked.append((ck, path, mark))

    def unpark(self, path: str) -> bool:
        """The training thread, before a save to ``path``: its parked deletion is off. True if a
        run is deleting it right now (wait for that run)."""
        with self._lock:
            self._parked = [e for e in self._parked if e[1] != path]
            return path in self._deleting

    def ready(self) -> bool:
        """Whether a parked deletion may go now (cheap: the training thread asks at each save and batch)."""
        with self._lock:
            return any(self._free(mark) for _, _, mark in self._parked)

    def _free(self, mark: dict[str, int]) -> bool:
        return all(any(landed(h) for h, _ in self._saves.get(key, [])[count:]) for key, count in mark.items())

    def take(self, final: bool) -> list[tuple[Any, str, dict[str, int] | None]]:
        """The remover thread: the parked deletions that may go now, marked as being done (``done``);
        ``final`` (teardown, every save ended): all of them, those still held with their marks."""
        with self._lock:
            go = [(ck, p, None if self._free(mark) else mark) for ck, p, mark in self._parked
                  if final or self._free(mark)]
            self._parked = [e for e in self._parked if final or not self._free(e[2])]
            self._deleting.update(p for _, p, _ in go)
        return go

    def done(self, path: str) -> None:
        with self._lock:
            self._deleting.discard(path)

    def handles(self) -> list[SaveHandle]:
        with self._lock:
            return [h for saves in self._saves.values() for h, _ in saves]
