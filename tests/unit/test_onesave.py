"""onesave.py and ``Checkpointer.one_save``: the files of one checkpoint are one save for the monitor.

A framework's checkpoint is several files (Megatron, DeepSpeed); each counted as a save, so the
first checkpoint of a run raised the overhead alarm and its interval was the gap between two files."""

from __future__ import annotations

import time

import pytest
import torch

import fastckpt
from fastckpt.monitor import Monitor
from fastckpt.testing import FaultyOps


def _state(step: int) -> dict:
    return {"w": torch.full((1 << 18,), step, dtype=torch.int32)}  # 1 MiB


def test_files_saved_in_one_save_are_one_save_blocked_time_and_bytes_summed(tmp_path) -> None:
    with fastckpt.Checkpointer() as ck:
        with ck.one_save():
            recs = [ck.save(_state(i), str(tmp_path / f"{i}.pt")).wait() for i in range(3)]
            assert ck.stats().saves == 0  # counted when it closes
        st = ck.stats()
        assert (st.saves, st.alarms, st.over_budget) == (1, 0, False)
        assert st.bytes == 3 << 20 and st.last_blocked_s == st.blocked_s
        assert st.blocked_s == pytest.approx(sum(r.blocked_s for r in recs))
        with ck.one_save(), ck.one_save():  # nested: one
            ck.save(_state(3), str(tmp_path / "3.pt"))
            ck.save(_state(4), str(tmp_path / "4.pt"))
        ck.save(_state(5), str(tmp_path / "5.pt"))  # outside: a save of its own
        assert ck.stats().saves == 3


@pytest.mark.parametrize("fence", [False, True], ids=["copy ends", "fence"])
def test_a_lazy_file_of_a_one_save_adds_to_it_after_it_closed(tmp_path, fence) -> None:
    with fastckpt.Checkpointer() as ck:
        with ck.one_save():
            lazy = ck.save(_state(1), str(tmp_path / "lazy.pt"), lazy=True)
            eager = ck.save(_state(2), str(tmp_path / "eager.pt")).wait()
        waited = ck.fence() if fence else 0.0  # the copy was counted by its end, or by this fence
        rec = lazy.wait()  # (a lazy save is counted before its write goes on)
        st = ck.stats()
        assert (st.saves, st.bytes) == (1, 2 << 20)
        # (abs: a fence of a copy that had ended measured a wait for nothing, which is not counted)
        assert st.blocked_s == pytest.approx(eager.blocked_s + rec.blocked_s + waited, abs=1e-3)
        with ck.one_save():  # lazy files only: the first copy to end counts it
            handles = [ck.save(_state(i), str(tmp_path / f"l{i}.pt"), lazy=True) for i in range(2)]
        for h in handles:
            h.wait()
        assert ck.stats().saves == 2


def test_a_one_save_whose_files_are_skipped_is_one_skip(tmp_path) -> None:
    ops = FaultyOps()
    gate = ops.gate("fsync", "held")
    with fastckpt.Checkpointer(ops=ops, staging_buffers=1, when_busy="skip") as ck:
        held = ck.save(_state(0), str(tmp_path / "held.pt"))  # its write holds the only staging buffer
        assert gate.wait_entered()
        with pytest.warns(UserWarning, match="skipped save"), ck.one_save():
            skipped = [ck.save(_state(i), str(tmp_path / f"{i}.pt")).wait() for i in range(2)]
        gate.open()
        held.wait()
        st = ck.stats()
    assert all(r.skipped for r in skipped) and (st.saves, st.skipped) == (1, 1)


def test_the_alarm_measures_the_interval_between_one_saves() -> None:
    reports = []
    m = Monitor(0.02, 3600.0, reports.append)
    m._t0 = time.monotonic() - 10.0  # a run that started 10 s ago
    for start in (1.0, 5.0):  # two checkpoints of two files each, 4 s apart
        with m.one_save():
            m.record_blocked(m._t0 + start, 0.15, 1000)
            m.record_blocked(m._t0 + start + 0.01, 0.15, 1000)
    assert m.count == 2 and m.alarms == 1
    rep = reports[0]
    assert (rep.saves, rep.mean_interval_s, rep.mean_bytes) == (2, pytest.approx(4.0), 2000)
    assert rep.blocked_s == pytest.approx(0.6) and rep.mean_blocked_s == pytest.approx(0.3)
