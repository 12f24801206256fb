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
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import Protocol

from .errors import ClosedError
from .records import STOPPED

log = logging.getLogger("fastckpt")


class Flushable(Protocol):
    def _atexit(self, forked: bool = False) -> bool:
        """Flush (close) it at exit; in a fork child (``forked``, ``_forked``), close it for that process if its
        threads stayed in the parent. Returns whether it works in this process (no thread of it is another's)."""


_LIVE: weakref.WeakSet[Flushable] = weakref.WeakSet()
_INHERITED: weakref.WeakSet[Flushable] = weakref.WeakSet()  # in a fork child: those it inherited and kept
_AFTER: list[Callable[[], None]] = []
_STOPS: list[BaseException] = []  # a SIGTERM handler's SystemExit or a Ctrl-C that came during the exit flush
_lock = threading.Lock()
_hooked = False


def flush_at_exit(obj: Flushable) -> None:
    """Call ``obj._atexit()`` at interpreter exit unless ``forget_at_exit(obj)`` came first."""
    _LIVE.add(obj)
    _hook()


def after_flush(fn: Callable[[], None]) -> None:
    """Call ``fn()`` at interpreter exit after every open Checkpointer was flushed, however the
    order of imports and Checkpointers went: an integration's own work that follows a commit
    in a daemon thread of its own (Megatron's tracker), which the flush does not wait for and
    the interpreter freezes once its exit hooks return. Registered once per ``fn``."""
    with _lock:
        if fn not in _AFTER:
            _AFTER.append(fn)
    _hook()


def _hook() -> None:
    global _hooked
    import concurrent.futures.thread  # noqa: F401 (its exit hook first: ours then runs before it, see above)

    with _lock:
        if not _hooked:
            try:
                getattr(threading, "_register_atexit", atexit.register)(_flush_live)
            except RuntimeError as exc:  # "can't register atexit after shutdown": an atexit handler makes one
                raise ClosedError("a Checkpointer cannot be made at interpreter exit: once the main thread has ended "
                                  "(an atexit handler runs after that), Python's thread pools refuse new work, so "
                                  "nothing could be saved. Save before the main thread returns (in a finally "
                                  "block)") from exc
            _hooked = True


def forget_at_exit(obj: Flushable) -> None:
    _LIVE.discard(obj)


def close_at_exit(close: Callable[[], None], pending: Callable[[], int], replicating: Callable[[], list[str]]) -> None:
    """A Checkpointer's ``_atexit``: ``close()`` it, saying what it flushes, and log what it
    raises (at exit there is no caller left to raise to). A SIGTERM handler's ``sys.exit`` or a
    Ctrl-C landing anywhere in here does not skip the ``close()``: saves that returned must not
    be lost by a stop that came as the flush began (``_flush_live`` says what came)."""
    n = 0
    try:
        if n := pending():
            copies = replicating()
            log.warning("fastckpt: flushing %d pending save(s) at interpreter exit%s; call close() (or use the "
                        "Checkpointer as a context manager) to do this explicitly",
                        n, f" (replicating {', '.join(copies)})" if copies else "")
    except (SystemExit, KeyboardInterrupt) as exc:
        _STOPS.append(exc)
    try:
        close()
    except (SystemExit, KeyboardInterrupt) as exc:  # close() ends the pending work first, unless close_timeout_s
        _STOPS.append(exc)  # is set: then it stops as at that timeout (its note says so)
        stopped = [note for note in getattr(exc, "__notes__", ()) if note.startswith(STOPPED)]
        if stopped or (left := _quietly(pending)):
            log.error("fastckpt: %s while flushing %d pending save(s) at interpreter exit: %s (failures are logged "
                      "above)", _named(exc), n, "close_timeout_s is set, so the flush stopped as at that timeout: "
                      f"{stopped[0]}" if stopped else f"{left} not durable by then are lost; the checkpoints before "
                      "them are intact")
    except BaseException as exc:  # noqa: BLE001
        log.error("fastckpt: a pending save failed at exit: %r", exc)


def _quietly(fn: Callable[[], int]) -> int:
    try:
        return fn()
    except (SystemExit, KeyboardInterrupt) as exc:  # a second stop: counted, the count left unsaid
        _STOPS.append(exc)
        return 0


def _named(exc: BaseException) -> str:
    return "interrupted (Ctrl-C)" if isinstance(exc, KeyboardInterrupt) else f"stopped by sys.exit({exc.code!r})"


