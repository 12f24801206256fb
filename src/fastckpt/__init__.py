"""fastckpt: checkpoints that do not stall training.

Public API: ``Checkpointer`` (save/commit/load/remove/wait/close), ``latest`` and ``load``;
integrations live in ``fastckpt.integrations`` (Lightning, DeepSpeed, Megatron) and are
imported lazily so the core never imports a framework.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .checkpointer import Checkpointer
from .checkpointer import latest
from .errors import (
    CheckpointWriteError,
    CommitTimeoutError,
    ConfigError,
    CorruptCheckpointError,
    FastCkptError,
    IncompleteCheckpointError,
    ReplicationError,
    TierUnavailableError,
    UnsupportedObjectError,
)
from .events import Event
from .monitor import OverheadReport, Stats
from .records import SaveHandle, SaveRecord

__all__ = [
    "Checkpointer", "latest", "load", "Event", "OverheadReport", "Stats", "SaveHandle", "SaveRecord",
    "FastCkptError", "CheckpointWriteError", "CommitTimeoutError", "ConfigError", "CorruptCheckpointError",
    "IncompleteCheckpointError", "ReplicationError", "TierUnavailableError", "UnsupportedObjectError",
    "FastCkptIO",
]


def load(path: str, map_location: object = None, *, weights_only: bool = True,
         storage_options: dict | None = None) -> object:
    """Load one checkpoint file (a path or URL) with verification (a one-off Checkpointer)."""
    with Checkpointer(storage_options=storage_options) as ck:
        return ck.load(path, map_location, weights_only=weights_only)


def __getattr__(name: str) -> object:
    if name == "FastCkptIO":  # lazy: importing fastckpt must not import Lightning
        from .integrations.lightning import FastCkptIO

        return FastCkptIO
    raise AttributeError(f"module 'fastckpt' has no attribute {name!r}")
