"""Megatron-LM's tracker file: which iteration to resume from.

Megatron-LM names the newest checkpoint in ``<save dir>/latest_checkpointed_iteration.txt``
(an iteration number, or ``release``); its checkpoints are ``<save dir>/iter_NNNNNNN``.
fastckpt's own truth is the group manifest: an iteration is complete once
``iter_NNNNNNN/fastckpt-manifest.json`` exists. The tracker is only ever moved forward, to a
complete iteration, atomically (temp, fsync, rename, directory fsync): ``advance_tracker``
right after the commit, ``sync_tracker`` at load time (a kill between the manifest and the
tracker's rename leaves the tracker one iteration behind; the loader moves it on).
"""

from __future__ import annotations

import logging
import os
import re
import threading

from fastckpt.io.ops import FileOps

from .compat import publish_bytes, read_group_manifest
from .inplace import restore

log = logging.getLogger("fastckpt.megatron")

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"iter_(\d{7,})")
_lock = threading.Lock()  # the committer's watchers and Megatron-LM's finalize both advance it


def iteration_of(group: str) -> int | str | None:
    """The iteration a Megatron-LM checkpoint directory holds (``release`` for release)."""
    name = os.path.basename(os.path.normpath(group))
    if name == "release":
        return "release"
    m = _ITER_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def _group_of(save_dir: str, iteration: int | str) -> str:
    return os.path.join(save_dir, "release" if iteration == "release" else f"iter_{int(iteration):07d}")


def read_tracker(save_dir: str) -> int | str | None:
    """What the tracker names: an iteration, ``release``, or None (no or unreadable tracker)."""
    try:
        with open(os.path.join(save_dir, TRACKER)) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    if text == "release":
        return text
    return int(text) if text.isdigit() else None


def is_complete(save_dir: str, iteration: int | str) -> bool:
    """True once the iteration's group manifest exists (every rank's files are durable)."""
    return read_group_manifest(_group_of(save_dir, iteration)) is not None


def advance_tracker(save_dir: str, iteration: int | str, *, ops: FileOps | None = None) -> bool:
    """Point Megatron-LM's tracker at ``iteration``, if that checkpoint is complete and newer.

    Args:
        save_dir: the directory holding ``iter_NNNNNNN`` checkpoints (Megatron-LM's ``--save``).
        iteration: the iteration saved, or ``"release"``.
        ops: the FileOps to write through.

    Returns:
        Whether the tracker moved (it never moves backward, nor to an incomplete checkpoint).
    """
    if not is_complete(save_dir, iteration):
        log.warning("fastckpt: not pointing %s at iteration %s: that checkpoint is not complete",
                    os.path.join(save_dir, TRACKER), iteration)
        return False
    with _lock:
        current = read_tracker(save_dir)
        if isinstance(current, int) and iteration != "release" and current >= int(iteration):
            return False
        publish_bytes(ops or FileOps(), os.path.join(save_dir, TRACKER), str(iteration).encode())
    return True


def newest_complete_iteration(save_dir: str) -> int | None:
    """The highest ``iter_NNNNNNN`` under ``save_dir`` whose group manifest exists."""
    try:
        names = os.listdir(save_dir)
    except FileNotFoundError:
        return None
    found = sorted((int(m.group(1)) for n in names if (m := _ITER_DIR.fullmatch(n))), reverse=True)
    return next((it for it in found if is_complete(save_dir, it)), None)


def sync_tracker(save_dir: str, *, load_iteration: int | None = None, ops: FileOps | None = None
                 ) -> int | str | None:
    """Move the tracker forward to the newest complete iteration and return what it names.

    Call it before Megatron-LM reads the tracker (the patch in examples/megatron does, on
    every rank: each reaches the same answer from the same files). It also puts back the
    files megatron rewrites in place (``common.pt``, ``metadata.json``) of the iteration the
    tracker then names, and of ``load_iteration`` (Megatron-LM's ``--ckpt-step``), where a save
    into that committed iteration was killed (``_megatron.inplace``).
    """
    newest = newest_complete_iteration(save_dir)
    current = read_tracker(save_dir)
    if newest is not None and current != "release" and (current is None or newest > current):
        advance_tracker(save_dir, newest, ops=ops)
        current = newest
    for it in {current, load_iteration} - {None}:
        restore(_group_of(save_dir, it), ops or FileOps())  # type: ignore[arg-type]
    return current
