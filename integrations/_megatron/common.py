"""What the Megatron save and load strategies share: the backend's name, the file names, and
which Checkpointer they work through."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch

from fastckpt import Checkpointer
from fastckpt.errors import ConfigError
from fastckpt.io.ops import FileOps

from .compat import is_url, normalize

BACKEND, VERSION = "fastckpt", 1
INDEX_FILE = "fastckpt-index.pt"
TENSOR_FILE = "fastckpt-rank{:05d}.pt"
OBJECT_FILE = "fastckpt-objects-rank{:05d}.pt"

CheckpointerSource = Checkpointer | Callable[[], Checkpointer] | None
_default: Checkpointer | None = None


def default_checkpointer() -> Checkpointer:
    """The Checkpointer the registered strategies use unless given one (created on first use,
    so that torch.distributed is initialised by then; closed at exit)."""
    global _default
    if _default is None:
        _default = Checkpointer()
    return _default


def resolve(source: CheckpointerSource) -> Checkpointer:
    """The Checkpointer a strategy was given (itself, or what its function returns), else the default."""
    if source is None:
        return default_checkpointer()
    if isinstance(source, Checkpointer):
        return source
    ck = source()
    if not isinstance(ck, Checkpointer):
        raise ConfigError(f"the checkpointer function given to the Megatron strategies ({source!r}) returned {ck!r}: "
                          "it must return a fastckpt.Checkpointer")
    return ck


class Once:
    """A checkpointer function, called at the first save or load only: every later one goes through
    the Checkpointer it returned (a new one per file fought over a metrics port, and each kept its
    own staging buffers and overhead monitor)."""

    def __init__(self, fn: Callable[[], Checkpointer]) -> None:
        self._fn, self._ck, self._lock = fn, None, threading.Lock()

    def __call__(self) -> Checkpointer:
        with self._lock:
            if self._ck is None:
                self._ck = self._fn()
            return self._ck

    def __repr__(self) -> str:
        return repr(self._fn)


def once(source: CheckpointerSource) -> CheckpointerSource:
    """``source``, a function among them wrapped in ``Once`` (register shares one between its strategies)."""
    return source if source is None or isinstance(source, Checkpointer | Once) or not callable(source) else Once(source)


def checked(checkpointer: CheckpointerSource, ops: FileOps | None) -> tuple[CheckpointerSource, FileOps]:
    """The strategies' ``checkpointer`` and ``ops`` (default: a plain FileOps), refused when they
    are neither: a wrong one used to fail only at the first save or load, as a bare TypeError or
    AttributeError from deep inside it.

    Raises:
        ConfigError: naming the argument and what it accepts.
    """
    if checkpointer is not None and not isinstance(checkpointer, Checkpointer) and not callable(checkpointer):
        raise ConfigError(f"checkpointer={checkpointer!r}: give a fastckpt.Checkpointer, a function returning one, "
                          "or None (default_checkpointer())")
    if ops is not None and not isinstance(ops, FileOps):
        raise ConfigError(f"ops={ops!r}: give a fastckpt.io.ops.FileOps (such as fastckpt.testing.FaultyOps), or None "
                          "(a plain FileOps)")
    return once(checkpointer), ops or FileOps()


class ThroughCheckpointer:
    """What both strategies say alike: the Checkpointer they work through (``_source``) and that
    they handle ShardedObjects."""

    _source: CheckpointerSource

    @property
    def checkpointer(self) -> Checkpointer:
        return resolve(self._source)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True


def checkpoint_group(checkpoint_dir: str | Path) -> str:
    """The checkpoint directory as fastckpt's group name (an absolute path; URLs are refused)."""
    group = normalize(checkpoint_dir)
    if is_url(group):
        raise ConfigError(f"{group}: megatron writes common.pt and metadata.json with POSIX calls, so the checkpoint "
                          "directory must be a path (a mount); for a burst buffer give the Checkpointer local_dir")
    return group


def rank_world() -> tuple[int, int]:
    """This process's rank and the world size, from torch.distributed (which megatron requires)."""
    if not torch.distributed.is_initialized():
        raise ConfigError("megatron's dist_checkpointing needs torch.distributed: call "
                          "torch.distributed.init_process_group first (gloo works on CPU)")
    return torch.distributed.get_rank(), torch.distributed.get_world_size()
