"""A run rebuilt from its events: phases per save, durable times, overhead replay, pending."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.commit import protocol as P
from fastckpt.eventlog import read_events
from fastckpt.events import Event
from fastckpt.runstate import RunState
from fastckpt.testing import Fault, FaultyOps


def _ev(name: str, start: float, end: float, path: str = "/h/a.pt", rank: int = 0, tier: str = "nvme",
        nbytes: int = 100, **kw: object) -> Event:
    return Event(name, rank, path, nbytes, start, end, tier, **kw)


def _nvme_save(path: str, t: float, blocked: float = 0.1, replicated: bool = True) -> list[Event]:
    local = "/bb" + path
    evs = [_ev("snapshot", t, t + blocked, path), _ev("write", t + blocked, t + 1, local),
           _ev("commit", t + 1, t + 1.1, local), _ev("queued", t + 1.1, t + 1.1, path)]
    return evs + ([_ev("replicate", t + 1.2, t + 2, path)] if replicated else [])


def test_phases_durable_and_lag_of_a_burst_buffer_save() -> None:
    rs = RunState()
    for e in _nvme_save("/h/a.pt", 10.0):
        rs.feed(e)
    (s,) = rs.saves()
    assert [p.name for p in s.phases] == ["snapshot", "write", "commit", "queued", "replicate"]
    assert s.bytes == 100 and s.blocked_s == pytest.approx(0.1)
    assert s.durable_s == pytest.approx(2.0)
    assert s.replication_lag_s == pytest.approx(0.9)
    (st,) = rs.status(20.0)
    assert st.pending == 0 and st.replication_lag_s == 0 and st.rpo_s == pytest.approx(10.0)


def test_direct_saves_are_durable_at_their_commit() -> None:
    rs = RunState()
    done = [rs.feed(e) for e in (_ev("snapshot", 1, 1.1, tier="direct"), _ev("write", 1.1, 1.5, tier="direct"),
                                 _ev("commit", 1.5, 1.6, tier="direct"))]
    assert done[:2] == [[], []] and done[2][0].durable_s == pytest.approx(0.6)
    assert rs.status(2.0)[0].rpo_s == pytest.approx(1.0)  # durable at its path, as the Checkpointer counts it


def _superseded(t: float, saved_at: float, path: str, by: str = "coalesce") -> Event:
    return _ev("superseded", t, t, path, detail=f"saved_at={saved_at!r} by={by}")


def test_pending_lag_and_coalesced_saves() -> None:
    """Coalescing dropped a's queued replication (its ``superseded`` event); b's was running on a
    second worker when c's ended. Before: c's replicate took every save queued before it without
    a replicate of its own as coalesced away, so the replay had b superseded and 0 pending while
    ``stats().pending`` counted b."""
    rs = RunState()
    a, b, c = (_nvme_save(f"/h/{n}.pt", t, replicated=False) for n, t in (("a", 0.0), ("b", 5.0), ("c", 10.0)))
    for e in a + b + c:
        rs.feed(e)
    (st,) = rs.status(12.0)
    assert st.pending == 3 and st.replication_pending == 3
    assert st.replication_lag_s == pytest.approx(12.0 - 1.1)
    rs.feed(_superseded(11.1, 0.0, "/h/a.pt"))
    rs.feed(_ev("replicate", 11.5, 12.5, "/h/c.pt"))
    (st,) = rs.status(13.0)
    assert (st.pending, st.replication_pending) == (1, 1)  # b, replicating: as stats() counts it
    assert st.replication_lag_s == pytest.approx(13.0 - 6.1)
    assert [s.superseded for s in rs.saves()] == [True, False, False]
    rs.feed(_ev("replicate", 12.5, 13.0, "/h/b.pt"))
    assert [s.durable_at is not None for s in rs.saves()] == [False, True, True]
    assert rs.status(14.0)[0].pending == 0


def test_a_log_without_superseded_events_keeps_another_paths_dropped_save_pending() -> None:
    """A log written before ``superseded`` events: a later replication of the same path means the
    older queued one was dropped (one path's uploads never overlap); one of another path proves
    nothing, so that save stays pending (docs/report.md)."""
    rs = RunState()
    for e in _nvme_save("/h/a.pt", 0.0, replicated=False) + _nvme_save("/h/a.pt", 5.0) \
            + _nvme_save("/h/b.pt", 10.0, replicated=False) + _nvme_save("/h/c.pt", 15.0):
        rs.feed(e)
    assert [(s.path, s.superseded, s.durable_at is not None) for s in rs.saves()] == [
        ("/h/a.pt", True, False), ("/h/a.pt", False, True), ("/h/b.pt", False, False), ("/h/c.pt", False, True)]
    assert rs.status(20.0)[0].pending == 1


def test_a_superseded_event_ends_the_save_it_names_among_others_to_its_path() -> None:
    """Three saves to one path: the first one's upload runs, the second is queued and dropped
    for the third. The event names the second by its call (``saved_at``), not the oldest open."""
    rs = RunState()
    s1, s2, s3 = (_nvme_save("/h/last.pt", t, replicated=False) for t in (0.0, 5.0, 10.0))
    for e in s1 + s2 + s3:
        rs.feed(e)
    rs.feed(_superseded(11.1, 5.0, "/h/last.pt", by="newer-save"))
    assert [s.superseded for s in rs.saves()] == [False, True, False]
    assert rs.status(12.0)[0].pending == 2  # the first one is still being copied, the third waits for it
    rs.feed(_superseded(12.0, 99.0, "/h/last.pt"))  # a save it does not know (before the log's start): ignored
    assert rs.status(12.0)[0].pending == 2


def test_a_replication_coalescing_dropped_ends_superseded_in_the_replay(tmp_path: Path) -> None:
    """One worker, ``replicate_policy='coalesce'``: a's upload is held while b and c are queued, and
    c drops b. The replay knows b from its ``superseded`` event (another path's replicate no longer
    stands for it) and agrees with the handles and ``stats()``."""
    ops, local, log = FaultyOps(), str(tmp_path / "nvme"), tmp_path / "events.jsonl"
    gate = ops.gate("preadv", path_contains="held.pt")
    queued = _Count("queued", 3)
    home = tmp_path / "home"
    with fastckpt.Checkpointer(local_dir=local, ops=ops, replicate_workers=1, sinks=(queued,),
                               event_log=str(log), overhead_budget=0.99) as ck:
        hs = [ck.save({"w": torch.zeros(256)}, str(home / "held.pt"))]
        assert gate.wait_entered(60)
        hs += [ck.save({"w": torch.ones(256)}, str(home / n)) for n in ("b.pt", "c.pt")]
        assert queued.reached.wait(60)
        gate.open()
        recs = [h.wait(60) for h in hs]
        assert ck.stats().pending == 0
    evs = read_events(str(log))
    assert [e.path for e in evs if e.name == "superseded"] == [str(home / "b.pt")]
    rs = RunState()
    for e in evs:
        rs.feed(e)
    assert [(s.superseded, s.durable_at is not None) for s in rs.saves()] == \
        [(r.superseded, r.durable_s is not None) for r in recs] == [(False, True), (True, False), (False, True)]
    assert rs.status(evs[-1].end + 1)[0].pending == 0


def test_saves_to_one_path_while_its_upload_is_held(tmp_path: Path) -> None:
    """Three saves to ``last.pt`` through a burst buffer; the first one's upload is held until the
    third is queued. The newer local copies supersede the first two, and only the third replicates.
    Before: the replicate event went to the oldest open save of the path (the first), so the log
    left two saves pending for good while ``stats()`` had none."""
    ops, local, log = FaultyOps(), str(tmp_path / "nvme"), tmp_path / "events.jsonl"
    gate = ops.gate("preadv", path_contains=local)
    queued = _Count("queued", 3)
    path = str(tmp_path / "home" / "last.pt")
    with fastckpt.Checkpointer(local_dir=local, ops=ops, replicate_workers=1, sinks=(queued,),
                               event_log=str(log), overhead_budget=0.99) as ck:
        hs = [ck.save({"w": torch.full((256,), 0.0)}, path)]
        assert gate.wait_entered(60)
        hs += [ck.save({"w": torch.full((256,), float(i))}, path) for i in (1, 2)]
        assert queued.reached.wait(60)
        gate.open()
        recs = [h.wait(60) for h in hs]
        assert ck.stats().pending == 0
    rs = RunState()
    for e in read_events(str(log)):
        rs.feed(e)
    assert [(s.superseded, s.durable_at is not None) for s in rs.saves()] == \
        [(r.superseded, r.durable_s is not None) for r in recs] == [(True, False), (True, False), (False, True)]
    (st,) = rs.status(e.end + 1)
    assert (st.pending, st.replication_pending) == (0, 0)


class _Count:
    """An event sink: ``reached`` is set at the ``n``-th event named ``name``."""

    def __init__(self, name: str, n: int) -> None:
        self.name, self.n, self.reached = name, n, threading.Event()

    def emit(self, ev: Event) -> None:
        if ev.name == self.name:
            self.n -= 1
            if self.n == 0:
                self.reached.set()


def test_overhead_replays_the_monitor_rule() -> None:
    rs = RunState(budget=0.02, window_s=1000.0)
    for t, blocked in ((0.0, 0.1), (10.0, 0.1), (20.0, 1.0), (100.0, 0.01), (1000.0, 0.01)):
        rs.feed(_ev("snapshot", t, t + blocked, f"/h/{t}.pt", tier="direct"))
    pts = rs.overhead_points(0)
    assert len(pts) == 4  # checked from the second save on
    assert pts[0].overhead == pytest.approx(0.2 / 10.1)
    assert [p.over_budget for p in pts] == [False, True, False, False]
    assert rs.alarms(0) == 1


def test_failures_close_the_save_and_ranks_stay_apart() -> None:
    rs = RunState()
    rs.feed(_ev("snapshot", 0, 0.1, rank=1))
    rs.feed(_ev("snapshot", 0, 0.1, rank=0))
    rs.feed(_ev("write", 0.1, 0.2, rank=1, error="OSError(28, 'No space left on device')"))
    saves = {s.rank: s for s in rs.saves()}
    assert saves[1].error.startswith("OSError") and saves[0].error is None
    assert [e.rank for e in rs.failures] == [1]
    assert {s.rank: s.pending for s in rs.status(1.0)} == {0: 1, 1: 0}


def test_url_saves_match_their_burst_buffer_copy() -> None:
    rs = RunState()
    url = "s3://bucket/run/a.pt"
    rs.feed(_ev("snapshot", 0, 0.1, url))
    rs.feed(_ev("commit", 0.2, 0.3, "/bb/s3/bucket/run/a.pt"))
    rs.feed(_ev("replicate", 0.4, 0.9, url))
    (s,) = rs.saves()
    assert s.bytes == 100 and s.durable_s == pytest.approx(0.9)


def test_the_alarm_is_the_last_saves_check_while_the_ratios_are_at_now() -> None:
    """The alarm gauge and the ratio gauges can disagree between saves: the HELP says so."""
    from fastckpt.metrics import FAMILIES

    rs = RunState(budget=0.02, window_s=100.0)
    for t in (0.0, 10.0):
        rs.feed(_ev("snapshot", t, t + 1.0, f"/h/{t}.pt", tier="direct"))
    late = rs.status(10_000.0)[0]
    assert late.over_budget and late.overhead < 0.02 and late.window_overhead < 0.02
    help_ = next(f.help for f in FAMILIES if f.name == "fastckpt_overhead_alarm")
    assert "last save" in help_ and "as of the scrape" in help_


def _direct_save(t: float, session: str, path: str = "/h/last.ckpt", rank: int = 0) -> list[Event]:
    return [_ev("snapshot", t, t + 0.1, path, rank, "direct", session=session),
            _ev("write", t + 0.1, t + 0.5, path, rank, "direct", session=session),
            _ev("commit", t + 0.5, t + 0.6, path, rank, "direct", session=session)]


def test_a_resumed_jobs_saves_are_not_matched_with_the_killed_jobs() -> None:
    """A job killed while writing last.ckpt, resumed with the same log: each new save is durable
    0.6 s after its own call (not after the killed save's), and the killed save is abandoned,
    not pending for ever. Rank 1's new session in the shared log does not touch rank 0's saves."""
    rs = RunState(budget=0.02, window_s=1000.0)
    killed = _direct_save(0.0, "a")[:2]  # snapshot and write: killed before its commit
    for e in killed + [_ev("snapshot", 1.0, 1.1, "/h/r1.pt", 1, "direct", session="c")]:
        rs.feed(e)
    assert {s.rank: s.pending for s in rs.status(2.0)} == {0: 1, 1: 1}  # both still running
    for t in (100.0, 110.0, 120.0):
        done = [rs.feed(e) for e in _direct_save(t, "b")]
        assert done[-1][0].durable_s == pytest.approx(0.6)
    assert {s.rank: s.pending for s in rs.status(130.0)} == {0: 0, 1: 1}
    saves = [s for s in rs.saves() if s.rank == 0]
    assert [(s.abandoned, s.durable_at is None) for s in saves] == [(True, True)] + [(False, False)] * 3
    assert [p.name for p in saves[0].phases] == ["snapshot", "write"]
    assert rs.overhead_points(0)[0].overhead == pytest.approx(0.2 / 10.1)  # the new Monitor's clock


def test_a_session_that_goes_on_after_a_newer_one_keeps_its_saves() -> None:
    """Two Checkpointers of one rank appending to one log at once: each event goes to its own
    session's save, even one first counted as abandoned when the other session started."""
    rs = RunState()
    a, b = _direct_save(0.0, "a"), _direct_save(0.2, "b")
    for e in (a[0], b[0], b[1], a[1], b[2], a[2]):
        rs.feed(e)
    assert [(s.durable_s, s.abandoned) for s in rs.saves()] == [(pytest.approx(0.6), False)] * 2
    assert rs.status(1.0)[0].pending == 0


def test_a_group_file_is_durable_only_when_its_group_commits(tmp_path: Path) -> None:
    """A group's files count for the RPO once the group is published, as the Checkpointer's own
    ``stats().rpo_s`` counts them. Before: each file counted at its own commit, so the exported
    ``fastckpt_rpo_seconds`` stayed low while every group commit failed (a node loss would have
    gone back further than it said)."""
    log = tmp_path / "events.jsonl"
    ops = FaultyOps([Fault("replace", errno.EIO, path_contains=P.GROUP_MANIFEST)])
    with fastckpt.Checkpointer(event_log=str(log), ops=ops, overhead_budget=0.99) as ck:
        g = tmp_path / "run" / "step-1"
        ck.save({"w": torch.ones(64)}, str(g / "r0.pt"), group=str(g)).wait(60)
        with pytest.raises(OSError, match="Input/output error"):
            ck.commit(str(g)).wait(60)
        assert ck.stats().rpo_s is None  # nothing is durable: the group never was published
        rs = RunState()
        for e in read_events(str(log)):
            rs.feed(e)
        assert rs.status(e.end + 1)[0].rpo_s is None
        g2 = tmp_path / "run" / "step-2"
        ck.save({"w": torch.ones(64)}, str(g2 / "r0.pt"), group=str(g2)).wait(60)
        ck.commit(str(g2)).wait(60)
    rs = RunState()
    for e in read_events(str(log)):
        rs.feed(e)
    step2 = next(s for s in rs.saves() if "step-2" in s.path)
    assert rs.status(step2.start + 5)[0].rpo_s == pytest.approx(5.0)


def _group_files(t: float, names: tuple[str, ...] = ("a", "b"), g: str = "/h/g") -> list[Event]:
    """Two files of one rank's attempt at group ``g`` through a burst buffer, replicated."""
    evs = []
    for k, n in enumerate(names):
        p = f"{g}/{n}.pt"
        evs += [_ev("snapshot", t + k, t + k + 0.1, p, group=g), _ev("write", t + k + 0.1, t + k + 0.5, "/bb" + p),
                _ev("commit", t + k + 0.5, t + k + 0.6, "/bb" + p), _ev("queued", t + k + 0.6, t + k + 0.6, p),
                _ev("replicate", t + k + 0.6, t + k + 0.9, p)]
    return evs


def test_a_groups_files_are_durable_at_its_commit_and_not_pending_once_at_their_path() -> None:
    """Before: each file was durable at its replication, so a report's "durable after" left out
    the group's commit, and a file whose group never committed counted as durable. A file at its
    path waits for commit(), not for work: pending as ``stats().pending`` counts it (it said 2)."""
    rs = RunState()
    evs = _group_files(0.0)
    for e in evs[:4]:  # the first file, queued for replication: still running
        assert rs.feed(e) == []
    assert rs.status(0.7)[0].pending == 1
    for e in evs[4:]:
        assert rs.feed(e) == []
    (st,) = rs.status(5.0)
    assert (st.pending, st.replication_pending, st.replication_lag_s, st.rpo_s) == (0, 0, 0.0, None)
    assert [s.durable_at for s in rs.saves()] == [None, None]  # not durable before the commit
    done = rs.feed(_ev("commit", 2.0, 3.0, "/h/g", tier="nvme", detail="group"))
    assert [(s.path, s.durable_at, s.error) for s in done] == [("/h/g/a.pt", 3.0, None), ("/h/g/b.pt", 3.0, None)]
    assert [s.durable_s for s in rs.saves()] == [3.0, 2.0]
    (st,) = rs.status(5.0)
    assert (st.pending, st.rpo_s) == (0, 4.0)  # since its newest file's save began


def test_a_groups_files_fail_with_its_commit_or_with_a_file_of_the_attempt() -> None:
    rs = RunState()
    for e in _group_files(0.0):
        rs.feed(e)
    err = "CommitTimeoutError('rank 1 did not commit')"
    done = rs.feed(_ev("commit", 2.0, 3.0, "/h/g", detail="group", error=err))
    assert [s.error for s in done] == [err, err] and rs.status(5.0)[0].pending == 0
    # the next attempt: its first file is durable, its second fails; no group commit event follows
    a, b = _group_files(10.0, g="/h/g2")[:5], _group_files(10.0, ("b",), g="/h/g2")[:2]
    for e in a + b:
        rs.feed(e)
    done = rs.feed(_ev("commit", 11.5, 11.6, "/bb/h/g2/b.pt", error="OSError(28, 'No space left on device')"))
    assert [(s.path, s.error is not None) for s in done] == [("/h/g2/a.pt", True), ("/h/g2/b.pt", True)]
    assert "/h/g2 was not committed: OSError(28" in done[0].error
    (st,) = rs.status(20.0)
    assert (st.pending, st.rpo_s) == (0, None)


def test_a_group_commit_read_before_its_files_replication_still_ends_them() -> None:
    """``read_events`` sorts by start: a commit called while the files still replicate comes first."""
    rs = RunState()
    evs = _group_files(0.0) + [_ev("commit", 1.2, 3.0, "/h/g", detail="group")]
    for e in sorted(evs, key=lambda e: (e.start, e.end)):
        rs.feed(e)
    assert [(s.durable_at, s.error) for s in rs.saves()] == [(3.0, None), (3.0, None)]
    assert rs.status(5.0)[0].pending == 0


def test_the_replayed_window_counts_a_save_blocked_longer_than_it() -> None:
    rs = RunState(budget=0.3, window_s=0.2)
    rs.feed(_ev("snapshot", 9.3, 9.4, "/h/a.pt", tier="direct"))
    rs.feed(_ev("snapshot", 9.4, 10.0, "/h/b.pt", tier="direct"))  # blocked 0.6 s, the window's 0.2 s and more
    assert rs.overhead_points(0)[-1].window_overhead == pytest.approx(1.0)
    assert rs.alarms(0) == 1


def test_an_exporters_replay_keeps_only_the_newest_overhead_points() -> None:
    rs = RunState(keep_done=0)
    for i in range(100):
        rs.feed(_ev("snapshot", float(i), i + 0.01, f"/h/{i}.pt", tier="direct"))
    assert len(rs.overhead_points(0)) == 1 and rs.status(100.0)[0].overhead > 0


def test_the_report_counts_each_group_published_once_whatever_the_ranks() -> None:
    """Every rank logs a commit of each group it took part in: two ranks, two groups read as 4."""
    from fastckpt.report.summary import summarize

    rs = RunState()
    for t, group in ((1.0, "/h/step-1"), (2.0, "/h/step-2")):
        for rank in (0, 1):
            rs.feed(_ev("snapshot", t, t + 0.01, f"{group}/r{rank}.pt", rank=rank, tier="direct", group=group))
            rs.feed(_ev("commit", t + 0.1, t + 0.2, group, rank=rank, tier="direct", detail="group"))
    assert summarize(rs).group_commits == 2
    one = RunState()  # one rank's log alone: its own count
    for ev in [_ev("commit", t, t + 0.1, f"/h/step-{t}", rank=1, tier="direct", detail="group") for t in (1.0, 2.0)]:
        one.feed(ev)
    assert summarize(one).group_commits == 2


def test_a_re_saved_groups_files_written_beside_it_are_its_files() -> None:
    """A re-save of a published group writes beside it, in .TAG.fastckpt-next-<digest>: its write
    and commit events named that directory, and the replay held the save pending for ever."""
    rs = RunState()
    g = "/h/step-1"
    for t, where in ((1.0, g), (5.0, "/h/.step-1.fastckpt-next-0123abcd")):
        rs.feed(_ev("snapshot", t, t + 0.01, f"{g}/model.pt", tier="direct", group=g))
        rs.feed(_ev("write", t + 0.01, t + 0.1, f"{where}/model.pt", tier="direct"))
        rs.feed(_ev("commit", t + 0.1, t + 0.2, f"{where}/model.pt", tier="direct"))
        rs.feed(_ev("commit", t + 0.2, t + 0.3, g, tier="direct", detail="group"))
    saves = rs.saves()
    assert len(saves) == 2 and all(s.durable_at is not None for s in saves)
    assert rs.status(10.0)[0].pending == 0


def _replayed_pending(log: Path) -> int:
    rs = RunState()
    for ev in read_events(str(log)):
        rs.feed(ev)
    return rs.status(time.time())[0].pending


def test_a_group_commit_in_flight_is_pending_in_the_replay_as_in_stats(tmp_path: Path) -> None:
    """While a group commit runs (its manifest's rename held), stats().pending counted it and the replay of
    the log (serve-metrics' gauge) did not: the log had nothing of it until it ended. Its ``committing``
    event, at the call, counts it from then to its group ``commit``."""
    log, ops, g = tmp_path / "events.jsonl", FaultyOps(), str(tmp_path / "home" / "step-1")
    with fastckpt.Checkpointer(ops=ops, event_log=str(log), overhead_budget=0.99) as ck:
        ck.save({"w": torch.zeros(1024)}, f"{g}/model.pt", group=g).wait(60)
        gate = ops.gate("replace", path_contains=P.GROUP_MANIFEST)
        handle = ck.commit(g, step=1)
        try:
            assert gate.wait_entered()
            assert (ck.stats().pending, _replayed_pending(log)) == (1, 1)  # was (1, 0)
        finally:
            gate.open()
        handle.wait(60)
        assert (ck.stats().pending, _replayed_pending(log)) == (0, 0)


def test_a_group_commit_that_ended_with_its_saves_failure_is_no_longer_pending(tmp_path: Path) -> None:
    """A commit that raised its own save's failure logs no group ``commit`` (the failure is counted once,
    under the save's phase): its ``uncommitted`` event ends it in the replay, which counts one failure."""
    log, g = tmp_path / "events.jsonl", str(tmp_path / "home" / "step-1")
    ops = FaultyOps([Fault("pwrite", errno.ENOSPC, path_contains="model.pt")])
    with fastckpt.Checkpointer(ops=ops, event_log=str(log), overhead_budget=0.99) as ck:
        with pytest.raises(fastckpt.CheckpointWriteError):
            ck.save({"w": torch.zeros(1024)}, f"{g}/model.pt", group=g).wait(60)  # seen: commit() goes on
        with pytest.raises(fastckpt.CheckpointWriteError):
            ck.commit(g, step=1).wait(60)
        assert (ck.stats().pending, _replayed_pending(log)) == (0, 0)
    rs = RunState()
    for ev in read_events(str(log)):
        rs.feed(ev)
    assert [e.name for e in rs.failures] == ["write"]


@pytest.mark.parametrize("given, detail, budget", [
    (None, "overhead_budget=0.5 overhead_window_s=60.0", 0.5), (0.1, "overhead_budget=0.5", 0.1),
    (None, "overhead_budget=nan overhead_window_s=x", 0.02), (None, None, 0.02)])
def test_the_alarm_is_replayed_against_the_jobs_budget_unless_one_is_given(given: float | None, detail: str | None,
                                                                        budget: float) -> None:
    """RunState(budget=None) (serve-metrics without --overhead-budget) takes each rank's budget from
    its session's start event; a value that is no budget, or no start event, is the default."""
    rs = RunState(given, None)
    evs = ([_ev("start", 1.0, 1.0, detail=detail, session="s")] if detail is not None else []) + \
        [_ev("snapshot", t, t + 0.3, path=f"/h/{t}.pt", session="s") for t in (1.0, 2.0, 3.0)]
    for ev in evs:
        rs.feed(ev)
    (st,) = rs.status(3.3)
    assert st.budget == rs.budget_of()[0] == budget and st.over_budget == (st.overhead > budget)


def test_a_budget_given_as_a_numpy_scalar_or_a_fraction_reads_back() -> None:
    """The options take any real number; the start event writes it as a float, or its readers
    fell back to the default budget (a false alarm for a job with a larger one)."""
    import fractions

    import numpy as np

    from fastckpt.events import start_detail
    from fastckpt.replay import parse_start
    assert parse_start(start_detail(np.float64(0.5), np.int64(60), 1.5)) == (0.5, 60.0, 1.5)
    assert parse_start(start_detail(fractions.Fraction(1, 4), 3600, np.float64(2.5))) == (0.25, 3600.0, 2.5)


def _started(t: float, session: str, started_at: float | None = None) -> Event:
    """A session's start event at its first event ``t``; ``started_at``: when its Checkpointer was built (None: a
    log written before fastckpt recorded it)."""
    built = "" if started_at is None else f" started_at={started_at!r}"
    return _ev("start", t, t, "/h/events.jsonl", tier="path", detail=f"overhead_budget=0.1 overhead_window_s=3600.0"
               f"{built}", session=session)


def _saves(session: str, *starts: float) -> list[Event]:
    return [_ev("snapshot", t, t + 0.3, f"/h/{t}.pt", tier="direct", session=session) for t in starts]


def test_the_replays_clock_starts_when_the_checkpointer_was_built() -> None:
    """The Monitor's clock starts at the Checkpointer's construction, which the start event records
    (``started_at``): 30 s of model build and steps before the first save count, in the replay as in
    ``stats()``. The replay's clock started at the first save: 0.9 s blocked over 2.3 s read 39 %
    (an alarm against the job's 10 %) where the job's Monitor read 2.8 % and never alarmed."""
    rs = RunState()
    for ev in [_started(130.0, "s", 100.0), *_saves("s", 130.0, 131.0, 132.0)]:
        rs.feed(ev)
    pts = rs.overhead_points(0)
    assert [p.overhead for p in pts] == [pytest.approx(0.6 / 31.3), pytest.approx(0.9 / 32.3)]  # was 0.6 / 1.3 ...
    assert [p.window_overhead for p in pts] == [p.overhead for p in pts]  # a run shorter than the window
    assert rs.alarms(0) == 0  # was 1
    (st,) = rs.status(140.0)  # serve-metrics' ratios, at a scrape
    assert (st.overhead, st.window_overhead, st.over_budget) == (pytest.approx(0.9 / 40.0), pytest.approx(0.9 / 40.0),
                                                                 False)


def test_a_log_without_the_construction_time_keeps_the_first_saves_clock() -> None:
    """A log written before the start event recorded ``started_at`` (or one without start events)
    is replayed from its first save, as before; a resumed job's session without it does not take
    the clock of the session before (its new Monitor started its own)."""
    for head in ([_started(130.0, "s")], []):
        rs = RunState(0.1)
        for ev in [*head, *_saves("s", 130.0, 131.0, 132.0)]:
            rs.feed(ev)
        assert rs.overhead_points(0)[-1].overhead == pytest.approx(0.9 / 2.3) and rs.alarms(0) == 1
    rs = RunState()
    for ev in [_started(130.0, "a", 100.0), *_saves("a", 130.0, 131.0), _started(500.0, "b"),
               *_saves("b", 500.0, 502.0), _started(900.0, "c", 800.0), *_saves("c", 900.0, 910.0)]:
        rs.feed(ev)
    assert [p.overhead for p in rs.overhead_points(0)] == [pytest.approx(0.6 / 31.3), pytest.approx(0.6 / 2.3),
                                                           pytest.approx(0.6 / 110.3)]


def test_a_lazy_save_is_counted_at_its_fence_event_and_an_older_logs_at_its_snapshot() -> None:
    """A lazy snapshot (detail LAZY) waits for its fence event, whose span (the fence's wait) adds to
    its blocked time; a log written before fence events ("lazy") counts it at the snapshot."""
    from fastckpt.events import LAZY

    rs = RunState(0.5, 3600.0)
    rs.feed(_ev("snapshot", 1.0, 1.1, detail=LAZY))
    assert rs.saves()[0].blocked_s == pytest.approx(0.1) and rs.status(2.0)[0].overhead == 0.0  # not counted yet
    rs.feed(_ev("fence", 1.5, 1.9, nbytes=0, detail="saved_at=1.0"))
    assert rs.saves()[0].blocked_s == pytest.approx(0.5)
    assert rs.status(2.0)[0].overhead == pytest.approx(0.5)  # 0.5 s blocked since 1.0
    old = RunState(0.5, 3600.0)
    old.feed(_ev("snapshot", 1.0, 1.1, detail="lazy"))
    assert old.status(2.0)[0].overhead == pytest.approx(0.1)
