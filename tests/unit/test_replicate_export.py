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


@pytest.mark.parametrize("order", [("ckpt", "export"), ("export", "ckpt"), ("export", "export")])
def test_an_export_and_a_checkpoint_never_coalesce(tmp_path, order) -> None:  # noqa: ANN001
    home, held, release = tmp_path / "run", threading.Event(), threading.Event()
    first, paths = str(home / "step1.pt"), {"ckpt": str(home / "step2.pt"), "export": str(tmp_path / "model.pt")}

    def hold_first_upload(op: str, path: str) -> None:
        if op == "replace" and (final_path(path) or path) == first and not release.is_set():
            held.set()
            assert release.wait(60)

    queued = Queued()
    ck = fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), ops=FaultyOps(on_call=hold_first_upload),
                               replicate_workers=1, sinks=(queued,), rank=0, world_size=1, overhead_budget=0.99)
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
