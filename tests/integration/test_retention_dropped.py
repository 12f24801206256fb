"""keep_local counts the groups that replication dropped (``replicate_policy="coalesce"``) once a
later step beside them is verified at its home: a DeepSpeed or Megatron job whose replication
falls behind keeps a bounded burst buffer. A dropped single file stays (it may be a checkpoint
the user still names). Ranks that share a burst buffer delete only what they know is settled.
Backpressure and slow ranks are made real by holding file operations (FaultyOps), never by
sleeping.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.commit import protocol as P
from fastckpt.io.atomic import final_path
from fastckpt.testing import FaultyOps
from fastckpt.urls import mirror_path

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


def test_a_dropped_single_file_in_a_numbered_directory_stays_beside_a_later_group(tmp_path: Path) -> None:
    """``ep3/model.pt`` is dropped for the group ``step5`` queued after it: its burst-buffer copy
    is its only copy, and is never taken for an unpublished group when that group is durable."""
    ops, nvme, run = FaultyOps(), str(tmp_path / "nvme"), tmp_path / "run"
    single, group = str(run / "ep3" / "model.pt"), str(run / "step5")
    gate = ops.gate("preadv", path_contains=os.path.join(nvme, ""))  # holds other.pt's replication
    queued = Queued(f"{group}/r0.pt")
    ck = fastckpt.Checkpointer(local_dir=nvme, ops=ops, replicate_workers=1, keep_local=2, sinks=(queued,))
    ck.save(_state(0), str(tmp_path / "other.pt"))
    assert gate.wait_entered(60)
    h = ck.save(_state(3), single)
    ck.save(_state(5), f"{group}/r0.pt", group=group)
    commit = ck.commit(group, step=5)
    assert queued.seen.wait(60) and h.wait(60).superseded
    gate.open()
    assert not commit.wait(60).superseded
    assert os.path.exists(ck.local_path(single)) and not os.path.exists(single)
    assert torch.equal(ck.load(single)["w"], _state(3)["w"])
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


class _Hold:
    """A FileOps hook that holds the upload of one file (its first write at the durable home)."""

    def __init__(self, home_file: str) -> None:
        self.home_file = home_file
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, op: str, path: str) -> None:
        if op == "pwrite" and final_path(path) == self.home_file:
            self.entered.set()
            assert self.release.wait(60)


@pytest.mark.parametrize("with_store", [False, True])
def test_a_rank_trims_only_its_own_files_of_a_dropped_group(tmp_path: Path, with_store: bool) -> None:
    """Two ranks share one burst buffer. Rank 0 dropped step 200 and trims it once step 300 is
    published; rank 1 is still uploading its file of step 200 then, so rank 0 deletes only its
    own file. Rank 1's upload completes and its commit ends as dropped too (before, without a
    store, it waited for an attempt that had ended until commit_timeout_s). Its trim, after
    step 400, removes the rest."""
    nvme, run = str(tmp_path / "nvme"), tmp_path / "run"
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60)) if with_store else None
    tags = [str(run / f"global_step{s}") for s in (100, 200, 300, 400)]
    hold0, hold1 = _Hold(f"{tags[0]}/rank0.pt"), _Hold(f"{tags[1]}/rank1.pt")
    queued = Queued(f"{tags[2]}/rank0.pt")
    cks = [fastckpt.Checkpointer(rank=r, world_size=2, store=store, local_dir=nvme, keep_local=1, overhead_budget=0.99,
                                 ops=FaultyOps(on_call=(hold0, hold1)[r]), replicate_workers=(1, 2)[r],
                                 sinks=(queued,) if r == 0 else ()) for r in range(2)]
    try:
        commits: list[list] = [[], []]
        for i, tag in enumerate(tags[:3]):
            for ck in cks:
                ck.save(_state(i), f"{tag}/rank{ck.rank}.pt", group=tag)
                commits[ck.rank].append(ck.commit(tag))
            assert (hold0.entered, hold1.entered, queued.seen)[i].wait(60)  # rank 0's step 100 held, rank 1's
            # step 200 held, then rank 0's step 300 queued behind its step 200: that one is dropped
        hold0.release.set()  # step 100 publishes; rank 0 dropped step 200 for step 300
        if not with_store:  # rank 0 ends the attempt on its own dropped file (a store waits for every rank)
            assert commits[0][1].wait(60).superseded and not commits[0][2].wait(60).superseded
            own0, own1 = (Path(cks[0].local_path(f"{tags[1]}/rank{r}.pt")) for r in range(2))
            assert not own0.exists() and own1.exists()  # rank 1 is still uploading its file of step 200
        hold1.release.set()
        for c in commits:
            assert c[1].wait(60).superseded and not c[2].wait(60).superseded
        for ck in cks:
            ck.save(_state(3), f"{tags[3]}/rank{ck.rank}.pt", group=tags[3])
        for h in [ck.commit(tags[3]) for ck in cks]:
            h.wait(60)
        assert [os.path.isdir(cks[0].local_path(t)) for t in tags] == [False, False, False, True]
        assert fastckpt.latest(str(run)) == tags[3]
        # at the home, rank 0 deleted the dropped attempt's records once every rank announced it
        # through the store; without one, rank 1 may still read them there (docs/burst-buffer.md)
        assert os.path.isdir(tags[1]) == (not with_store)
    finally:
        hold0.release.set()
        hold1.release.set()
        for ck in cks:
            ck.close()


def test_a_rank_whose_group_copy_another_rank_trimmed_still_commits(tmp_path: Path) -> None:
    """Rank 1 is giving the burst-buffer copy of step 100 its manifest when rank 0, on
    the same node, trims that copy (keep_local=1, step 200 is durable). Before, rank 1's commit
    of step 100, published at its home, failed as "removed"; now it succeeds, and the trimmed
    copy is not brought back."""
    nvme, run = str(tmp_path / "nvme"), tmp_path / "run"
    tags = [str(run / f"global_step{s}") for s in (100, 200)]
    entered, release = threading.Event(), threading.Event()

    def hold_local_manifest(op: str, path: str) -> None:  # rank 1 writes step 100's manifest into the burst buffer
        manifest = os.path.join(mirror_path(nvme, tags[0]), P.GROUP_MANIFEST)
        if op == "write_small" and manifest in (path, final_path(path)):
            entered.set()
            assert release.wait(60)

    cks = [fastckpt.Checkpointer(rank=r, world_size=2, local_dir=nvme, keep_local=1, overhead_budget=0.99,
                                 ops=FaultyOps(on_call=hold_local_manifest) if r else None) for r in range(2)]
    try:
        commits = []
        for tag in tags:
            for ck in cks:
                ck.save(_state(0), f"{tag}/rank{ck.rank}.pt", group=tag)
            commits.append([ck.commit(tag) for ck in cks])
            if tag == tags[0]:
                assert entered.wait(60)  # step 100 is published; rank 1 is writing its local manifest
                commits[0][0].wait(60)
        assert commits[1][0].wait(60).durable_s is not None  # rank 0 trimmed step 100's copy
        assert not os.path.exists(mirror_path(nvme, tags[0]))
        release.set()
        assert commits[0][1].wait(60).durable_s is not None and commits[1][1].wait(60).durable_s is not None
        assert not os.path.exists(mirror_path(nvme, tags[0])) and fastckpt.latest(str(run)) == tags[1]
    finally:
        release.set()
        for ck in cks:
            ck.close()


def test_the_files_a_dropped_group_copied_home_before_it_was_dropped_are_deleted(tmp_path: Path) -> None:
    """Coalescing drops a group's queued files once its first file was already copied home: the
    group is never published, so retention never lists it, and that copy stayed at the home for
    good (six such directories in an 8-step run with keep_persistent=1, 2-3 full files each). Its
    records (``.fastckpt/``) stayed too, and with them the tag's directory, which ``ls`` listed
    as incomplete: everything of it goes now."""
    nvme, run = str(tmp_path / "nvme"), str(tmp_path / "run")
    tags = [os.path.join(run, f"step-{i}") for i in (1, 2, 3)]
    ops = FaultyOps()
    gate = ops.gate("preadv", path_contains=mirror_path(nvme, os.path.join(tags[1], "m.pt")))
    queued = Queued(os.path.join(tags[2], "o.pt"))
    with fastckpt.Checkpointer(local_dir=nvme, ops=ops, replicate_workers=1, keep_persistent=1,
                               sinks=(queued,)) as ck:
        commits = []
        try:
            for i, tag in enumerate(tags):
                for name in ("m.pt", "o.pt"):
                    ck.save(_state(i), os.path.join(tag, name), group=tag)
                commits.append(ck.commit(tag, step=i + 1))
                if i == 1:
                    assert gate.wait_entered()  # step-2/m.pt is being copied home; step-2/o.pt waits
            assert queued.seen.wait(60)  # step 3 is queued: step-2/o.pt is dropped
        finally:
            gate.open()
        assert commits[1].wait().superseded
        assert commits[2].wait().durable_s is not None
    assert fastckpt.latest(run) == tags[2]
    assert not os.path.exists(tags[1])  # was ['m.pt', '.fastckpt'], then ['.fastckpt']: never deleted
    assert sorted(os.listdir(run)) == ["latest", "step-3"]
