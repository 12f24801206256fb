"""keep_local counts the groups that replication dropped (``replicate_policy="coalesce"``) once a
later step beside them is verified at its home: a DeepSpeed or Megatron job whose replication
falls behind keeps a bounded burst buffer. A dropped single file stays (it may be a checkpoint
the user still names). Backpressure is made real by holding the one replication worker on a
gate (a FaultyOps read of the burst buffer), never by sleeping.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.testing import FaultyOps

from .test_burst_buffer import QueueWaiter as Queued


def _state(step: int) -> dict:
    return {"w": torch.full((1 << 16,), step, dtype=torch.int32), "step": step}


def test_a_dropped_single_file_stays_loadable_from_the_burst_buffer(tmp_path: Path) -> None:
    ops, nvme, dest = FaultyOps(), str(tmp_path / "nvme"), tmp_path / "t"
    names = [str(dest / n) for n in ("last.ckpt", "epoch=1-val=0.10.ckpt", "epoch=2-val=0.30.ckpt")]
    gate = ops.gate("preadv", path_contains=os.path.join(nvme, ""))  # holds last.ckpt's replication
    queued = Queued(names[2])
    ck = fastckpt.Checkpointer(local_dir=nvme, ops=ops, replicate_workers=1, keep_local=1, sinks=(queued,))
    h0 = ck.save(_state(0), names[0])
    assert gate.wait_entered(60)
    h1, h2 = ck.save(_state(1), names[1]), ck.save(_state(2), names[2])
    assert queued.seen.wait(60)  # the best checkpoint (val=0.10) is dropped for the next one
    gate.open()
    assert h1.wait().superseded and not h0.wait().superseded and not h2.wait().superseded
    ck.save(_state(3), names[0]).wait()
    assert os.path.exists(ck.local_path(names[1])) and not os.path.exists(names[1])
    assert torch.equal(ck.load(names[1])["w"], _state(1)["w"])  # a top-k file Lightning still names
    ck.close()


def test_a_dropped_group_is_trimmed_once_a_later_group_is_published(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ops, nvme, run = FaultyOps(), str(tmp_path / "nvme"), tmp_path / "run"
    tags = [str(run / f"global_step{i}") for i in (100, 200, 300)]
    gate = ops.gate("preadv", path_contains=os.path.join(nvme, ""))
    queued = Queued(f"{tags[2]}/model.pt")
    ck = fastckpt.Checkpointer(local_dir=nvme, ops=ops, replicate_workers=1, keep_local=1, sinks=(queued,))
    commits = []
    for i, tag in enumerate(tags):
        ck.save(_state(i), f"{tag}/model.pt", group=tag)
        commits.append(ck.commit(tag, step=(i + 1) * 100))
        if i == 0:
            assert gate.wait_entered(60)
    assert queued.seen.wait(60)  # step 200's file was dropped for step 300's
    assert commits[1].wait().superseded and os.path.isdir(ck.local_path(tags[1]))
    gate.open()
    with caplog.at_level(logging.INFO, logger="fastckpt"):
        assert not commits[0].wait().superseded and not commits[2].wait().superseded
    assert f"keep_local=1 now counts the burst-buffer copies of {tags[1]}: replication dropped" in caplog.text
    assert [os.path.isdir(ck.local_path(t)) for t in tags] == [False, False, True]
    assert fastckpt.latest(str(run)) == tags[2]
    ck.close()
