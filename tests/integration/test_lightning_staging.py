"""FastCkptIO and the core's staging buffers: the reservation after the first optimizer step,
headroom (no second allocation when the checkpoint grows), and a second buffer for
``ModelCheckpoint(save_last=True)``."""

from __future__ import annotations

import os
import threading
import warnings

import pytest

pytest.importorskip("lightning")
import lightning as L
from lightning.pytorch.callbacks import Callback

import fastckpt.checkpointer as core
from fastckpt.integrations.lightning import FastCkptIO
from fastckpt.save import staging
from fastckpt.testing import FaultyOps
from tests.integration.test_lightning import TinyModel, loader, make_trainer


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_staging_buffer_is_reserved_off_the_training_thread_and_allocated_once(tmp_path, monkeypatch, lazy):
    """The callback reserves the buffer after step 1; the first save (at step 1, right after the
    reservation started) adopts it, and later saves, whose checkpoints grow by ModelCheckpoint's
    bookkeeping, reuse it: one allocation in the whole fit, on the reservation thread."""
    allocs: list[str] = []
    real = staging._new_buffer

    def spy(capacity: int, pinned: bool) -> staging.StagingBuffer:
        allocs.append(threading.current_thread().name)
        return real(capacity, pinned)

    monkeypatch.setattr(staging, "_new_buffer", spy)
    io = FastCkptIO(lazy_snapshot=lazy)
    trainer = make_trainer(str(tmp_path), io, 6, every_n_train_steps=1, save_top_k=2, monitor="step", mode="max")
    trainer.fit(TinyModel(), loader())
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["epoch=0-step=5.ckpt", "epoch=0-step=6.ckpt"]
    assert allocs == ["fastckpt-reserve"]
    assert io.stats().saves == 6


def test_a_checkpointer_of_ones_own_is_reserved_on_too(tmp_path, monkeypatch):
    """A Checkpointer passed in gets the reservation as well, with its own staging_buffers."""
    calls: list[int] = []
    real = core.Checkpointer.reserve

    def spy(self, nbytes, *, pinned=False):
        calls.append(nbytes)
        return real(self, nbytes, pinned=pinned)

    monkeypatch.setattr(core.Checkpointer, "reserve", spy)
    with core.Checkpointer(staging_buffers=2) as ck:
        make_trainer(str(tmp_path), FastCkptIO(checkpointer=ck), 2, every_n_train_steps=2).fit(TinyModel(), loader())
        assert len(calls) == 1 and len(ck._staging.capacities()) == 2
        assert calls[0] >= sum(p.numel() * 4 for p in TinyModel().parameters())


@pytest.mark.parametrize(("staging_buffers", "files"), [(None, ["epoch=0-step=2.ckpt", "last.ckpt"]),
                                                     (1, ["epoch=0-step=2.ckpt"])], ids=["auto", "one"])
def test_save_last_true_does_not_wait_for_the_first_write(tmp_path, monkeypatch, staging_buffers, files):
    """save_last=True saves step 2 twice while the first file's write is held in flight. With
    the default (two staging buffers for save_last=True) last.ckpt gets the second buffer at
    once; with one buffer it would wait for that write (here, with when_busy="skip", it is
    dropped instead, which shows the wait without timing it)."""
    ops = FaultyOps()
    gate = ops.gate("pwrite", path_contains="step=2.ckpt")
    monkeypatch.setattr(core, "FileOps", lambda: ops)
    io = FastCkptIO(when_busy="skip", staging_buffers=staging_buffers)
    observed: dict = {}

    class OpenAtStep3(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                observed["held"] = gate.wait_entered(30)
                observed["buffers"] = io._ck.config.staging_buffers
                gate.open()

    trainer = make_trainer(str(tmp_path), io, 3, callbacks=[OpenAtStep3()], every_n_train_steps=2, save_top_k=1,
                           monitor="step", mode="max", save_last=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TinyModel(), loader())
    gate.open()
    assert observed == {"held": True, "buffers": 2 if staging_buffers is None else 1}
    skipped = 2 - len(files)
    assert io.stats().skipped == skipped
    assert sum("skipped save" in str(w.message) for w in caught) == skipped
    assert sorted(os.listdir(tmp_path / "ckpt")) == files


def test_save_last_link_keeps_one_buffer(tmp_path):
    io = FastCkptIO()
    seen: list[int] = []

    class Look(Callback):
        def on_train_start(self, trainer, pl_module):
            seen.append(io._ck.config.staging_buffers)

    make_trainer(str(tmp_path), io, 2, callbacks=[Look()], every_n_train_steps=2, save_last="link").fit(
        TinyModel(), loader())
    assert seen == [1]


def test_staging_buffers_is_validated_and_pickled():
    import pickle

    from fastckpt.errors import ConfigError

    with pytest.raises(ConfigError, match="staging_buffers=0"):
        FastCkptIO(staging_buffers=0)
    with core.Checkpointer() as ck, pytest.raises(ConfigError, match="staging_buffers"):
        FastCkptIO(checkpointer=ck, staging_buffers=2)
    assert pickle.loads(pickle.dumps(FastCkptIO(staging_buffers=2))).staging_buffers == 2
    L.seed_everything(0, verbose=False)
