"""fastckpt: checkpoints that do not stall training.

Public API: ``Checkpointer`` (save/commit/load/remove/wait/close), ``latest`` and ``load``;
integrations live in ``fastckpt.integrations`` (Lightning, DeepSpeed, Megatron)
and are imported lazily so the core never imports a framework. ``Checkpointer`` is resolved
on first use too, so ``import fastckpt`` does not import torch (the command line's readers start
without it). docs/architecture.md maps the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import load as _load_path  # noqa: F401 (imported first, so the function ``load`` below keeps the name)
from .errors import (
    CheckpointNotFoundError,
    CheckpointWriteError,
    CommitTimeoutError,
    ConfigError,
    CorruptCheckpointError,
    FastCkptError,
    GroupChangedError,
    IncompleteCheckpointError,
    ReplicationError,
    TierUnavailableError,
    UnsupportedObjectError,
    UnverifiableCheckpointError,
)
from .events import Event
from .monitor import OverheadReport, Stats
from .records import SaveHandle, SaveRecord
from .version import __version__

if TYPE_CHECKING:
    from .checkpointer import Checkpointer, ClosedError

__all__ = [
    "Checkpointer", "latest", "load", "Event", "OverheadReport", "Stats", "SaveHandle", "SaveRecord",
    "FastCkptError", "CheckpointNotFoundError", "CheckpointWriteError", "ClosedError", "CommitTimeoutError",
    "ConfigError", "CorruptCheckpointError", "GroupChangedError", "IncompleteCheckpointError", "ReplicationError",
    "TierUnavailableError", "UnsupportedObjectError", "UnverifiableCheckpointError", "FastCkptIO", "__version__",
]


def load(path: str, map_location: object = None, *, weights_only: bool = True, verify: bool = False,
         storage_options: dict | None = None, mmap: bool = False, into: object = None) -> object:
    """Load one checkpoint file (a path or URL) with verification (a one-off Checkpointer; see
    ``Checkpointer.load``, and its ``into`` to fill tensors that exist already)."""
    from .checkpointer import Checkpointer

    with Checkpointer(storage_options=storage_options) as ck:
        return ck.load(path, map_location, weights_only=weights_only, verify=verify, mmap=mmap, into=into)


def latest(root: str, storage_options: dict | None = None) -> str | None:
    """The newest complete checkpoint under ``root`` (a directory or a URL), or None.

    ``root/latest`` answers when it names a complete checkpoint; otherwise a scan of ``root``
    decides (single files and group directories, in subfolders too; incomplete ones are
    skipped). A complete checkpoint file given as ``root`` is returned as is; another file
    raises ``ConfigError``. See docs/groups.md.
    """
    from .commit.discovery import latest as find
    from .storage.homes import Homes

    homes = Homes(storage_options)
    try:
        return find(homes, root)
    finally:
        homes.close()


def __getattr__(name: str) -> object:
    if name in ("Checkpointer", "ClosedError"):  # lazy: the command line's tools that never save start without torch
        from . import checkpointer

        return getattr(checkpointer, name)
    if name == "FastCkptIO":  # lazy: importing fastckpt must not import Lightning
        from .integrations.lightning import FastCkptIO

        return FastCkptIO
    raise AttributeError(f"module 'fastckpt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
