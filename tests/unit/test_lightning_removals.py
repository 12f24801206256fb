"""The Lightning plugin's queued deletions: a failed one is raised even when a later one is
queued under the same key before the failure was harvested."""

from __future__ import annotations

import errno
from concurrent.futures import wait

import pytest
import torch

import fastckpt
from fastckpt.integrations.lightning import FastCkptIO
from fastckpt.testing import Fault, FaultyOps


def test_a_failed_deferred_deletion_is_raised_though_the_link_moved_again(tmp_path) -> None:
    path = str(tmp_path / "epoch=0-step=1.ckpt")
    ops = FaultyOps()
    with fastckpt.Checkpointer(ops=ops) as ck:
        ck.save({"w": torch.ones(4)}, path).wait()
        ops.inject(Fault("unlink", errno.EIO, path_contains="step=1"))
        io = FastCkptIO(checkpointer=ck)
        io._deferred[path] = ck  # its deletion waited for last.ckpt to move off it
        io._moved(str(tmp_path / "last.ckpt"))  # it moved: the deletion runs, and fails
        wait(list(io._removals.values()))
        io._moved(str(tmp_path / "last.ckpt"))  # it moved again before the next save harvested the failure
        wait(list(io._removals.values()))
        with pytest.raises(OSError, match="Input/output error"):
            io._raise_removal_errors()
        ops.assert_all_reached()
        io._remover.shutdown()
