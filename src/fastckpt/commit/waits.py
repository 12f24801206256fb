"""Blocking waits on a torch.distributed store, shared by the threads of a process (``store.py``).

A blocking ``wait`` holds its client connection for as long as it waits, so waits run on clones
of the store (``Store.clone``, kept for reuse), never on the connection the training thread or
the process group uses.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import ClassVar

log = logging.getLogger("fastckpt")
WAIT_SLICE_S = 30.0  # how often a wait that close() may end early is re-armed, to notice it


def store_errors() -> tuple[type[BaseException], type[BaseException]]:
    """(the error a ``wait`` that timed out raises, any store error)."""
    import torch.distributed as dist

    return dist.DistStoreError, dist.DistError


class Waits:
    """Blocking waits on one store, shared by every thread of this process.

    A blocking ``wait`` holds its client connection, so each runs on a clone of the store (its
    own connection), taken from a small free list and given back after; threads that wait for
    the same key share one wait (simulated ranks in one process all wait for one outcome). A
    store that cannot clone is polled with ``check`` instead.
    """

    _by_store: ClassVar[weakref.WeakKeyDictionary] = weakref.WeakKeyDictionary()  # store -> Waits
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, store: object) -> None:
        self._store = weakref.ref(store)  # the registry must not keep a store (and its server) alive
        self._lock = threading.Lock()
        self._free: list[object] = []
        self._keys: dict[str, list] = {}  # key -> [Event, found]

    @classmethod
    def of(cls, store: object) -> Waits:
        with cls._registry_lock:
            waits = cls._by_store.get(store)
            if waits is None:
                waits = cls._by_store[store] = cls(store)
            return waits

    def _conn(self, store: object) -> object | None:
        with self._lock:
            if self._free:
                return self._free.pop()
        try:
            return store.clone()
        except (RuntimeError, AttributeError, NotImplementedError):
            return None

    def again(self, store: object, call: Callable[[object], object]) -> object:
        """``call(store)``; when that fails, once more on another connection to it (a clone): that
        one connection may have been reset while the store lives on (hosted by torchrun's agent).
        Only for calls that are safe to repeat (``set``, ``delete_key``).

        Raises:
            DistError: the clone failed too, or none could be made (the store is gone).
        """
        try:
            return call(store)
        except store_errors()[1] as exc:
            conn = self._conn(store)
            if conn is None:
                raise
            done = call(conn)  # (its error, if any, says that the store itself stopped answering)
            with self._lock:
                self._free.append(conn)
            log.warning("fastckpt: a call to the torch.distributed store failed (%s); made again on another "
                        "connection to it, which answered", exc)
            return done

    def _wait_once(self, key: str, slice_s: float) -> bool:
        store = self._store()
        if store is None:  # its Checkpointers are gone
            return False
        conn = self._conn(store)
        if conn is None:  # no clone: poll this slice away
            end = time.monotonic() + slice_s
            while not store.check([key]):
                if time.monotonic() >= end:
                    return False
                time.sleep(0.05)
            return True
        try:
            conn.wait([key], timedelta(seconds=slice_s))
            return True
        except RuntimeError as exc:  # a TCPStore's timed-out wait: DistStoreError; a FileStore's: this text
            if not isinstance(exc, store_errors()[0]) and str(exc) != "Wait timeout":
                raise
            return False
        finally:
            with self._lock:
                self._free.append(conn)

    def wait(self, key: str, deadline: float, stop: threading.Event, slice_s: float | None) -> bool:
        """Block until ``key`` exists; False at the deadline or once ``stop`` is set.

        Each c10d ``wait`` that times out logs two warnings, so the wait is re-armed every
        ``slice_s`` (noticing ``stop`` then) only where ``stop`` can come before the deadline;
        ``slice_s=None``: one ``wait`` until the deadline.
        """
        while not stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._lock:
                shared = self._keys.get(key)
                lead = shared is None
                if lead:
                    shared = self._keys[key] = [threading.Event(), False]
            if not lead:
                shared[0].wait(min(left, WAIT_SLICE_S))  # a caller checks stop at least this often
                if shared[1]:
                    return True
                continue
            try:
                shared[1] = self._wait_once(key, left if slice_s is None else min(left, slice_s))
            finally:
                with self._lock:
                    del self._keys[key]
                shared[0].set()
            if shared[1]:
                return True
        return False
