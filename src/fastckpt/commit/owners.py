"""Which Checkpointer of this process has each group open, per rank: the files of a group are
saved through one Checkpointer.

Two Checkpointers of one process saving into one group on one rank (an actor's and a critic's)
would make two attempts at it, each blind to the other's files: the commit that publishes last
names only its own files, and the other's are dropped from the group (or deleted, when the
commits run one after the other). ``Coordinator.begin`` claims the group (by its home's URL, its
folder's symbolic links resolved: ``/ckpt/g`` and ``/lustre/me/ckpt/g`` are one group) for its
Checkpointer, and a second one that saves into it or commits it while the first holds it raises
``ConfigError``. A claim lasts while its holder holds the group: from the first save of an attempt
to the end of its commit (or its abort, or ``close``); it needs no release call.
Checkpointers of different ranks in one process (simulated ranks) each hold their own part.
"""

from __future__ import annotations

import gc
import itertools
import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from ..errors import ConfigError
from ..urls import resolved

_lock = threading.Lock()
_holders: dict[tuple[str, int], tuple[weakref.ref[Holder], str]] = {}  # (home, rank) -> (its holder, group)
_numbers = itertools.count(1)


class Holder(Protocol):
    """A Checkpointer's side of its claims (its ``Coordinator``)."""

    label: str  # how the error names it (``label()``)

    def holds(self, group: str) -> bool:
        """An attempt at ``group`` is open, or its commit in flight (called under ``claim``'s lock:
        it must not wait for a thread that may be claiming)."""


class Pending:
    """The groups a holder holds outside its records of attempts: from its claim until the attempt
    is open (``begin`` reads the group's manifest in between: a GET, for a URL), and from the
    attempt's leaving the open ones until its commit is in flight. Without them ``holds`` was
    False there, and a second Checkpointer's claim swept the first one's away. Marks nest
    (``commit`` begins the attempt of a rank that saved nothing into it).

    Args:
        lock: the holder's lock, which ``holds`` takes (and reads ``group in pending`` under).
    """

    def __init__(self, lock: threading.Lock) -> None:
        self._lock, self._marks = lock, Counter[str]()

    @contextmanager
    def marked(self, group: str) -> Iterator[None]:
        with self._lock:
            self._marks[group] += 1
        try:
            yield
        finally:
            with self._lock:
                self._marks[group] -= 1
                if not self._marks[group]:
                    del self._marks[group]

    def __contains__(self, group: object) -> bool:
        return group in self._marks


def label() -> str:
    """The name of the next Checkpointer made in this process: they are numbered as they are made."""
    return f"Checkpointer #{next(_numbers)} of this process"


def claim(home: str, rank: int, group: str, holder: Holder) -> None:
    """``holder`` begins an attempt at ``group`` (its home at ``home``) on ``rank``; the claims of
    groups their holders no longer hold go.

    A Checkpointer dropped without ``close()`` (an exception before its commit, a notebook cell run
    again) is unreachable but lives on, with its claims, until the cyclic garbage collector finds
    it: a conflict collects once and looks again before it is refused.

    Raises:
        ConfigError: another Checkpointer of this process holds the group on the same rank.
    """
    home = resolved(home)  # one key for every spelling of the group's folder
    other = _claim(home, rank, group, holder)
    if other is not None:
        gc.collect()
        other = _claim(home, rank, group, holder)
    if other is not None:
        raise ConfigError(
            f"checkpoint group {group}: {holder.label} saves into it (or commits it) on rank {rank} while "
            f"{other} has it open there (an attempt not committed yet, or its commit in flight). Two "
            "attempts at one group drop each other's files: the commit that publishes last names only its own. "
            "Save a group's files through one Checkpointer, or use separate tags/directories (one group per "
            "Checkpointer); a Checkpointer left over from an earlier try: close() it, or make each one with "
            "`with Checkpointer(...)`, which closes it however the block ends")


def _claim(home: str, rank: int, group: str, holder: Holder) -> str | None:
    """Claims the group for ``holder`` and returns None, or returns the label of the other holder
    that has it (its label only: a reference would keep it from the garbage collector)."""
    with _lock:
        for key, (ref, g) in list(_holders.items()):
            if (h := ref()) is None or not h.holds(g):
                del _holders[key]
        other = _holders.get((home, rank), (lambda: None, ""))[0]()
        if other is not None and other is not holder:
            return other.label
        _holders[(home, rank)] = (weakref.ref(holder), group)
        return None


def release(holder: Holder) -> None:
    """``holder``'s claims end now, whatever it holds: its process is taken as dead (``testing.as_if_killed``)."""
    with _lock:
        for key in [k for k, (ref, _) in _holders.items() if ref() is holder]:
            del _holders[key]
