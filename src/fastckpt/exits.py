"""Flushing open Checkpointers when the interpreter exits.

A save still in flight when a script returns from ``main`` must not be lost. The flush has to
run before concurrent.futures stops accepting work (its own exit hook makes every ``submit``
fail, and a pending save still has chunks, replication and a group commit to submit), so it is
registered where that hook is: ``threading._register_atexit``, whose hooks run in reverse order
of registration, before the interpreter joins its threads. Python's ``atexit`` runs too late.
One hook serves every Checkpointer, over a WeakSet, so an unclosed one is not kept alive by it.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("fastckpt")


class Flushable(Protocol):
    def _atexit(self) -> None: ...


_LIVE: weakref.WeakSet[Flushable] = weakref.WeakSet()
_lock = threading.Lock()
_hooked = False


def flush_at_exit(obj: Flushable) -> None:
    """Call ``obj._atexit()`` at interpreter exit unless ``forget_at_exit(obj)`` came first."""
    global _hooked
    _LIVE.add(obj)
    with _lock:
        if not _hooked:
            getattr(threading, "_register_atexit", atexit.register)(_flush_live)
            _hooked = True


def forget_at_exit(obj: Flushable) -> None:
    _LIVE.discard(obj)


def close_at_exit(close: Callable[[], None], pending: Callable[[], int], replicating: Callable[[], list[str]]) -> None:
    """A Checkpointer's ``_atexit``: ``close()`` it, saying what it flushes, and log what it
    raises (at exit there is no caller left to raise to)."""
    if n := pending():
        copies = replicating()
        log.warning("fastckpt: flushing %d pending save(s) at interpreter exit%s; call close() (or use the "
                    "Checkpointer as a context manager) to do this explicitly",
                    n, f" (replicating {', '.join(copies)})" if copies else "")
    try:
        close()
    except KeyboardInterrupt:
        log.error("fastckpt: interrupted while flushing %d pending save(s) at interpreter exit: those not durable by "
                  "then are lost (failures are logged above); the checkpoints before them are intact", n)
    except BaseException as exc:  # noqa: BLE001
        log.error("fastckpt: a pending save failed at exit: %r", exc)


def _flush_live() -> None:
    for obj in list(_LIVE):
        obj._atexit()


# A forked child (Megatron's async save worker, a DataLoader worker) inherits the parent's open
# Checkpointers but none of their threads: it must never flush (and wait on) them at its exit.
os.register_at_fork(after_in_child=_LIVE.clear)
