"""monitor.py: overhead accounting, one alarm per crossing, the callback and the advice."""

from __future__ import annotations

import logging
import random
import time

from fastckpt.monitor import BlockedWindow, Monitor, OverheadReport, fmt_duration, fmt_rate
from fastckpt.replay import OverheadReplay


def test_alarm_once_per_crossing_and_rearm(caplog) -> None:
    reports = []
    m = Monitor(0.02, 3600.0, reports.append)
    m._t0 = time.monotonic() - 10.0  # a run that started 10 s ago
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        m.record_blocked(m._t0 + 1.0, 0.05, 1000)
        assert not m.over  # one save: no interval yet
        m.record_blocked(m._t0 + 5.0, 0.5, 1000)  # 0.55 s blocked in 10 s: 5.5 %
        assert m.over and m.alarms == 1
        m.record_blocked(m._t0 + 9.0, 0.5, 1000)  # still above: no second warning
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and len(reports) == 1
    rep = reports[0]
    assert rep.budget == 0.02 and rep.saves == 2
    assert 0.05 < rep.overhead < 0.06
    text = rep.advice()
    assert "2.0% budget" in text and "Too early to size a fix from 1 interval" in text and "GB/s" not in text
    # needed bandwidth: mean bytes / (budget * mean interval)
    assert abs(rep.needed_snapshot_Bps - 1000 / (0.02 * 4.0)) < 1e-6
    # drop below the budget (a long quiet stretch), then cross again: a second alarm
    m._t0 -= 1000.0
    m._window = BlockedWindow(m._window.window_s)
    m.record_blocked(time.monotonic(), 0.0, 1000)
    assert not m.over
    m._t0 = time.monotonic() - 1.0
    m.record_blocked(time.monotonic(), 0.5, 1000)
    assert m.over and m.alarms == 2 and len(reports) == 2


def test_advice_waits_for_three_intervals_then_follows_once(caplog) -> None:
    reports = []
    m = Monitor(0.02, 3600.0, reports.append)
    m._t0 = time.monotonic() - 10.0
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        for i in range(6):  # 0.5 s blocked every 2 s, in a run of 10 s: over from the second save
            m.record_blocked(m._t0 + 2.0 * i, 0.5, 2_000_000)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and m.alarms == 1 and len(reports) == 1  # the alarm, then its advice
    assert "Too early" in warnings[0]
    # 2 MB per save every 2 s at 2 %: 2e6 / (0.02 * 2) = 50 MB/s; 0.5 s / 0.02 = 25 s
    assert "4 saves" in warnings[1]
    assert "snapshot at >= 50 MB/s" in warnings[1] and "save every >= 25 s" in warnings[1]


def test_advice_numbers_are_rounded_up_to_two_significant_figures() -> None:
    rep = OverheadReport(0.05, 0.05, 0.02, 5, 60.0, 0.3, 12.0, 0.06, 1234.0, 1234.0 / 0.24, 0.06 / 0.02)
    text = rep.advice()
    assert "snapshot at >= 5.2 kB/s" in text and "save every >= 3 s" in text  # never "0.00 GB/s", "0 s"
    assert fmt_rate(5.23e9, up=True) == "5.3 GB/s" and fmt_rate(999.0) == "1 kB/s"
    assert fmt_duration(0.0123) == "12 ms" and fmt_duration(125.0, up=True) == "2.1 min"
    assert fmt_duration(7200.0) == "2 h"


def test_stats_fields() -> None:
    m = Monitor(0.02, 60.0)
    m.record_blocked(time.monotonic(), 0.01, 10)
    m.record_durable(0.2)
    m.record_skipped()
    s = m.stats(pending=3)
    assert (s.saves, s.skipped, s.bytes, s.pending) == (1, 1, 10, 3)
    assert s.last_blocked_s == 0.01 and s.last_durable_s == 0.2
    assert s.overhead_budget == 0.02 and not s.over_budget


def test_advice_tells_a_wait_for_the_staging_buffer_from_the_copy() -> None:
    """Before: the advice always said "use a local_dir burst buffer or a faster tier", to runs
    that had one, and when the stall was the copy into host memory, which neither shortens."""
    copy = OverheadReport(0.05, 0.05, 0.02, 5, 60.0, 0.3, 12.0, 0.06, 1e9, 1e9 / 0.24, 3.0, 0.01)
    text = copy.advice()
    assert "snapshot at >= 4.2 GB/s (the copy into host memory; save(..., lazy=True) overlaps it" in text
    assert "burst buffer" not in text and "save every >= 3 s" in text
    waited = OverheadReport(0.05, 0.05, 0.02, 5, 60.0, 0.3, 12.0, 0.06, 1e9, 1e9 / 0.24, 3.0, 0.05)
    text = waited.advice()
    assert "Of that, 50 ms per save waited for a staging buffer that the save before still held" in text
    assert "a local_dir burst buffer on NVMe, a faster tier), add staging_buffers" in text
    assert "save every >= 3 s" in text and "snapshot at" not in text


