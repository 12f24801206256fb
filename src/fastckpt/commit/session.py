"""Which store session a Checkpointer's group commits use: rank 0 chooses it, the others ask rank 0.

A group commit's keys live under ``fastckpt/<session>/`` (``store.py``) and attempts are counted
per Checkpointer, so every Checkpointer needs a session no earlier one used, and all ranks of a
job the same one. The store can outlive the processes: torchrun's agent store keeps its keys
across ``--max-restarts`` restarts, a user's TCPStore lives as long as they keep it. So any value
a rank reads there may have been left by a launch that is dead, and a session each rank derives
on its own (a shared counter every rank adds to) is off for good once one rank of some launch
died before it counted: the ranks of every later launch then wait under different keys, and no
group commit completes again.

The agreement (keys under ``fastckpt/session/``; ``W`` is the world size), made at the
Checkpointer's first multi-rank commit, on the committer thread, through plain store calls (no
collective, nothing on the training thread, nothing when the Checkpointer is made):

  rank 0   ``S = add("next", 1)``: a number no earlier Checkpointer got. It lists itself in
           ``W/servers`` (a line with a nonce of its own; the line goes once every rank joined).
           Then, until every other rank has joined S: read ``W/<group>/asks`` (a line ``rank
           nonce`` per asking rank) of each group this Checkpointer began, set ``answer/<nonce>``
           to S for each line, drop the lines answered (``compare_set``), read ``S/joined``;
           between rounds, one blocking wait on its own bell ``W/bell/<its nonce>``.
  rank r   append ``r nonce`` (a nonce of this Checkpointer's own) to ``W/<group>/asks`` (the
           group it commits), then ring the bell of every rank 0 listed in ``W/servers``; wait
           for ``answer/<nonce>``, read S, delete it; append ``r nonce`` to ``S/joined`` and ring
           the listed bells again.

A rank never reads a value that could be stale: it waits for the answer to its own nonce, which
only a live rank 0 gives, however early it looks. Asks left by dead launches are answered too
(harmless: nobody reads those answers, and rank 0 deletes them once every rank joined). Rank 0
serves at each commit, under the commit's own deadline, until every rank has joined; a rank
that rank 0 does not answer in time fails its commit with an error that says so. No ring is
lost: a rank 0 lists itself before its first round, so a rank that read the list without it
appended its ask before that round read the asks; and only its own serving deletes its bell.
A rank 0 that died while it served stays listed: later launches ring its bell too, one ``set``
per asking rank and dead rank 0 (a ring after a rank 0 took itself off may leave its bell set).

Asks are filed under the group being committed (its digest), and rank 0 answers only those of
the groups it began (saved into; its commits of them may reach the agreement in any order): a
job with two Checkpointers on one store (two DeepSpeed engines, an actor and a critic, each with
its own) agrees twice, each rank's Checkpointer with the rank-0 one that saves the same groups.
Each rank 0 has a bell of its own, so two of them serving at once never take each other's ring
(a shared bell did: one deleted the ring meant for the other, whose commit then timed out).
Every rank must commit the same groups.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
import weakref

from ..errors import CommitTimeoutError

POLL_S = 0.2  # how often a wait that close() must be able to end at once polls the store
# store -> the (rank, world) of this process's Checkpointers that agreed a session through it (``remade``)
_AGREED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_AGREED_LOCK = threading.Lock()


def group_digest(group: str) -> str:
    """The name of a group (normalised) in store keys: its commits' and its session asks'."""
    return hashlib.sha1(group.encode()).hexdigest()[:16]


class Session:
    """One Checkpointer's session of a store (thread-safe).

    Args:
        store: the store every rank reaches.
        waits: its blocking waits (``waits.Waits``).
        rank, world: this rank and the number of ranks.
        slice_s: how often a blocking wait is re-armed to notice ``stop``; None: never.
    """

    def __init__(self, store: object, waits: object, rank: int, world: int, slice_s: float | None) -> None:
        self._store, self._waits, self.rank, self.world, self._slice_s = store, waits, rank, world, slice_s
        self._turn = threading.Lock()  # held by the thread of this rank that asks or serves
        self._nonce = uuid.uuid4().hex
        self.number: int | None = None  # the session, once known
        self._joined: set[int] = set()  # rank 0: the ranks that joined
        self._answered: set[str] = set()  # rank 0: the nonces answered, their answers not yet read
        self._read: set[str] = set()  # rank 0: the nonces whose ranks read their answer and joined
        self._groups: set[str] = set()  # rank 0: the groups (digests) whose asks it answers (``serves``)
        self._listed = False  # rank 0: whether it is listed in ``W/servers`` (rings reach its bell)
        self._was_agreed = False  # whether a Checkpointer of this process agreed one as this rank before
        self.ops = 0  # store operations made, for the commit event that made them

    def serves(self, group: str) -> None:
        """Rank 0: answer the asks filed under ``group`` (a digest) too: this Checkpointer began it."""
        if self.rank == 0:
            self._groups.add(group)

    @property
    def complete(self) -> bool:
        """Whether this rank needs no more store calls to agree (rank 0: every rank joined)."""
        return self.number is not None and (self.rank != 0 or len(self._joined) >= self.world - 1)

    def _k(self, name: str) -> str:
        return f"fastckpt/session/{name}"

    def _op(self, fn: object, *args: object) -> object:
        self.ops += 1
        return fn(*args)  # type: ignore[operator]

    def join(self, deadline: float, stop: threading.Event, label: str, poll: bool = False, group: str = "") -> None:
        """Agree on the session (at once when done already), for a commit of ``group`` (its digest;
        ``label`` names it in messages). ``poll``: wait by polling the store every ``POLL_S``, so
        that ``stop`` ends the wait at once (work close() does not wait for). One thread of this
        rank asks or serves at a time; the others wait for its turn to end.

        Raises:
            CommitTimeoutError: another rank, and rank 0 did not answer by ``deadline``. (Rank 0
                returns at the deadline however many ranks joined: the commit then names them.)
        """
        t0 = time.monotonic()
        self.serves(group)
        while not self.complete:
            if self._turn.acquire(timeout=POLL_S):
                try:
                    if self.complete:
                        return
                    if self.rank != 0:
                        self._ask(deadline, stop, label, poll, group)
                        return
                    if self.number is None:
                        self.number = int(self._op(self._store.add, self._k("next"), 1))  # type: ignore[attr-defined]
                        self._note_agreed()
                    self._serve(deadline, stop, poll)
                    return
                finally:
                    self._turn.release()
            if stop.is_set() or time.monotonic() >= deadline:
                if self.rank != 0 and not stop.is_set():
                    raise self._unanswered(label, time.monotonic() - t0)
                return

    def _unanswered(self, label: str, waited_s: float) -> CommitTimeoutError:
        return CommitTimeoutError(
            f"checkpoint group {label}: rank {self.rank} asked rank 0 which session of the store this job's group "
            f"commits use, and rank 0 did not answer within {waited_s:.0f} s: it has not reached its commit of a "
            "group through this store, or it died. Every rank must save and commit the same groups (check "
            f"rank 0's logs), or raise commit_timeout_s.{self.remade('')}")

    def _wait(self, key: str, deadline: float, stop: threading.Event, poll: bool) -> bool:
        self.ops += 1
        if not poll:
            return bool(self._waits.wait(key, deadline, stop, self._slice_s))  # type: ignore[attr-defined]
        while not stop.is_set() and time.monotonic() < deadline:
            if self._store.check([key]):  # type: ignore[attr-defined]
                return True
            stop.wait(min(POLL_S, max(0.0, deadline - time.monotonic())))
        return False

    def _serve(self, deadline: float, stop: threading.Event, poll: bool) -> None:
        """Rank 0: answer every ask until each other rank joined, the deadline or ``stop``."""
        store, bell = self._store, self._bell(self._nonce)
        if not self._listed:
            self._op(store.append, self._in("", "servers"), f"{self._nonce}\n")  # type: ignore[attr-defined]
            self._listed = True
        while True:
            self._op(store.delete_key, bell)  # type: ignore[attr-defined]
            self._answer()
            if self.complete:
                self._tidy()
                return
            if not self._wait(bell, deadline, stop, poll):
                return

    def _in(self, group: str, name: str) -> str:
        """The agreement's key ``name`` for commits of ``group`` (a digest; "": of no group)."""
        return self._k(f"{self.world}/{group}/{name}" if group else f"{self.world}/{name}")

    def _bell(self, nonce: str) -> str:
        """The bell of the rank 0 whose nonce is ``nonce``: set to wake it."""
        return self._in("", f"bell/{nonce}")

    def _ring(self) -> None:
        """Another rank: wake every rank 0 that serves (its own Checkpointer's among them)."""
        store, servers = self._store, self._in("", "servers")
        if self._op(store.check, [servers]):  # type: ignore[attr-defined]
            for nonce in bytes(self._op(store.get, servers)).decode().split():  # type: ignore[attr-defined]
                self._op(store.set, self._bell(nonce), "1")  # type: ignore[attr-defined]

    def _answer(self) -> None:
        store = self._store
        for asks in [self._in(g, "asks") for g in sorted(self._groups)]:  # sorted(): a copy made in C
            raw = bytes(self._op(store.get, asks)) if self._op(store.check, [asks]) else b""  # type: ignore[attr-defined]
            for line in raw.decode().splitlines():
                nonce = line.split()[1]
                if nonce not in self._answered and nonce not in self._read:  # its line may outlive a round
                    self._op(store.set, self._k(f"answer/{nonce}"), str(self.number))  # type: ignore[attr-defined]
                    self._answered.add(nonce)
            if raw:  # lines appended meanwhile keep it from matching: they are answered next round
                self._op(store.compare_set, asks, raw.decode(), "")  # type: ignore[attr-defined]
        joined = self._k(f"{self.number}/joined")
        if self._op(store.check, [joined]):  # type: ignore[attr-defined]
            for line in bytes(self._op(store.get, joined)).decode().splitlines():  # type: ignore[attr-defined]
                rank, nonce = line.split()
                self._joined.add(int(rank))
                self._answered.discard(nonce)  # read its answer: the rank deleted it
                self._read.add(nonce)  # never answered again, though its ask may still be listed

    def _tidy(self) -> None:
        """Every rank joined: delete the answers nobody will read (asks of dead launches)."""
        store = self._store
        for nonce in self._answered:
            self._op(store.delete_key, self._k(f"answer/{nonce}"))  # type: ignore[attr-defined]
        self._answered.clear()
        self._op(store.delete_key, self._k(f"{self.number}/joined"))  # type: ignore[attr-defined]
        self._unlist()

    def _unlist(self) -> None:
        """Every rank joined: take this rank 0 off ``W/servers`` and delete its bell."""
        store, servers, line = self._store, self._in("", "servers"), f"{self._nonce}\n"
        for _ in range(100):  # another rank 0 may list or unlist itself meanwhile: read again
            raw = bytes(self._op(store.get, servers)).decode()  # type: ignore[attr-defined]
            rest = raw.replace(line, "")
            if rest == raw or bytes(self._op(store.compare_set, servers, raw, rest)).decode() == rest:  # type: ignore[attr-defined]
                break
        self._op(store.delete_key, self._bell(self._nonce))  # type: ignore[attr-defined]
        self._listed = False

    def _ask(self, deadline: float, stop: threading.Event, label: str, poll: bool, group: str) -> None:
        """Any other rank: ask rank 0, wait for the answer to this Checkpointer's nonce."""
        store, line = self._store, f"{self.rank} {self._nonce}\n"
        answer = self._k(f"answer/{self._nonce}")
        self._op(store.append, self._in(group, "asks"), line)  # type: ignore[attr-defined]
        self._ring()
        t0 = time.monotonic()
        if not self._wait(answer, deadline, stop, poll):
            if stop.is_set():
                return  # closing: the caller finds the session unknown
            raise self._unanswered(label, time.monotonic() - t0)
        number = int(bytes(self._op(store.get, answer)).decode())  # type: ignore[attr-defined]
        self._op(store.delete_key, answer)  # type: ignore[attr-defined]
        self._op(store.append, self._k(f"{number}/joined"), line)  # type: ignore[attr-defined]
        self._ring()
        self.number = number
        self._note_agreed()

    def _note_agreed(self) -> None:
        """Remember that a Checkpointer of this process agreed a session as this rank: one made again
        later on this rank alone never pairs with the others' (``remade``)."""
        with _AGREED_LOCK:
            self._was_agreed = (self.rank, self.world) in _AGREED.setdefault(self._store, set())
            _AGREED[self._store].add((self.rank, self.world))

    def remade(self, group: str) -> str:
        """Why a commit of ``group`` (a digest) that failed for want of the other ranks may have: this
        rank's Checkpointer was made again (after an earlier one of this process had agreed a session as
        this rank) and the other ranks' were not, or the other way round (rank 0: asks filed under the
        group after every rank joined). Each Checkpointer numbers its commits anew, so its commits never
        meet the others'. Store calls only on rank 0, on this failure path; "" when nothing says so."""
        late: list[int] = []
        if self.rank == 0 and self.complete:
            asks = self._in(group, "asks")
            if self._store.check([asks]):  # type: ignore[attr-defined]
                late = sorted({int(line.split()[0]) for line in bytes(self._store.get(asks)).decode().splitlines()})  # type: ignore[attr-defined]
        with _AGREED_LOCK:
            before = (self.rank, self.world) in _AGREED.get(self._store, ())
            again = self._was_agreed or (self.number is None and before)
        if not late and not again:
            return ""
        who = f"ranks {late} asked for a new store session after every rank had agreed one: their" if late else \
            f"an earlier Checkpointer of this process agreed a store session as rank {self.rank}: if this rank's"
        return (f" ({who} Checkpointer was made again (close() and a new one) on some ranks only, its commits, counted "
                "anew, never meet the other ranks'. Make the Checkpointer again on every rank, rank 0 too, or keep the "
                "first one on every rank.)")
