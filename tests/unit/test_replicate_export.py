"""``replicate_policy="coalesce"`` and exports: a model export (``save(..., export=True)``) is a file
beside the checkpoints, not one of them. It counted as a newer checkpoint: saving it dropped the
training checkpoint still waiting for its upload (never published at its home; a resume went back
to the one before), and a later checkpoint dropped a queued export. Now an export only replaces a
queued save of its own path. The first upload is held by a FaultyOps hook (one worker), so the
later saves wait in the queue: no timing."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import fastckpt
from fastckpt.io.atomic import final_path
from fastckpt.testing import FaultyOps
from tests.helpers import Queued


def _one_worker(tmp_path, first: str, held: threading.Event, release: threading.Event,  # noqa: ANN001
                queued: Queued) -> fastckpt.Checkpointer:
    """A burst-buffer Checkpointer with one upload at a time, whose upload of ``first`` sets
    ``held`` and waits for ``release``: the saves after it wait in the queue."""
    def hold_first_upload(op: str, path: str) -> None:
        if op == "replace" and (final_path(path) or path) == first and not release.is_set():
            held.set()
            assert release.wait(60)

    return fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), ops=FaultyOps(on_call=hold_first_upload),
                                 replicate_workers=1, sinks=(queued,), rank=0, world_size=1, overhead_budget=0.99)


@pytest.mark.parametrize("order", [("ckpt", "export"), ("export", "ckpt"), ("export", "export")])
def test_an_export_and_a_checkpoint_never_coalesce(tmp_path, order) -> None:  # noqa: ANN001
    home, held, release = tmp_path / "run", threading.Event(), threading.Event()
    first, paths = str(home / "step1.pt"), {"ckpt": str(home / "step2.pt"), "export": str(tmp_path / "model.pt")}
    queued = Queued()
    ck = _one_worker(tmp_path, first, held, release, queued)
    try:
        ck.save({"w": torch.zeros(8)}, first)
        assert held.wait(60)
        handles = []
        for i, kind in enumerate(order):
            handles.append(ck.save({"w": torch.full((8,), float(i))}, paths[kind], export=kind == "export"))
            assert queued.wait(paths[kind], order[:i + 1].count(kind))
    finally:
        release.set()
    recs = [h.wait(60) for h in handles]
    ck.close()
    if order == ("export", "export"):  # the same file: its older save's bytes are replaced anyway
        assert [r.superseded for r in recs] == [True, False]
    else:  # was: the later one dropped the earlier (an export as a newer checkpoint, or a checkpoint)
        assert [r.superseded for r in recs] == [False, False] and all(r.durable_s is not None for r in recs)
        assert os.path.exists(paths["ckpt"]) and os.path.exists(paths["export"])
    assert torch.load(paths[order[-1]], weights_only=True)["w"][0] == len(order) - 1


def test_the_files_of_one_save_block_never_coalesce_together(tmp_path) -> None:  # noqa: ANN001
    """A checkpoint of several single files saved in one ``one_save()`` (model, optimizer, extra):
    each file dropped the queued upload of the file saved before it, so only the last file of the
    checkpoint reached its home. Now a block's files are one checkpoint: all land, and a newer
    block still drops an older one's queued files."""
    home, held, release = tmp_path / "run", threading.Event(), threading.Event()
    first = str(home / "step0" / "model.pt")
    queued = Queued()
    ck = _one_worker(tmp_path, first, held, release, queued)
    names = ("model.pt", "optim.pt", "extra.pt")
    try:
        ck.save({"w": torch.zeros(8)}, first)
        assert held.wait(60)
        blocks = []
        for step in (1, 2):
            with ck.one_save():
                blocks.append([ck.save({"w": torch.full((8,), float(step))}, str(home / f"step{step}" / n))
                               for n in names])
            for n in names:
                assert queued.wait(str(home / f"step{step}" / n), 1)
    finally:
        release.set()
    recs = [[h.wait(60) for h in hs] for hs in blocks]
    ck.close()
    assert [r.superseded for r in recs[0]] == [True] * 3  # the newer checkpoint drops the older, whole
    assert [r.superseded for r in recs[1]] == [False] * 3  # was [True, True, False]: one file of three
    for n in names:
        assert torch.load(str(home / "step2" / n), weights_only=True)["w"][0] == 2


def test_a_block_whose_upload_started_is_never_split(tmp_path) -> None:  # noqa: ANN001
    """Once a file of a ``one_save()`` block is uploading, a newer block dropped only the block's
    queued files: the home kept part of a checkpoint (model and optimizer, no extra), and under a
    steady backlog no block but the last landed whole. A started block now lands whole."""
    home, release, held_cv, held = tmp_path / "run", threading.Event(), threading.Condition(), set()
    names = ("model.pt", "optim.pt", "extra.pt")
    slow = {str(home / "1" / n) for n in names[:2]}

    def hold(op: str, path: str) -> None:  # both workers upload block 1's first two files; its third waits
        if op == "replace" and (final_path(path) or path) in slow and not release.is_set():
            with held_cv:
                held.add(final_path(path) or path)
                held_cv.notify_all()
            assert release.wait(60)

    queued = Queued()
    ck = fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), ops=FaultyOps(on_call=hold), replicate_workers=2,
                               sinks=(queued,), rank=0, world_size=1, overhead_budget=0.99)
    handles = []
    try:
        for step in (1, 2):
            with ck.one_save():
                handles += [ck.save({"w": torch.full((8,), float(step))}, str(home / str(step) / n)) for n in names]
            for n in names:
                assert queued.wait(str(home / str(step) / n), 1)
            if step == 1:
                with held_cv:
                    assert held_cv.wait_for(lambda: held == slow, timeout=60)
    finally:
        release.set()
    recs = [h.wait(60) for h in handles]
    ck.close()
    assert [r.superseded for r in recs] == [False] * 6  # was: block 1's extra.pt superseded
    assert all((home / str(step) / n).exists() for step in (1, 2) for n in names)
