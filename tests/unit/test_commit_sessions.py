"""The store session group commits use is agreed through rank 0 (``commit/session.py``).

Every "rank" is a Checkpointer (or a ``Session``) in this process around one real TCPStore that
outlives them, as torchrun's agent store outlives a restart: a dead launch's keys stay. The
real restart is ``tests/integration/test_group_restart.py``.
"""

from __future__ import annotations

import datetime
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.commit import protocol as P
from fastckpt.commit import session as SS
from fastckpt.commit import store as S
from fastckpt.errors import CheckpointWriteError, CommitTimeoutError
from fastckpt.testing import Fault, FaultyOps
from fastckpt.urls import normalize
from tests.helpers import close_all, place

QUICK_S = 15.0  # a commit that agrees takes well under a second; one that does not, commit_timeout_s


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    yield dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))


def _ck(rank: int, store: object, world: int = 2, **kw: object) -> fastckpt.Checkpointer:
    kw.setdefault("commit_timeout_s", 60)
    return fastckpt.Checkpointer(rank=rank, world_size=world, store=store, io_threads=1, overhead_budget=0.99, **kw)


def _state(step: int, rank: int) -> dict:
    return {"w": torch.arange(32, dtype=torch.int64) + 1000 * step + rank, "step": step, "rank": rank}


def _commit_all(cks: list[fastckpt.Checkpointer], group: Path, step: int) -> None:
    """Every rank saves its file into ``group`` and commits; all must complete well within the
    commit timeout (60 s)."""
    t0 = time.monotonic()
    handles = []
    for ck in cks:
        ck.save(_state(step, ck.rank), str(group / f"r{ck.rank}.pt"), group=str(group))
        handles.append(ck.commit(str(group), step=step))
    for h in handles:
        h.wait(60)
    assert time.monotonic() - t0 < QUICK_S
    assert P.read_group_manifest(place(str(group)))["ranks"] == list(range(len(cks)))


# A test's blocking wait runs on a clone of the store: a wait holds its connection, which the
# Checkpointers' own calls share.


def _asks(group: Path, world: int = 2) -> str:
    """The store key under which the other ranks ask rank 0 for the session at a commit of ``group``."""
    return f"fastckpt/session/{world}/{SS.group_digest(normalize(str(group)))}/asks"


def _session_keys(s: dist.TCPStore) -> list[str]:
    """Keys of the agreement that should be gone once every rank joined (answers, joins)."""
    return sorted(k for k in s.list_keys() if k.startswith("fastckpt/session/")
                  and ("/answer/" in k or k.endswith("/joined")))


def test_a_launch_that_lost_a_rank_before_its_checkpointer_leaves_nothing_stale(tmp_path: Path,
                                                                                  store: dist.TCPStore) -> None:
    # The dead launch: rank 0's Checkpointer was made and committed; rank 1 died before making
    # one (it left only an ask, as a rank killed while it waited for rank 0's answer would).
    dead0 = _ck(0, store, commit_timeout_s=0.5)
    dead0.save(_state(1, 0), str(tmp_path / "step1" / "r0.pt"), group=str(tmp_path / "step1"))
    with pytest.raises(CommitTimeoutError, match=r"ranks \[1\] of 2 did not commit"):
        dead0.commit(str(tmp_path / "step1")).wait(60)
    dead0.close()
    store.append(_asks(tmp_path / "step2"), "1 0123456789abcdef0123456789abcdef\n")
    cks = [_ck(r, store) for r in (0, 1)]  # the next launch, on the same store
    try:
        _commit_all(cks, tmp_path / "step2", 2)
        _commit_all(cks, tmp_path / "step3", 3)
    finally:
        close_all(cks)
    assert _session_keys(store) == []  # the dead rank's answer too: deleted once every rank joined


def test_rank_0_late_answers_the_ask_that_waited(tmp_path: Path, store: dist.TCPStore) -> None:
    cks = [_ck(r, store) for r in (0, 1)]
    g = tmp_path / "step1"
    try:
        cks[1].save(_state(1, 1), str(g / "r1.pt"), group=str(g))
        h1 = cks[1].commit(str(g))
        store.clone().wait([_asks(g)])  # rank 1 asked before rank 0 chose anything
        assert not store.check(["fastckpt/session/next"])
        cks[0].save(_state(1, 0), str(g / "r0.pt"), group=str(g))
        cks[0].commit(str(g)).wait(QUICK_S)
        h1.wait(QUICK_S)
    finally:
        close_all(cks)


