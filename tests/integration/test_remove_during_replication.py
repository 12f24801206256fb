"""remove() of a checkpoint whose replication is queued or running (no race like Lightning#14035).

A queued upload is cancelled, not waited for; a running one finishes and is then deleted. The
first replication is held by a FaultyOps gate, so the order is fixed by events, not timing.
"""

from __future__ import annotations

import os
import threading
import time

import torch

import fastckpt
from fastckpt.testing import FaultyOps
from tests.integration.test_burst_buffer import QueueWaiter


def _state(step: int) -> dict:
    return {"w": torch.full((1 << 16,), step, dtype=torch.int32), "step": step}


def test_remove_cancels_a_queued_replication(tmp_path) -> None:
    ops = FaultyOps()
    local, dest = str(tmp_path / "nvme"), tmp_path / "t"
    a, b = str(dest / "a.pt"), str(dest / "b.pt")
    gate = ops.gate("preadv", path_contains=local)  # holds a's copy to the target
    queued = QueueWaiter(b)
    log = str(tmp_path / "events.jsonl")
    ck = fastckpt.Checkpointer(local_dir=local, ops=ops, replicate_workers=1, replicate_policy="all",
                               sinks=(queued,), event_log=log)
    ha = ck.save(_state(1), a)
    assert gate.wait_entered(60)
    hb = ck.save(_state(2), b)
    assert queued.seen.wait(60)  # b waits behind a
    ck.remove(b)  # returns without waiting for a's upload, which is still held
    rb = hb.wait()
    assert rb.cancelled and rb.durable_s is None
    assert not os.path.exists(b) and not os.path.exists(ck.local_path(b))
    assert not ha.done()
    gate.open()
    ra = ha.wait()
    assert not ra.cancelled and ra.durable_s is not None
    ck.close()
    assert sorted(os.listdir(dest)) == ["a.pt"]
    assert fastckpt.latest(str(dest)) == a
    # the log says the cancelled save ended: its replay (report, serve-metrics) never holds it pending
    from fastckpt.report import load_run

    run, summary = load_run([log])
    assert (summary.durable, summary.pending, summary.abandoned) == (1, 0, 1)
    assert run.status(time.time())[0].pending == 0


def test_remove_during_a_running_replication_deletes_both_copies(tmp_path) -> None:
    ops = FaultyOps()
    local, dest = str(tmp_path / "nvme"), tmp_path / "t"
    a = str(dest / "a.pt")
    gate = ops.gate("preadv", path_contains=local)
    ck = fastckpt.Checkpointer(local_dir=local, ops=ops)
    ha = ck.save(_state(1), a)
    assert gate.wait_entered(60)
    removed = threading.Event()

    def remove() -> None:
        ck.remove(a)
        removed.set()

    t = threading.Thread(target=remove)
    t.start()
    gate.open()  # the running copy completes; remove() then deletes it
    t.join(60)
    assert removed.is_set()
    ra = ha.wait()
    assert not ra.cancelled and ra.durable_s is not None
    assert not os.path.exists(a) and not os.path.exists(ck.local_path(a))
    assert fastckpt.latest(str(dest)) is None
    ck.close()