def test_a_save_that_waits_for_the_previous_write_is_counted_as_waiting(tmp_path) -> None:
    """A real Checkpointer, one staging buffer: the second save waits for the first one's write
    (held by a gate until the second save waits), and the alarm's report says how long."""
    import threading

    import torch

    import fastckpt
    from fastckpt.testing import FaultyOps

    ops = FaultyOps()
    gate = ops.gate("pwrite", path_contains="a.pt")
    reports: list[OverheadReport] = []
    with fastckpt.Checkpointer(ops=ops, overhead_budget=1e-9, on_overhead_exceeded=reports.append) as ck:
        waiting = threading.Event()

        class Cond(threading.Condition):
            def wait(self, timeout: float | None = None) -> bool:
                waiting.set()
                return super().wait(timeout)

        ck._staging._cv = Cond()  # tells when the second save waits for the buffer
        first = ck.save({"w": torch.ones(1 << 16)}, str(tmp_path / "a.pt"))
        assert gate.wait_entered(60)
        opener = threading.Thread(target=lambda: (waiting.wait(60), gate.open()))
        opener.start()
        second = ck.save({"w": torch.ones(1 << 16)}, str(tmp_path / "b.pt"))
        opener.join()
        first.wait(60), second.wait(60)
    (rep,) = reports
    assert rep.saves == 2 and waiting.is_set()
    assert 0 < rep.mean_waited_s * 2 <= second.result().blocked_s


def test_a_save_blocked_longer_than_the_window_fills_it() -> None:
    """The window kept only saves that started inside it: a save that blocked the whole window
    (and ended just now, begun as the save before it ended) counted 0 % there, and the alarm
    stayed silent."""
    m = Monitor(0.3, 0.2)
    now = time.monotonic()
    m._t0 = now - 10.0
    m.record_blocked(now - 0.601, 0.001, 1000)
    m.record_blocked(time.monotonic() - 0.6, 0.6, 1000)  # began 0.6 s ago, blocked until now
    assert m._window.share(time.monotonic(), m._t0) > 0.95 and m.over and m.alarms == 1


def _window_share(saves: list[tuple[float, float]], now: float, window_s: float, t0: float) -> float:
    """The window's rule written out: the blocked time (each save's span from its start) inside
    the last ``window_s`` seconds, or since the save that ended second last if that is longer."""
    ends = sorted(s + b for s, b in saves)
    cut = min(now - window_s, ends[-2]) if len(ends) > 1 else now - window_s
    span = now - max(cut, t0)
    return min(sum(max(0.0, b - max(0.0, cut - s)) for s, b in saves) / span, 1.0) if span > 0 else 0.0


def test_the_window_is_one_rule_for_the_monitor_and_its_replay() -> None:
    """The live alarm and the one replayed from an event log (report, metrics) share one window:
    for the same saves they give the same numbers, checked against the sum written out."""
    rng = random.Random(7)
    window_s, t, saves = 5.0, 100.0, []
    live, replay = BlockedWindow(window_s), OverheadReplay(0.5, window_s)
    for _ in range(400):
        t += rng.uniform(0.0, 1.5)
        blocked = rng.choice([0.0, rng.uniform(0.0, 0.3), rng.uniform(0.0, 8.0)])
        saves.append((t, blocked))
        live.add(t, blocked)
        t += blocked
        replay.record(t - blocked, blocked, t)
        now = t = t + rng.uniform(0.0, 2.0)  # the clock never goes back
        want = _window_share(saves, now, window_s, saves[0][0])
        assert abs(live.share(now, saves[0][0]) - want) < 1e-9
        assert abs(replay.window(now) - want) < 1e-9


def test_the_window_takes_saves_recorded_out_of_start_order() -> None:
    """A lazy save is recorded when its copy ends, after saves that began later: the window
    assumed start order, counted blocked time from before the window, and raised a false
    alarm (a save begun 25 s ago, 6 s blocked, recorded after one begun 9 s ago: 0.70, not 0.10)."""
    rng = random.Random(11)
    window_s, t = 5.0, 100.0
    live, recorded, pending = BlockedWindow(window_s), [], []
    for _ in range(400):
        t += rng.uniform(0.0, 1.5)
        pending.append((t, rng.choice([0.0, rng.uniform(0.0, 0.3), rng.uniform(0.0, 8.0)])))
        while pending and rng.random() < 0.6:  # some are recorded now, in any order
            save = pending.pop(rng.randrange(len(pending)))
            live.add(*save)
            recorded.append(save)
        now = t = t + rng.uniform(0.0, 2.0)
        want = _window_share(recorded, now, window_s, 100.0)
        assert abs(live.share(now, 100.0) - want) < 1e-9