def stop_pools(executors: Iterable[Executor], wait: bool) -> None:
    """Shut ``executors`` down: after their work (``wait``), or at once, dropping what has not
    started and leaving what runs to end with the process (``abandon_at_exit``)."""
    executors = tuple(executors)
    for ex in executors:
        ex.shutdown(wait=wait, cancel_futures=not wait)
    if not wait:
        abandon_at_exit(executors, "close() gave up waiting (close_timeout_s)")


def abandon_at_exit(executors: Iterable[Executor], why: str) -> list[str]:
    """``executors`` were shut down without waiting (``close_timeout_s`` passed): the threads
    still running their work (a write stuck on a stalled mount) must not hold the process at
    exit, or the timeout bounds nothing. A ThreadPoolExecutor's threads are joined at exit twice,
    by concurrent.futures' exit hook (``_threads_queues``) and by threading's join of non-daemon
    threads (``_shutdown_locks``); both forget them here, so they end with the interpreter, as
    daemon threads do. Returns their names (logged with ``why``)."""
    import concurrent.futures.thread as cft

    deadline = time.monotonic() + 0.1  # idle workers end at once on shutdown: only busy ones are left
    busy = [t for ex in executors for t in list(getattr(ex, "_threads", ()))
            if t.join(max(0.0, deadline - time.monotonic())) or t.is_alive()]
    locks, guard = getattr(threading, "_shutdown_locks", None), getattr(threading, "_shutdown_locks_lock", None)
    for t in busy:
        with cft._global_shutdown_lock:  # noqa: SLF001 (see the docstring)
            cft._threads_queues.pop(t, None)  # noqa: SLF001
        if locks is not None and guard is not None and (lock := getattr(t, "_tstate_lock", None)) is not None:
            with guard:
                locks.discard(lock)
    if busy:
        held = "" if locks is not None else " (this Python joins them at exit all the same)"
        log.warning("fastckpt: %s: %d worker thread(s) still busy (%s) are left to end with the process%s",
                    why, len(busy), ", ".join(t.name for t in busy), held)
    return [t.name for t in busy]


def _flush_live() -> None:
    for obj in list(_LIVE):
        try:
            obj._atexit()
        except (SystemExit, KeyboardInterrupt) as exc:  # between two Checkpointers: the next is flushed all the same
            _STOPS.append(exc)
    for fn in list(_AFTER):
        try:
            fn()
        except (Exception, SystemExit, KeyboardInterrupt) as exc:  # noqa: BLE001 (no caller left to raise to)
            log.error("fastckpt: %r failed at interpreter exit: %r", fn, exc)
    if _STOPS:  # Python ignores an exit asked for while it shuts down: say so rather than lose it silently
        log.warning("fastckpt: %s during the exit flush, which went on first unless close_timeout_s bounds it (what "
                    "it could not save is logged above). Python ignores an exit requested while it shuts down: the "
                    "exit status is the one the main thread ended with", _named(_STOPS[0]))
        _STOPS.clear()


def ran_threads(*workers: object) -> bool:
    """Whether any of ``workers`` (thread pools, the replicator) started a thread: in a forked
    child those threads stayed in the parent, though the pools count them."""
    return any(getattr(w, "_threads", None) for w in workers)


def inherited(obj: Flushable) -> bool:
    """Whether this fork child inherited ``obj`` (unused then) from its parent (``_forked``)."""
    return obj in _INHERITED


def _forked() -> None:
    """In a forked child (Megatron's async save worker, a DataLoader worker, Lightning's
    ``ddp_fork``): it inherits the parent's open Checkpointers but none of their threads. One whose
    pools ran threads is closed for this process (``_atexit(forked=True)``) and never flushed (and
    waited on) at its exit: a save through it queued work no thread runs (``close()`` hung, or the
    file was never written, silently); a call raises ``ClosedError`` saying to create one in the
    child. One that never ran anything starts its own threads there, as before, and stays: the
    child's exit flushes what it saved through it, as any process's (the hook registered in the
    parent is the child's too; a multiprocessing child runs it, ``threading._shutdown``, before
    ``os._exit``). One the child never used is left alone at its exit: it is the parent's."""
    for obj in list(_LIVE):
        if obj._atexit(forked=True):
            _INHERITED.add(obj)
        else:
            _LIVE.discard(obj)


os.register_at_fork(after_in_child=_forked)