def test_rank_1_late_is_answered_by_rank_0_waiting(tmp_path: Path, store: dist.TCPStore) -> None:
    cks = [_ck(r, store) for r in (0, 1)]
    g = tmp_path / "step1"
    try:
        cks[0].save(_state(1, 0), str(g / "r0.pt"), group=str(g))
        h0 = cks[0].commit(str(g))
        store.clone().wait(["fastckpt/session/next"])  # rank 0 chose, and waits for asks
        cks[1].save(_state(1, 1), str(g / "r1.pt"), group=str(g))
        cks[1].commit(str(g)).wait(QUICK_S)
        h0.wait(QUICK_S)
    finally:
        close_all(cks)


def test_extra_checkpointers_on_one_rank_change_nothing(tmp_path: Path, store: dist.TCPStore) -> None:
    # Rank 1 makes a Checkpointer for a single file (no group), and another whose group commit
    # rank 0 never joins: neither moves the session the real pair agrees on.
    extra = _ck(1, store)
    extra.save(_state(0, 1), str(tmp_path / "single" / "r1.pt")).wait(60)
    extra.close()
    lone = _ck(1, store, commit_timeout_s=0.5)
    lone.save(_state(0, 1), str(tmp_path / "lone" / "r1.pt"), group=str(tmp_path / "lone"))
    with pytest.raises(CommitTimeoutError, match="rank 0 did not answer"):
        lone.commit(str(tmp_path / "lone")).wait(60)
    lone.close()
    cks = [_ck(r, store) for r in (0, 1)]
    try:
        _commit_all(cks, tmp_path / "step1", 1)
    finally:
        close_all(cks)


def test_simulated_ranks_in_one_process_agree_generation_after_generation(tmp_path: Path,
                                                                         store: dist.TCPStore) -> None:
    # Three generations of 4 ranks (Checkpointers made again, as after a restart), each
    # committing twice; one generation's rank 2 is made and closed twice before its real one.
    for gen in range(3):
        if gen == 1:
            for _ in range(2):
                _ck(2, store, world=4).close()
        cks = [_ck(r, store, world=4) for r in (3, 1, 0, 2)]  # made in any order
        cks.sort(key=lambda ck: ck.rank)
        try:
            for step in (1, 2):
                _commit_all(cks, tmp_path / f"gen{gen}" / f"step{step}", step)
        finally:
            close_all(cks)
    assert _session_keys(store) == []


def test_sessions_of_one_store_never_repeat(store: dist.TCPStore) -> None:
    stop, got = threading.Event(), []
    for _ in range(3):
        waits = S.Waits.of(store)
        ranks = [SS.Session(store, waits, r, 3, None) for r in range(3)]
        threads = [threading.Thread(target=s.join, args=(time.monotonic() + 30, stop, "g")) for s in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(s.complete for s in ranks)
        assert len({s.number for s in ranks}) == 1
        got.append(ranks[0].number)
    assert len(set(got)) == 3


def test_close_does_not_wait_for_an_agreement_nobody_needs(tmp_path: Path, store: dist.TCPStore) -> None:
    # Rank 1's save failed; its commit raises at once and tells the others in the background,
    # which first needs the session: rank 0 never comes, and close() must not wait for it.
    ops = FaultyOps()
    ck = _ck(1, store, ops=ops, commit_timeout_s=600)
    g = tmp_path / "step1"
    ops.inject(Fault("pwrite", 28, path_contains="r1.pt"))
    h = ck.save(_state(1, 1), str(g / "r1.pt"), group=str(g))
    with pytest.raises(CheckpointWriteError):
        h.result(60)  # ended, still unseen: commit() raises it
    with pytest.raises(CheckpointWriteError, match="No space left"):
        ck.commit(str(g))
    t0 = time.monotonic()
    ck.close()
    assert time.monotonic() - t0 < 5


class _LateAsks:
    """The store, where the next ``n`` ``compare_set`` calls find one more ask appended just before
    (another rank asked while rank 0 answered the ones it had read)."""

    def __init__(self, store: dist.TCPStore, n: int) -> None:
        self._store, self._n, self._next = store, n, 100

    def compare_set(self, key: str, expected: str, value: str) -> bytes:
        if self._n:
            self._n -= 1
            self._next += 1
            self._store.append(key, f"2 late{self._next}\n")
        return self._store.compare_set(key, expected, value)

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)


