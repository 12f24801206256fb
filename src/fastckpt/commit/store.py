"""Group commits through torch.distributed's key-value store: O(W) store operations, no polling.

Every rank of one attempt at a group uses the same keys, under
``fastckpt/<session>/<group hash>/<attempt>/`` (``StoreLink.channel``):

  ``files``    each rank appends one JSON line: its durable files and their checksums
  ``count``    each rank adds 1 after appending; the rank that brings it to W sets ``ready``
  ``ready``    rank 0 waits on it (a blocking ``wait``, one operation however long it takes)
  ``claim``    ``compare_set`` from "" decides, once, whether rank 0 publishes, or the attempt
               ended without it: ``remove``, a failed save, a rank that gave up waiting
  ``outcome``  rank 0 (or the remover) says how the attempt ended; the other ranks wait on it
  ``seen``     each other rank adds 1 after reading the outcome; the last one deletes the keys

So one commit costs about 5 operations per rank, and rank 0 reads every announcement with a
single ``get``. Rank 0 deletes ``files``, ``count`` and ``ready`` once it has read them, the
last rank to learn the outcome deletes the rest: a run of thousands of checkpoints leaves
nothing behind. An attempt that fails because a rank died leaves ``claim``, ``outcome`` and
``seen`` (a few bytes, under a session nothing uses again) until the store goes away.

Every call here is safe from any thread and none is a collective. A blocking ``wait`` holds
its client connection for as long as it waits, so waits run on clones of the store
(``Store.clone``, kept for reuse; ``waits.py``), never on the connection the training thread or
the process group uses.

Attempt numbers are each rank's own count of its attempts at a group within a session (the
step each rank announces tells whether the ranks' commits are of one save: ``pairing.py``). A
session is one Checkpointer's group commits: a number no earlier Checkpointer of the store got,
chosen by rank 0 and learnt by the others from rank 0 itself at their first multi-rank commit
(``session.py``, which says why a number each rank derives on its own goes wrong on a store
that outlives a launch): Checkpointers made later never reuse a failed attempt's keys, and a
dead launch's keys never mislead a live rank."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable

from ..errors import CommitTimeoutError, FastCkptError
from .session import Session, group_digest
from .waits import WAIT_SLICE_S, Waits, store_errors

PUBLISHED, SUPERSEDED, FAILED, REMOVED = "published", "superseded", "failed", "removed"
_ABSENT, ABORTED = "\x00absent", "aborted"  # ``_peek``'s expected value (never stored); a rank's save failed


def default_store() -> object | None:
    """The default process group's store, or None when torch.distributed is not initialised."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        return dist.distributed_c10d._get_default_store()
    except (ImportError, RuntimeError, AttributeError):
        return None


class StoreError(FastCkptError, RuntimeError):
    """The store stopped answering (the process that hosts it ended)."""


class StoreLink:
    """One Checkpointer's use of a store for group commits (thread-safe).

    Args:
        store: a ``torch.distributed.Store`` shared by every rank (TCPStore, or the default
            process group's store).
        rank: this rank.
        world_size: the number of ranks.
        slice_s: how often a blocking wait is re-armed to notice ``stop``; None: never (nothing
            sets ``stop`` while a wait may still succeed).
    """

    def __init__(self, store: object, rank: int, world_size: int, slice_s: float | None = WAIT_SLICE_S) -> None:
        self.store, self.rank, self.world, self.slice_s, self.waits = store, rank, world_size, slice_s, Waits.of(store)
        self.agreed = Session(store, self.waits, rank, world_size, slice_s)

    def session(self) -> int:
        """The session agreed with rank 0 (``session.py``); ``join`` first."""
        number = self.agreed.number
        if number is None:
            raise FastCkptError("fastckpt: a group commit used the store before its ranks agreed on a session "
                                "(a bug in fastckpt: please report it)")
        return number

    def channel(self, group: str, attempt: int) -> Channel:
        """The keys of this rank's ``attempt``-th attempt at ``group`` (a normalised name); no
        store call until the session is agreed (``Channel.join``)."""
        return Channel(self, group, attempt)