def test_a_raising_overhead_callback_loses_no_save(tmp_path, caplog) -> None:
    """The alarm's callback runs once the save's write is queued (its pwrite is reached while the
    callback runs), and a callback that raises (a metrics push that fails; Lightning's warning
    under -W error) is logged: the save it was called for is still written and loadable."""
    import torch

    import fastckpt
    from fastckpt.testing import FaultyOps

    ops = FaultyOps()
    gate = ops.gate("pwrite", path_contains="s1.pt")  # s1.pt: the second save, the one that crosses the budget
    entered: list[bool] = []

    def callback(report: OverheadReport) -> None:
        entered.append(gate.wait_entered(10))  # old code: the write was not queued yet, nor ever
        gate.open()
        raise RuntimeError("metrics push failed")

    with caplog.at_level(logging.ERROR, logger="fastckpt"):
        with fastckpt.Checkpointer(ops=ops, overhead_budget=1e-9, on_overhead_exceeded=callback) as ck:
            handles = [ck.save({"w": torch.full((1000,), float(i)), "step": i}, str(tmp_path / f"s{i}.pt"))
                       for i in range(3)]
            for h in handles:
                h.wait(60)
            stats = ck.stats()
    assert entered == [True]
    assert stats.saves == 3 and stats.alarms == 1 and stats.pending == 0
    for i in range(3):
        assert fastckpt.load(str(tmp_path / f"s{i}.pt"))["step"] == i
    (err,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "on_overhead_exceeded raised RuntimeError('metrics push failed')" in err.getMessage()
    assert err.exc_info is not None


def test_saves_further_apart_than_the_window_are_measured_over_their_interval(caplog) -> None:
    """One save every 30 min blocking 15 s (0.83 %) under a 2 % budget and a 10 min window: right
    after each save the window held that save alone, 15 s / 600 s = 2.5 %, and the alarm fired on
    every run of this shape, advising "save every >= 13 min" to a run that saved every 30."""
    reports: list[OverheadReport] = []
    m = Monitor(0.02, 600.0, reports.append)
    now = time.monotonic()
    m._t0 = now - 3 * 1800.0
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        for k in (2, 1, 0):  # the newest ends just now
            m.record_blocked(now - k * 1800.0 - 15.0, 15.0, 1 << 30)
    st = m.stats(0)
    assert not st.over_budget and st.alarms == 0 and reports == [] and caplog.records == []
    assert abs(st.window_overhead - 15.0 / 1800.0) < 1e-3  # one save's blocked time over its interval


def test_a_burst_of_saves_inside_the_window_still_raises_the_alarm() -> None:
    """The window's purpose: sparse saves (0.83 %), then a burst of them (each 5 s, 15 s apart)
    that the run's overhead hides (well under 2 %) but the window catches at its first save."""
    reports: list[OverheadReport] = []
    m = Monitor(0.02, 600.0, reports.append)
    now = time.monotonic()
    m._t0 = now - 3 * 1800.0 - 60.0
    for k in (2, 1, 0):
        m.record_blocked(now - 60.0 - k * 1800.0 - 15.0, 15.0, 1 << 30)
    assert not m.over
    m.record_blocked(now - 45.0, 5.0, 1 << 30)  # (15 s + 5 s) / 600 s in the window
    assert m.over and m.alarms == 1 and len(reports) == 1
    assert reports[0].overhead < 0.02 < reports[0].window_overhead


def test_the_replayed_window_measures_sparse_saves_over_their_interval() -> None:
    """``fastckpt report`` and ``serve-metrics`` replay the same rule: no alarm there either."""
    replay = OverheadReplay(0.02, 600.0)
    for k in range(1, 7):
        replay.record(k * 1800.0 - 15.0, 15.0, k * 1800.0)
    assert replay.alarms == 0 and not replay.over
    assert [round(p.window_overhead, 6) for p in replay.points] == [round(15.0 / 1800.0, 6)] * 5


def test_blocked_time_added_to_a_save_extends_it() -> None:
    """A lazy file of a ``one_save()`` block whose copy ends after the block closed adds its time
    to the block's save (same start): one save, so the window still reaches the save before."""
    parts, whole = BlockedWindow(600.0), BlockedWindow(600.0)
    for w in (parts, whole):
        w.add(0.0, 10.0)
    parts.add(1800.0, 5.0)
    parts.add(1800.0, 10.0)
    whole.add(1800.0, 15.0)
    assert parts.share(1815.0, 0.0) == whole.share(1815.0, 0.0) == 15.0 / 1805.0