def test_a_joined_rank_whose_ask_outlives_two_rounds_is_not_answered_again(store: dist.TCPStore) -> None:
    # Rank 1's ask stays in the list for two rounds (each round's clearing lost to a late ask);
    # it joined in between: answering it again would leave an answer nobody reads or deletes.
    racy, stop = _LateAsks(store, 2), threading.Event()
    rank0 = SS.Session(racy, S.Waits.of(store), 0, 3, None)
    rank0.number = int(store.add("fastckpt/session/next", 1))
    rank0._groups.add("")  # as join(group="") would: the asks of no particular group
    store.append("fastckpt/session/3/asks", "1 n1\n")
    rank0._answer()  # answers n1; the late ask keeps the list
    assert int(store.get("fastckpt/session/answer/n1")) == rank0.number
    store.delete_key("fastckpt/session/answer/n1")  # rank 1 read its answer and joined
    store.append(f"fastckpt/session/{rank0.number}/joined", "1 n1\n")
    rank0._answer()  # sees the join; the list is kept again
    rank0._answer()  # n1 is still listed
    assert not store.check(["fastckpt/session/answer/n1"])
    store.delete_key("fastckpt/session/answer/late102")  # rank 2 (the last late ask) joins
    store.append(f"fastckpt/session/{rank0.number}/joined", "2 late102\n")
    rank0._serve(time.monotonic() + 10, stop, poll=True)
    assert rank0.complete and _session_keys(store) == []


def test_two_checkpointers_per_rank_each_agree_with_their_own_rank_0(store: dist.TCPStore) -> None:
    # Two DeepSpeed engines (an actor and a critic), each with its own Checkpointer on the job's
    # one store. Both rank-1 Checkpointers ask before either rank 0 serves: each rank 0 must
    # answer only the asks of the groups it commits, or the critic's rank 1 learns the actor's
    # session and its commits wait under keys its rank 0 never uses.
    stop, waits = threading.Event(), S.Waits.of(store)
    actor, critic = (SS.group_digest(g) for g in ("/ckpt/actor/global_step5", "/ckpt/critic/global_step5"))
    r1 = {"actor": SS.Session(store, waits, 1, 2, None), "critic": SS.Session(store, waits, 1, 2, None)}
    asking = [threading.Thread(target=r1[name].join, args=(time.monotonic() + 30, stop, name),
                               kwargs={"group": digest}) for name, digest in (("critic", critic), ("actor", actor))]
    for t in asking:
        t.start()
    store.clone().wait([f"fastckpt/session/2/{d}/asks" for d in (actor, critic)])  # both asked
    r0 = {"actor": SS.Session(store, waits, 0, 2, None), "critic": SS.Session(store, waits, 0, 2, None)}
    r0["actor"].join(time.monotonic() + 30, stop, "actor", group=actor)  # serves first, with both asks listed
    r0["critic"].join(time.monotonic() + 30, stop, "critic", group=critic)
    for t in asking:
        t.join(60)
    assert r1["actor"].number == r0["actor"].number != r0["critic"].number == r1["critic"].number
    assert r0["actor"].complete and r0["critic"].complete
    assert _session_keys(store) == []
    assert store.get("fastckpt/session/2/servers") == b""  # each rank 0 took itself off the list


def test_two_checkpointers_per_rank_commit_their_own_groups(tmp_path: Path, store: dist.TCPStore) -> None:
    # The same through Checkpointers: both rank-1 Checkpointers ask (at their first commit) before
    # either rank 0 commits; then a second commit of each, on the agreed sessions.
    cks = {name: [_ck(r, store) for r in (0, 1)] for name in ("actor", "critic")}
    try:
        for step in (1, 2):
            groups = {name: tmp_path / name / f"step{step}" for name in cks}
            for name, (ck0, ck1) in cks.items():
                for ck in (ck0, ck1):
                    ck.save(_state(step, ck.rank), str(groups[name] / f"r{ck.rank}.pt"), group=str(groups[name]))
            handles = [cks[name][1].commit(str(groups[name]), step=step) for name in ("critic", "actor")]
            if step == 1:
                store.clone().wait([_asks(g) for g in groups.values()])
            handles += [cks[name][0].commit(str(groups[name]), step=step) for name in ("actor", "critic")]
            for h in handles:
                h.wait(QUICK_S)
    finally:
        close_all(cks["actor"] + cks["critic"])
    for name in cks:
        assert P.read_group_manifest(place(str(tmp_path / name / "step2")))["ranks"] == [0, 1]


def test_rank_0_answers_the_ask_of_a_group_it_began_but_commits_later(tmp_path: Path, store: dist.TCPStore) -> None:
    # Commits of different groups run on the committer pool: rank 0's commit of B may reach the
    # agreement before its commit of A (a slow save), while rank 1's first commit is A's. Rank 0
    # answers the asks of every group it began.
    cks = [_ck(r, store) for r in (0, 1)]
    a, b = tmp_path / "A", tmp_path / "B"
    try:
        for g in (a, b):
            for ck in cks:
                ck.save(_state(1, ck.rank), str(g / f"r{ck.rank}.pt"), group=str(g)).wait(60)
        late = [cks[1].commit(str(a))]
        store.clone().wait([_asks(a)])  # rank 1 asked at its commit of A
        for h in [cks[0].commit(str(b)), cks[1].commit(str(b))]:  # rank 0 agrees at its commit of B
            h.wait(QUICK_S)
        late.append(cks[0].commit(str(a)))
        for h in late:
            h.wait(QUICK_S)
    finally:
        close_all(cks)
    assert P.read_group_manifest(place(str(a)))["ranks"] == [0, 1]