class Links:
    """A Checkpointer's ``StoreLink`` (made again when the store, rank or world changes) and its count
    of attempts at each group (training thread).

    Args:
        store: the store given (None: the default process group's, if any, looked up each time).
        slice_s: as ``StoreLink``'s.
    """

    def __init__(self, store: object | None, slice_s: float | None) -> None:
        self._store, self._slice_s = store, slice_s
        self._link: StoreLink | None = None
        self._counts: dict[str, itertools.count] = {}

    def agreed(self, rank: int, world: int) -> bool:
        """Whether this rank agreed a store session as ``rank`` of ``world`` (no store call)."""
        link = self._link
        return link is not None and (link.rank, link.world) == (rank, world) and link.agreed.complete

    def channel(self, group: str, rank: int, world: int) -> Channel | None:
        """This rank's next attempt's keys (None: no store, or one rank); no store call (``session.py``)."""
        store = self._store if self._store is not None else default_store()
        if store is None or world < 2:
            return None
        link = self._link
        if link is None or link.store is not store or link.world != world or link.rank != rank:
            link = self._link = StoreLink(store, rank, world, self._slice_s)
        return link.channel(group, next(self._counts.setdefault(group, itertools.count())))


class Channel:
    """One attempt's keys, and the operations on them; counts the operations and bytes it used
    (``ops``, ``nbytes``) for the commit event.

    Order of calls, all on the committer thread: ``join`` (agree on the session with rank 0, at
    once after the first commit); every rank ``announce``; rank 0 ``gather`` -> ``claim`` ->
    ``tell``; other ranks ``hear``. ``cancel`` (``remove()``, any rank, any time) and ``abort``
    (a rank whose save failed, instead of ``announce``) end the attempt; they too come after
    ``join``.
    """

    def __init__(self, link: StoreLink, group: str, attempt: int) -> None:
        self._link, self.group, self.attempt, self._digest = link, group, attempt, group_digest(group)
        link.agreed.serves(self._digest)  # made when this rank begins the group
        self.ops = self.nbytes = 0
        self.keys: set[str] = set()

    @property
    def joined(self) -> bool:
        """Whether this rank knows the session: the keys are known."""
        return self._link.agreed.number is not None

    @property
    def agreed(self) -> bool:
        """Whether this rank needs no store call to agree (rank 0: every rank joined)."""
        return self._link.agreed.complete

    def join(self, deadline: float, stop: threading.Event, poll: bool = False) -> bool:
        """Agree on the session with rank 0 (``session.py``); whether it is known now (False:
        ``stop``, or rank 0 ran out of time waiting for the others).

        Raises:
            CommitTimeoutError: a rank other than 0 that rank 0 did not answer by ``deadline``.
        """
        agreed, before = self._link.agreed, self._link.agreed.ops
        try:
            agreed.join(deadline, stop, self.group, poll, self._digest)
        except store_errors()[1] as exc:
            raise self._stopped(exc) from exc
        finally:
            self.ops += agreed.ops - before
        return self.joined

    @property
    def prefix(self) -> str:
        return f"fastckpt/{self._link.session()}/{self._digest}/{self.attempt}/"

    @property
    def token(self) -> str:
        """The attempt's id (in its manifest and markers): session and attempt number."""
        return f"{self._link.session()}.{self.attempt}"

    def _stopped(self, exc: BaseException) -> StoreError:
        return StoreError(f"checkpoint group {self.group}: the torch.distributed store stopped answering "
                          f"({exc}); the process that hosts it (rank 0's agent) probably ended. The group "
                          "stays incomplete.")

    def _op(self, name: str, fn: Callable[[], object], nbytes: int = 0) -> object:
        self.ops += 1
        self.nbytes += nbytes + len(self.prefix) + len(name)
        self.keys.add(name)
        try:
            return fn()
        except store_errors()[1] as exc:
            raise self._stopped(exc) from exc

    def _k(self, name: str) -> str:
        return self.prefix + name

    def announce(self, rank: int, entry: dict) -> None:
        """Every rank, once its files are durable: add its entry (a JSON line) to ``files``."""
        line = json.dumps(dict(entry, rank=rank), sort_keys=True, separators=(",", ":")) + "\n"
        store = self._link.store
        self._op("files", lambda: store.append(self._k("files"), line), len(line))
        if int(self._op("count", lambda: store.add(self._k("count"), 1))) == self._link.world:
            self._op("ready", lambda: store.set(self._k("ready"), "1"), 1)

    def _wait(self, name: str, deadline: float, stop: threading.Event) -> bool:
        """Block until the key exists; False at the deadline or on close. (``cancel`` wakes a
        waiter by setting the key it waits for.)"""
        return bool(self._op(name, lambda: self._link.waits.wait(self._k(name), deadline, stop, self._link.slice_s)))

    def entries(self) -> dict[int, dict]:
        """Every entry announced so far (rank -> entry)."""
        raw = self._peek("files") or b""
        self.nbytes += len(raw)  # type: ignore[arg-type]
        out: dict[int, dict] = {}
        for line in bytes(raw).decode().splitlines():  # type: ignore[arg-type]
            entry = json.loads(line)
            out[int(entry["rank"])] = entry
        return out

    def _peek(self, name: str) -> bytes | None:
        """The key's value (None: none) in one call that never blocks, as ``get`` of a missing key does."""
        got = bytes(self._op(name, lambda: self._link.store.compare_set(self._k(name), _ABSENT, _ABSENT)))  # type: ignore[arg-type]
        return None if got == _ABSENT.encode() else got

    def gather(self, deadline: float, stop: threading.Event) -> dict[int, dict] | None:
        """Rank 0: every rank's entry once all W announced (or ``cancel`` woke it); None at ``deadline``."""
        return self.entries() if self._wait("ready", deadline, stop) else None

    def claim(self, who: str) -> str:
        """Decide, once, who ends this attempt; returns the winner (``who`` if it was first)."""
        store = self._link.store
        return bytes(self._op("claim", lambda: store.compare_set(self._k("claim"), "", who), len(who))).decode()  # type: ignore[arg-type]

    def tell(self, outcome: str | None) -> None:
        """Rank 0: announce the outcome (None: a remover already did) and drop the keys only
        rank 0 reads."""
        store, again = self._link.store, self._link.waits.again  # the others wait on what it sets: a connection
        if outcome is not None:  # reset under it (the store lives on) must not leave them to time out
            self._op("outcome", lambda: again(store, lambda s: s.set(self._k("outcome"), outcome)), len(outcome))
        for name in ("files", "count", "ready"):
            self._op(name, lambda name=name: again(store, lambda s: s.delete_key(self._k(name))))

    def hear(self, deadline: float, stop: threading.Event, label: str, timeout_s: float) -> str:
        """Other ranks: the outcome rank 0 announced; the last rank to hear it deletes the keys.

        Raises:
            CommitTimeoutError: rank 0 announced nothing in time.
        """
        if not self._wait("outcome", deadline, stop):
            raise CommitTimeoutError(
                f"checkpoint group {label}: rank 0 did not publish the group within {timeout_s:.0f} s; some rank "
                "did not commit (see rank 0's error).")
        store = self._link.store
        said = bytes(self._op("outcome", lambda: store.get(self._k("outcome")))).decode()  # type: ignore[arg-type]
        self.nbytes += len(said)
        if int(self._op("seen", lambda: store.add(self._k("seen"), 1))) == self._link.world - 1:
            for name in ("claim", "outcome", "seen"):
                self._op(name, lambda name=name: store.delete_key(self._k(name)))
        return said

    def remade(self) -> str:
        """Rank 0, its commit failed for want of ranks: a note when a Checkpointer was made again (``session.py``)."""
        return self._link.agreed.remade(self._digest)

    def removed(self) -> bool:
        """Whether ``remove()`` cancelled this attempt (on any rank)."""
        return self.joined and (self._peek("claim") or b"").decode().startswith(REMOVED)

    def abort(self, rank: int, why: str) -> bool:
        """A rank whose save into the group failed: end the attempt on every rank now (rank 0
        and the others would otherwise wait ``commit_timeout_s`` for its announcement). Returns
        whether it ended it (False: rank 0 or a remover already had)."""
        return self.end(f"{ABORTED}:rank {rank}: {why}")

    def cancel(self, why: str) -> bool:
        """``remove()`` of the group: end the attempt on every rank unless rank 0 already claimed
        it (then it completes, and the caller waits for it). Returns whether it was cancelled."""
        return self.end(f"{REMOVED}:{why}")

    def give_up(self, why: str) -> bool:
        """Another rank that waited for the outcome in vain: end the attempt on every rank, so
        that rank 0 never publishes what this rank reports not committed. False: rank 0 claimed
        it first (it is publishing; its outcome follows), or another rank or a remover ended it."""
        return self.end(f"{FAILED}:{why}")

    def end(self, who: str) -> bool:
        """End the attempt on every rank with the outcome ``who`` unless another ended it first."""
        if self.claim(who) != who:
            return False
        self._op("outcome", lambda: self._link.store.set(self._k("outcome"), who), len(who))
        self._op("ready", lambda: self._link.store.set(self._k("ready"), "1"), 1)  # wakes rank 0
        return True
