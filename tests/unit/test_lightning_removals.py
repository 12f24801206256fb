"""The Lightning plugin's queued deletions: a failed one is raised even when a later one is
queued under the same key before the failure was harvested; one of a file a link names waits for
the link to move, wherever below it the file is."""

from __future__ import annotations

import errno
import os
from concurrent.futures import wait
from types import SimpleNamespace

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


def test_a_file_in_a_subfolder_is_kept_while_last_ckpt_above_it_names_it(tmp_path) -> None:
    """ModelCheckpoint(filename="{epoch}/{step}", save_last="link") puts the top-k files in a
    subfolder of its dirpath and last.ckpt in the dirpath. Once, only the deleted file's own folder
    was searched for a link naming it, so it was deleted at once and a kill before the link moved
    left last.ckpt dangling. Here, as in a resumed fit, the deletion comes before any link request:
    the ModelCheckpoint's dirpath alone tells where last.ckpt is."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    home = tmp_path / "ckpt"
    old, new, last = str(home / "epoch=0" / "step=1.ckpt"), str(home / "epoch=0" / "step=2.ckpt"), home / "last.ckpt"
    with fastckpt.Checkpointer() as ck:
        for path in (old, new):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            ck.save({"w": torch.ones(4)}, path).wait()
        os.symlink(os.path.join("epoch=0", "step=1.ckpt"), last)
        io = FastCkptIO(checkpointer=ck)
        trainer = SimpleNamespace(checkpoint_callbacks=[ModelCheckpoint(dirpath=str(home))])
        io._trainer_ref, io._in_fit = lambda: trainer, True
        io.remove_checkpoint(old)
        wait(list(io._removals.values()))
        assert os.path.exists(old) and list(io._deferred) == [old]  # last.ckpt still names it
        tmp = home / "last.ckpt.new"
        os.symlink(os.path.join("epoch=0", "step=2.ckpt"), tmp)
        os.replace(tmp, last)  # Lightning moved the link (a file this fit did not save)
        io._moved(str(last))
        wait(list(io._removals.values()))
        assert not os.path.exists(old) and os.path.exists(new) and io._deferred == {}
        io._raise_removal_errors()
        io._remover.shutdown()
