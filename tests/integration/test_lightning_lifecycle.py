"""FastCkptIO inside Lightning's own expectations (issue #9 items 12 and 13): no thread of
fastckpt outlives the Trainer, and ModelCheckpoint's version suffixes never reuse the name of a
checkpoint still in flight."""

from __future__ import annotations

import os
import threading

import pytest

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from fastckpt.integrations.lightning import FastCkptIO
from fastckpt.testing import FaultyOps
from tests.integration.test_lightning import TinyModel, loader, make_trainer


def _fastckpt_threads(before: frozenset) -> list[str]:
    """fastckpt's threads alive now that were not in ``before``. An earlier test's Checkpointer
    that was dropped without close() keeps its idle threads until the garbage collector frees it;
    those are not this Trainer's."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("fastckpt") and t not in before)


class Boom(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 5:
            raise RuntimeError("boom")


@pytest.mark.parametrize("how", ["fit", "validate", "exception in fit"])
def test_no_fastckpt_thread_outlives_the_trainer(tmp_path, how: str) -> None:
    before = frozenset(threading.enumerate())
    io = FastCkptIO(local_dir=str(tmp_path / "nvme"))  # burst buffer: replication threads too
    trainer = make_trainer(str(tmp_path), io, max_steps=6, callbacks=[Boom()] if how == "exception in fit" else [],
                           every_n_train_steps=2, save_top_k=-1)
    model = TinyModel()
    model.validation_step = lambda batch, batch_idx: None
    if how == "exception in fit":
        with pytest.raises(RuntimeError, match="boom"):
            trainer.fit(model, loader())
    elif how == "fit":
        trainer.fit(model, loader())
    else:
        trainer.fit(model, loader())
        trainer.validate(model, loader())
    assert _fastckpt_threads(before) == []


class OpenAtEnd(Callback):
    def __init__(self, gate) -> None:  # noqa: ANN001
        self.gate = gate

    def on_train_end(self, trainer, pl_module):
        self.gate.open()  # every save of the fit was chosen a name while in flight


def test_version_suffixes_count_saves_in_flight(tmp_path) -> None:
    """ModelCheckpoint(filename="test", save_top_k=-1, monitor=...) names later checkpoints test-v1.ckpt,
    test-v2.ckpt... only if the earlier file exists. No file is renamed into place until the fit
    ends, so every earlier save is still in flight when the next name is chosen."""
    from fastckpt import Checkpointer

    ops = FaultyOps()
    gate = ops.gate("replace")
    ck = Checkpointer(ops=ops, replicate_policy="all", staging_buffers=4)  # the held saves each keep one
    io = FastCkptIO(checkpointer=ck)
    mc = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), filename="test", save_top_k=-1, every_n_train_steps=2,
                         monitor="step", mode="max")
    trainer = L.Trainer(max_steps=8, accelerator="cpu", devices=1, plugins=[io], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        num_sanity_val_steps=0, callbacks=[OpenAtEnd(gate), mc])
    try:
        trainer.fit(TinyModel(), loader())
    finally:
        gate.open()
        ck.close()
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names == ["test-v1.ckpt", "test-v2.ckpt", "test-v3.ckpt", "test.ckpt"]
    assert len(mc.best_k_models) == 4
    assert "file_exists" not in mc.__dict__  # restored at teardown
