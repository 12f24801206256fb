"""Megatron-LM's tracker file: which iteration to resume from.

Megatron-LM names the checkpoint to resume from in ``<save dir>/latest_checkpointed_iteration.txt``
(an iteration number, or ``release``); its checkpoints are ``<save dir>/iter_NNNNNNN``.
fastckpt's own truth is the group manifest: an iteration is complete once
``iter_NNNNNNN/fastckpt-manifest.json`` exists. As Megatron-LM's finalize step does, the tracker
names the iteration committed last (which, after a rollback, may be a lower number than others
on disk), but only once it is complete, and atomically (temp, fsync, rename, directory fsync):
``advance_tracker`` right after the commit, which then records that commit in
``.fastckpt-tracker.json`` beside it. ``sync_tracker``, at load time, repairs only what a crash
can leave: a tracker written before the commit that fastckpt's ``latest`` names (a kill
between that commit and the tracker's write), or one that names an incomplete iteration. Any
other tracker, a user's edit to roll back included, is left as it is.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import threading

from fastckpt.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, IncompleteCheckpointError
from fastckpt.io.ops import FileOps

from .common import BACKEND
from .compat import GROUP_MANIFEST, group_order, holds, latest_name, publish_bytes, read_group_manifest, sweep_once
from .inplace import restore, saved_by

log = logging.getLogger("fastckpt.megatron")
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)  # a directory sync_tracker may read but not write

TRACKER = "latest_checkpointed_iteration.txt"
RECORD = ".fastckpt-tracker.json"  # the commit of the iteration advance_tracker last wrote
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


def _not_a_file(save_dir: str) -> None:
    """Refuse a file given as the save directory (a raw ``NotADirectoryError`` named neither)."""
    try:
        is_file = not stat.S_ISDIR(os.stat(save_dir).st_mode)
    except NotADirectoryError:  # 'tracker.txt/': a file named as a directory
        is_file = True
    except OSError:  # missing (names nothing) or unreadable: the call itself says
        is_file = False
    if is_file:
        raise ConfigError(f"{save_dir} is a file, not a save directory: give Megatron-LM's --save directory, the "
                          f"one holding iter_NNNNNNN and {TRACKER}")


def read_tracker(save_dir: str) -> int | str | None:
    """What the tracker names: an iteration, ``release``, or None (no or unreadable tracker).

    Raises:
        ConfigError: ``save_dir`` is a file."""
    _not_a_file(save_dir)
    try:
        with open(os.path.join(save_dir, TRACKER)) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    if text == "release":
        return text
    return int(text) if text.isdigit() else None


def _manifest(save_dir: str, iteration: int | str) -> dict | None:
    """The iteration's group manifest; None when it is not published, or damaged (it does not
    parse): as for ``fastckpt.latest``, that checkpoint is not complete, and a WARNING names it.
    (Raised, it stopped the patched Megatron-LM's start whichever iteration it was to load.)"""
    try:
        return read_group_manifest(_group_of(save_dir, iteration))
    except CorruptCheckpointError as exc:
        log.warning("fastckpt: taking iteration %s as not complete: %s", iteration, exc)
        return None


def is_complete(save_dir: str, iteration: int | str) -> bool:
    """True once the iteration's group manifest exists (every rank's files are durable) and parses."""
    return _manifest(save_dir, iteration) is not None


def _recorded(save_dir: str) -> float | None:
    """When the commit of the iteration ``advance_tracker`` last wrote was made (its
    ``group_order``); None if it never wrote one here."""
    try:
        with open(os.path.join(save_dir, RECORD)) as f:
            return float(json.load(f)["order"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):  # written atomically: only a foreign edit damages it
        return None


def _write(save_dir: str, iteration: int | str, order: float, ops: FileOps, tracker: bool = True) -> None:
    """The tracker (Megatron-LM's format: the number, nothing else), then the record of its commit.
    Temp files of them that dead processes of this host left (a kill mid-write) go first, once."""
    sweep_once(ops, save_dir)
    if tracker:
        publish_bytes(ops, os.path.join(save_dir, TRACKER), str(iteration).encode())
    publish_bytes(ops, os.path.join(save_dir, RECORD), json.dumps({"iteration": iteration, "order": order}).encode())


def advance_tracker(save_dir: str, iteration: int | str, *, ops: FileOps | None = None) -> bool:
    """Point Megatron-LM's tracker at ``iteration``, just committed (its finalize step).

    Args:
        save_dir: the directory holding ``iter_NNNNNNN`` checkpoints (Megatron-LM's ``--save``).
        iteration: the iteration saved, or ``"release"``.
        ops: the FileOps to write through.

    Returns:
        Whether the tracker was written: not when that checkpoint is not complete, nor when
        the tracker was written for a commit made after this one (commits that finish out of
        order), each with a WARNING. A lower number than the tracker's is written (a rollback
        saves one). "After" is the rule of fastckpt's ``latest`` pointer: a commit dated more
        than a minute after this host's clock (a previous run's, on a clock that ran ahead) holds
        neither.

    Raises:
        ConfigError: ``save_dir`` is a file (before, a warning called the checkpoint incomplete).
    """
    _not_a_file(save_dir)
    manifest = _manifest(save_dir, iteration)
    if manifest is None:
        log.warning("fastckpt: not pointing %s at iteration %s: that checkpoint is not complete",
                    os.path.join(save_dir, TRACKER), iteration)
        return False
    order = group_order(manifest)
    with _lock:
        last = _recorded(save_dir)
        if last is not None and holds(last, order):
            log.warning("fastckpt: not pointing %s at iteration %s: it was written for a commit made after this one "
                        "(commits that finished out of order, or that host's clock ran up to a minute ahead of this "
                        "one's); it names %s", os.path.join(save_dir, TRACKER), iteration, read_tracker(save_dir))
            return False
        _write(save_dir, iteration, order, ops or FileOps())
    return True


def _committed_last(save_dir: str) -> tuple[int | str, float, bool] | None:
    """The complete iteration committed last, its ``group_order``, and whether fastckpt's
    ``latest`` pointer names it (else, no usable pointer, it is the newest a scan finds)."""
    pointed = latest_name(save_dir)
    it = iteration_of(pointed) if pointed is not None else None
    manifest = _manifest(save_dir, it) if it is not None else None
    if it is not None and manifest is not None:
        return it, group_order(manifest), True
    try:
        names = os.listdir(save_dir)
    except FileNotFoundError:
        return None
    found = [(it, group_order(m), False) for n in names if (it := iteration_of(n)) is not None
             and (m := _manifest(save_dir, it)) is not None]
    return max(found, key=lambda f: f[1], default=None)


def newest_complete_iteration(save_dir: str) -> int | str | None:
    """The complete iteration under ``save_dir`` committed last (what ``fastckpt.latest`` names).

    Raises:
        ConfigError: ``save_dir`` is a file (a directory that does not exist names nothing: None)."""
    _not_a_file(save_dir)
    found = _committed_last(save_dir)
    return found[0] if found is not None else None


def _incomplete(save_dir: str, iteration: int | str) -> bool:
    """Whether ``iteration`` cannot be loaded: its directory is gone, or holds a fastckpt save
    that was never committed (a checkpoint of another format is not judged).

    ``metadata.json`` is asked first: megatron writes it last in every save, so it names the
    backend that saved the iteration last. A fastckpt save that failed or was killed leaves
    names of ours behind, and a ``torch_dist`` save into the same directory (megatron's
    "Overwriting old incomplete / corrupted checkpoint") that completed is megatron's: judged by
    those names first, it was called incomplete and the tracker moved back to an older iteration.
    Only without a readable ``metadata.json`` do our names decide."""
    group = _group_of(save_dir, iteration)
    if is_complete(save_dir, iteration):
        return False
    try:
        names = os.listdir(group)
    except FileNotFoundError:
        return True
    backend = saved_by(group)
    if backend is not None:  # ours and never committed, or another format's: not ours to judge
        return backend == BACKEND
    return any(n.startswith(("fastckpt-", ".fastckpt")) for n in names)


def sync_tracker(save_dir: str, *, load_iteration: int | None = None, ops: FileOps | None = None
                 ) -> int | str | None:
    """Repair what a crash can leave in the tracker, and return what it names.

    Call it before Megatron-LM reads the tracker (the patch in examples/megatron does, on
    every rank: each reaches the same answer from the same files). It moves the tracker to the
    iteration committed last when that commit came after the tracker's last write through
    ``advance_tracker`` (a kill fell between the two), or when the tracker names an incomplete
    iteration; and says so in a log line. Any other tracker is left as it is: a user who
    rolled back by editing it keeps that. It also puts back the files megatron rewrites in
    place (``common.pt``, ``metadata.json``) of the iteration the tracker then names, and of
    ``load_iteration`` (Megatron-LM's ``--ckpt-step``), where a save into that committed
    iteration was killed (``_megatron.inplace``).

    An iteration whose group manifest is damaged is not complete (a WARNING names it), so the
    tracker moves off it; only the iteration to be loaded (``load_iteration``, else the one the
    tracker names) fails the call with its own damage.

    Raises:
        ConfigError: ``save_dir`` is a file (a directory that does not exist names nothing: None).
        CorruptCheckpointError: the iteration to be loaded cannot be: its note names the fix.
    """
    _not_a_file(save_dir)
    ops = ops or FileOps()
    # The record before the tracker: writers write the tracker, then the record, so a record that
    # is new means a tracker that is new too. Read the other way round, a rank that saw the old
    # tracker and another rank's new record took the tracker for a user's edit and kept it.
    last, current, newest = _recorded(save_dir), read_tracker(save_dir), _committed_last(save_dir)
    if newest is not None:
        it, order, pointed = newest
        # The record is of another commit than the one the pointer names (it moves forward only, by
        # ``holds`` at the commit: a record a clock that ran ahead dated is behind it too), or, by a
        # scan, of an older one. No rank's clock decides: every rank reaches the same answer.
        behind, why = last is None or (last != order and (pointed or last < order)), None
        if current != it and behind:
            why = f"iteration {it} was committed after the tracker was last written (a kill between the two)"
        elif current is not None and current != it and _incomplete(save_dir, current):
            why = f"iteration {current} is not a complete checkpoint"
        if why is not None or (current == it and behind):
            try:
                with _lock:  # (the tracker already right: only its record was not written yet)
                    _write(save_dir, it, order, ops, tracker=why is not None)
            except OSError as exc:  # a read-only --load (a published model store): loads what it names
                if exc.errno not in _READ_ONLY:
                    raise
                moved = why is not None and read_tracker(save_dir) == it  # its record could not follow
                if moved:
                    log.info("fastckpt: could not write %s (%s)", os.path.join(save_dir, RECORD), exc.strerror)
                elif why is not None:  # (a record alone unwritten says nothing: the tracker names ``it``)
                    log.warning("fastckpt: %s names %s, not %s (%s), and cannot be written here (%s): Megatron-LM "
                                "loads what it names; to load iteration %s give --ckpt-step %s or a writable copy",
                                os.path.join(save_dir, TRACKER), current, it, why, exc.strerror, it, it)
                    why = None
        if why is not None:
            log.warning("fastckpt: %s named %s, now %s: %s", os.path.join(save_dir, TRACKER), current, it, why)
            current = it
    loads = current if load_iteration is None else load_iteration
    for it in {current, load_iteration} - {None}:
        try:
            restore(_group_of(save_dir, it), ops)  # type: ignore[arg-type]
        except CorruptCheckpointError as exc:  # its own damage fails its load, never another iteration's
            if it != loads:
                log.warning("fastckpt: %s (not the iteration loaded now, %s)", exc, loads)
                continue
            exc.add_note(f"Iteration {it} cannot be loaded: {_earlier(save_dir, newest and newest[0])}.")
            raise
        except OSError as exc:  # read-only: the load reads the committed files (the index names them), not these
            if exc.errno not in _READ_ONLY:
                raise
            log.warning("fastckpt: could not put back the files a killed save rewrote in place in %s (%s): the load "
                        "reads the committed ones; a writable copy repairs them", _group_of(save_dir, it),
                        exc.strerror)
    return current


def _earlier(save_dir: str, newest: int | str | None) -> str:
    """The fix for an iteration that cannot be loaded, naming the newest complete one."""
    have = f"the newest is {newest}" if newest is not None else f"{save_dir} holds none"
    return f"load an earlier checkpoint, with --ckpt-step N for a complete iteration N ({have})"


def repair(group: str, ops: FileOps) -> list[str]:
    """``repair_checkpoint``: ``restore`` the checkpoint the caller named, which must be a committed one.

    ``restore`` alone puts back nothing where nothing is published (right for the failed saves and
    the loads that call it), so a misspelled path, or the save directory given for an iteration,
    answered ``[]`` as an intact checkpoint does, and the torn one stayed torn. A checkpoint
    another backend saved (its ``metadata.json`` names it) has nothing of fastckpt's to put back.

    Raises:
        CheckpointNotFoundError: ``group`` does not exist, or is a file.
        IncompleteCheckpointError: ``group`` holds no committed fastckpt checkpoint.
        CorruptCheckpointError: its manifest (or index) is damaged: its note names the fix.
    """
    try:
        return _repair(group, ops)
    except CorruptCheckpointError as exc:  # (the message names the damaged file, as sync_tracker's does)
        save_dir = os.path.dirname(group)
        exc.add_note(f"Nothing was put back in {group}: {_earlier(save_dir, newest_complete_iteration(save_dir))}; "
                     f"`fastckpt verify {group}` names what is damaged.")
        raise


def _repair(group: str, ops: FileOps) -> list[str]:
    if not os.path.isdir(group):
        what = "is a file, not a checkpoint directory" if os.path.exists(group) else "does not exist"
        raise CheckpointNotFoundError(
            f"{group} {what}, so nothing was put back: give the directory of a committed checkpoint, "
            "<save dir>/iter_NNNNNNN (fastckpt.latest(<save dir>) names the newest)")
    if read_group_manifest(group) is None and saved_by(group) in (None, BACKEND):
        newest = newest_complete_iteration(group)
        hint = f"it looks like a save directory; its newest committed checkpoint is {_group_of(group, newest)}" \
            if newest is not None else "give the directory of a committed checkpoint, <save dir>/iter_NNNNNNN; " \
            "a fastckpt save that never committed has nothing to put back: load an earlier checkpoint"
        raise IncompleteCheckpointError(f"{group} is not a committed fastckpt checkpoint (it has no {GROUP_MANIFEST}), "
                                        f"so nothing was put back: {hint}")
    return restore(group, ops)
