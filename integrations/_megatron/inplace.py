"""The files megatron-core writes in place into a checkpoint directory, kept as committed.

megatron-core 0.16.1's ``dist_checkpointing.save`` has rank 0 ``torch.save`` ``common.pt`` into
the checkpoint directory before it calls any save strategy, and its finalize step rewrites
``metadata.json`` there with ``open(..., "w")``: both truncate the file in place. A save into
an iteration that is already committed (a retried save, a rollback that trains past that
iteration again) therefore rewrites the committed checkpoint's ``common.pt`` before fastckpt
sees the save, and a kill during either write tears the file. fastckpt stages its own files of
such a save beside the committed group (``fastckpt.commit.resave``), but no strategy code runs
before megatron's write, so that write cannot be staged or refused; what a committed group
keeps instead is enough to put both files back:

- ``record`` (rank 0, during the save): their exact bytes go into the index, a fastckpt file
  committed with the group, and their checksums into the group manifest (``framework_files``,
  which ``fastckpt verify`` checks too);
- ``restore(group)``: the files that no longer match the published manifest's checksums are
  written back from the index (atomically; each is checked against the manifest first). Every
  rank runs it when a save fails, before its error reaches its caller, and ``sync_tracker`` runs it
  for the iteration Megatron-LM is about to load (after a kill). An iteration saved again by
  another backend (megatron's ``torch_dist``: ``metadata.json`` names it) is left alone;
- ``committed(group, digests)``: the committed bytes, from the index: what
  ``FastCkptCommonLoadStrategy`` gives megatron when ``common.pt`` was rewritten (a re-save under
  way in another job, or a killed one), so a reader never needs the file put back first;
- ``check(group, manifest)``: the loader refuses a ``common.pt`` that is not the committed one
  when megatron read it with another common loader, and names the fix.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch
from megatron.core.dist_checkpointing.core import CONFIG_FNAME, maybe_load_config
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

from fastckpt.errors import CorruptCheckpointError
from fastckpt.io.ops import FileOps

from .common import BACKEND, INDEX_FILE
from .compat import FRAMEWORK_FILES, checksum_bytes, framework_files, publish_bytes, read_group_manifest

log = logging.getLogger("fastckpt.megatron")

KEY = "megatron_files"  # in the index: name -> bytes; in group manifests saved before FRAMEWORK_FILES: checksums
MANIFEST_KEY = FRAMEWORK_FILES  # in the group manifest: name -> checksum, which `fastckpt verify` checks too
FIX = "fastckpt.integrations.megatron.repair_checkpoint"


def record(group: str, config: bytes) -> dict[str, bytes]:
    """Rank 0, during the save: the bytes of megatron's in-place files of this save (``common.pt``
    as megatron just wrote it, and ``config``, the metadata.json the strategy writes)."""
    kept = {CONFIG_FNAME: config}
    try:
        with open(os.path.join(group, COMMON_STATE_FNAME), "rb") as f:
            kept[COMMON_STATE_FNAME] = f.read()
    except FileNotFoundError:  # the strategy was called without megatron's save()
        pass
    return kept


def checksums(kept: dict[str, bytes]) -> dict[str, str]:
    return {name: checksum_bytes(data) for name, data in kept.items()}


def _checksum_of(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return checksum_bytes(f.read())
    except FileNotFoundError:
        return None


def _damaged(group: str, manifest: dict | None) -> dict[str, str]:
    """The in-place files of the published ``manifest`` whose bytes are not the committed ones."""
    want = framework_files(manifest)
    return {name: digest for name, digest in want.items() if _checksum_of(os.path.join(group, name)) != digest}


def check(group: str, manifest: dict) -> None:
    """Raise when megatron's in-place files are not the ones committed with ``group``.

    Raises:
        CorruptCheckpointError: naming the files and ``repair_checkpoint``.
    """
    damaged = _damaged(group, manifest)
    if damaged:
        raise rewritten_error(group, damaged)


def rewritten_error(group: str, names: Iterable[str]) -> CorruptCheckpointError:
    """The error for in-place files (``names``) that are not the ones committed with ``group``."""
    return CorruptCheckpointError(
        f"{group}: {', '.join(sorted(names))} is not the one committed with this checkpoint: a save into this "
        "iteration that did not finish (killed, or failed before fastckpt could put it back) rewrote it in place. "
        f"Put it back with {FIX}({group!r}) (the patched Megatron-LM load path does "
        "that itself, in sync_tracker), then load again")


def restore(group: str, ops: FileOps) -> list[str]:
    """Write back the in-place files of the checkpoint published at ``group`` that do not match
    its manifest, from its index. Safe on every rank at once (each write is atomic and of the
    same bytes).

    Returns:
        The names of the files written back (none when nothing is published at ``group``).

    Raises:
        CorruptCheckpointError: the index does not hold bytes that match the manifest.
    """
    damaged = _damaged(group, read_group_manifest(group))
    if not damaged or saved_by(group) not in (None, BACKEND):
        return []  # (a later save of this iteration by megatron's own strategy: its files, not ours to put back)
    kept = committed(group, damaged)
    for name in sorted(damaged):
        publish_bytes(ops, os.path.join(group, name), kept[name])
        log.warning("fastckpt: put back %s as committed: a save into this iteration that did not finish had "
                    "rewritten it in place", os.path.join(group, name))
    return sorted(damaged)


def committed(group: str, digests: dict[str, str]) -> dict[str, bytes]:
    """The committed bytes of megatron's in-place files ``digests`` names (name -> checksum in the
    published manifest), from the group's index, each checked against its checksum.

    Raises:
        CorruptCheckpointError: the index cannot be read, or does not hold them.
    """
    index_path = os.path.join(group, INDEX_FILE)
    try:  # a plain load: what it gives is checked against the manifest below
        kept = torch.load(index_path, map_location="cpu", weights_only=True).get(KEY) or {}
    except Exception as exc:  # noqa: BLE001 (any failure to read it: raised as what it means here)
        raise CorruptCheckpointError(f"{index_path} cannot be read ({exc!r}), so the committed "
                                     f"{', '.join(sorted(digests))} of this checkpoint cannot be read back: load an "
                                     "earlier checkpoint") from exc
    for name, digest in sorted(digests.items()):
        data = kept.get(name)
        if not isinstance(data, bytes) or checksum_bytes(data) != digest:
            raise CorruptCheckpointError(f"{index_path} does not hold the committed {name}, so it cannot be read "
                                         "back: load an earlier checkpoint")
    return {name: kept[name] for name in digests}


def saved_by(group: str) -> str | None:
    """The sharded backend ``metadata.json`` names (written last by megatron's save); None when
    it is missing or cut short (a save killed while writing it)."""
    try:
        config = maybe_load_config(group)
    except (OSError, ValueError, TypeError):  # (TypeError: valid JSON that is not a config, such as null)
        return None
    return None if config is None else config.sharded_backend


def restore_after(group: str, ops: FileOps, error: BaseException) -> None:
    """Any rank, when a save into ``group`` failed: ``restore`` it; if that fails too, say so on
    ``error`` (which the caller raises) and in the log."""
    try:
        restore(group, ops)
    except (OSError, CorruptCheckpointError) as exc:
        log.error("fastckpt: %s could not be put back after a failed save: %r", group, exc)
        error.add_note(f"fastckpt could not put back {group}'s common.pt/metadata.json after this failure ({exc!r}); "
                       f"run {FIX}({group!r}) before loading it")
