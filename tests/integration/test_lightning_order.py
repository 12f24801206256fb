"""FastCkptIO with a burst buffer makes saves final in call order, as TorchCheckpointIO does.

``ModelCheckpoint`` saves ``step=N.ckpt``, then ``last.ckpt`` of the same state, which names the
top-k file as its ``best_model_path``. With two replication workers ``last.ckpt`` landed first,
and a kill then left it naming a file that never arrived. The home rename of ``step=1.ckpt`` is
held (FaultyOps hook) until ``last.ckpt`` is queued: it must wait behind it, and when it lands
its best file must already be there.

Two ``ModelCheckpoint``s' last files, made final back to back, must differ in mtime, newer state
newer (``io.ops.final_mtime_ns``), in both the direct and the burst-buffer mode.
"""

from __future__ import annotations

import os
import threading

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from fastckpt.integrations.lightning import FastCkptIO
from fastckpt.io.atomic import final_path
from fastckpt.testing import FaultyOps
from tests.integration.test_lightning import TinyModel, loader


def test_last_ckpt_lands_only_after_the_top_k_file_it_names(tmp_path) -> None:  # noqa: ANN001
    home = str(tmp_path / "ckpt")
    first, last = os.path.join(home, "step=1.ckpt"), os.path.join(home, "last.ckpt")
    queued, details, first_present_at_last = threading.Event(), [], []

    class Sink:
        def emit(self, ev) -> None:  # noqa: ANN001
            if ev.name == "queued" and ev.path == last and not queued.is_set():
                details.append(ev.detail or "")
                queued.set()

    def hook(op: str, path: str) -> None:
        p = final_path(path) or path
        if op == "replace" and p == first and path.startswith(home):
            assert queued.wait(60)  # step=1.ckpt is still being replicated when last.ckpt arrives
        if op == "replace" and p == last and not first_present_at_last:
            first_present_at_last.append(os.path.exists(first))

    io = FastCkptIO(local_dir=str(tmp_path / "nvme"), ops=FaultyOps(on_call=hook), sinks=(Sink(),))
    mc = ModelCheckpoint(dirpath=home, filename="{step}", save_top_k=1, save_last=True, every_n_train_steps=1)
    trainer = L.Trainer(max_steps=2, plugins=[io], callbacks=[mc], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", limit_val_batches=0)
    trainer.fit(TinyModel(), loader())
    assert "behind=earlier saves" in details[0]  # was: copied at once, beside step=1.ckpt
    assert first_present_at_last == [True]
    ck = torch.load(last, weights_only=False)
    best = next(v for k, v in ck["callbacks"].items() if k.startswith("ModelCheckpoint"))["best_model_path"]
    assert os.path.exists(best)


def _two_last_files(root: str, local_dir: str | None) -> L.Trainer:
    """Two ``ModelCheckpoint``s with last files: ``a/last.ckpt`` every 2 steps (its newest at step
    14), ``b/last.ckpt`` at each epoch's end, a link to the step-15 file."""
    cbs = [ModelCheckpoint(dirpath=f"{root}/a", every_n_train_steps=2, save_last=True),
           ModelCheckpoint(dirpath=f"{root}/b", every_n_epochs=1, save_last="link")]
    return L.Trainer(max_epochs=3, limit_train_batches=5, limit_val_batches=2, callbacks=cbs,
                     plugins=[FastCkptIO(local_dir=local_dir)], logger=False, enable_progress_bar=False,
                     enable_model_summary=False, accelerator="cpu")


@pytest.mark.parametrize("local", [False, True], ids=["direct", "burst-buffer"])
def test_the_newer_of_two_last_files_has_the_newer_mtime(tmp_path, local) -> None:  # noqa: ANN001
    """``ckpt_path="last"`` takes the newest mtime among every callback's last files (a tie goes
    to either). The two were made final back to back, and the kernel's coarse clock gave them the
    same mtime in about half the fits here (both modes): a resume could start from step 14. Six
    fits (all six passed on the old code about once in a hundred); the last one is resumed from."""
    for fit in range(6):
        root, nvme = str(tmp_path / f"fit{fit}"), str(tmp_path / f"nvme{fit}") if local else None
        _two_last_files(root, nvme).fit(BoringModel())
        a, b = f"{root}/a/last.ckpt", f"{root}/b/last.ckpt"
        assert [torch.load(p, weights_only=True)["global_step"] for p in (a, b)] == [14, 15]
        assert os.stat(a).st_mtime_ns < os.stat(b).st_mtime_ns, fit
    resumed = _two_last_files(root, nvme)
    resumed.fit(BoringModel(), ckpt_path="last")
    assert resumed.ckpt_path == b and resumed.global_step == 15