class _Gated:
    """The store, where each ``check`` of a key containing ``part`` sets ``reached``; the first
    one then waits for ``go`` (when given) before it checks."""

    def __init__(self, store: dist.TCPStore, part: str, go: threading.Event | None = None) -> None:
        self._store, self._part, self._go = store, part, go
        self.reached = threading.Event()

    def check(self, keys: list[str]) -> bool:
        if any(self._part in k for k in keys):
            self.reached.set()
            go, self._go = self._go, None
            if go is not None:
                go.wait(30)
        return self._store.check(keys)

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)


def test_two_rank_0s_serving_at_once_never_take_each_others_wake_up(store: dist.TCPStore) -> None:
    # The actor's and the critic's rank 0 both serve. The critic's rank 1 asks just after the
    # critic's rank 0 read the asks, and wakes it; the actor's rank 0 runs a round in between.
    # With one shared bell the actor's round deleted the critic's ring, and the critic's rank 0
    # slept through the ask until both commits timed out.
    stop, waits = threading.Event(), S.Waits.of(store)
    actor, critic = (SS.group_digest(g) for g in ("/ckpt/actor/global_step5", "/ckpt/critic/global_step5"))
    a_store, b_go = _Gated(store, "/joined"), threading.Event()
    b_store = _Gated(store, "/joined", go=b_go)
    r0a, r0b = SS.Session(a_store, waits, 0, 2, None), SS.Session(b_store, waits, 0, 2, None)
    serving_a = threading.Thread(target=r0a.join, args=(time.monotonic() + 30, stop, "actor"),
                                 kwargs={"group": actor, "poll": True})
    serving_a.start()
    assert a_store.reached.wait(30)  # the actor's rank 0 ran its first round and waits for a ring
    a_store.reached.clear()
    serving_b = threading.Thread(target=r0b.join, args=(time.monotonic() + 10, stop, "critic"),
                                 kwargs={"group": critic})
    serving_b.start()
    assert b_store.reached.wait(30)  # the critic's rank 0 read the asks (none yet) and is held there
    r1_store = _Gated(store, "/answer/")
    r1 = SS.Session(r1_store, waits, 1, 2, None)
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            r1.join(time.monotonic() + 10, stop, "critic", poll=True, group=critic)
        except CommitTimeoutError as e:
            errors.append(e)

    asking = threading.Thread(target=ask)
    asking.start()
    try:
        assert r1_store.reached.wait(30)  # rank 1 asked, rang, and waits for its answer
        assert a_store.reached.wait(30)  # the ring woke the actor's rank 0 too: it ran a round
        b_go.set()  # the critic's rank 0 ends its round and waits for a ring
        asking.join(30)
        serving_b.join(30)
        assert errors == [] and r1.number == r0b.number and r0b.complete
    finally:
        b_go.set()
        stop.set()
        for t in (asking, serving_a, serving_b):
            t.join(30)
    assert _session_keys(store) == []


@pytest.mark.parametrize("seed", range(6))
def test_three_checkpointers_per_rank_commit_in_any_order(tmp_path: Path, seed: int) -> None:
    # Three engines on three ranks, each (engine, rank) a Checkpointer on the one store; every
    # step's saves and commits are issued in a shuffled order, so rank 0s serve while other
    # engines' ranks ask, and asks of one engine come in before its rank 0 began the group.
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    rnd = random.Random(seed)
    cks = {(e, r): _ck(r, store, world=3) for e in range(3) for r in range(3)}
    try:
        for step in (1, 2):
            order = list(cks)
            rnd.shuffle(order)
            for e, r in order:
                g = tmp_path / f"engine{e}" / f"step{step}"
                cks[(e, r)].save(_state(step, r), str(g / f"r{r}.pt"), group=str(g))
            rnd.shuffle(order)
            # Within commit_timeout_s (60 s): nine Checkpointers open their store connections at
            # once here, and a burst of TCPStore connections can stall for seconds on a resolver
            # that drops queries (seen in this sandbox: 5 s DNS timeouts inside clone()).
            for h in [cks[k].commit(str(tmp_path / f"engine{k[0]}" / f"step{step}"), step=step) for k in order]:
                h.wait(45)
            for e in range(3):
                assert P.read_group_manifest(place(str(tmp_path / f"engine{e}" / f"step{step}")))["ranks"] == [0, 1, 2]
    finally:
        close_all(list(cks.values()))
    assert _session_keys(store) == []
    assert store.get("fastckpt/session/3/servers") == b""
