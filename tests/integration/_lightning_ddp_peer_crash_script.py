"""Run by test_lightning_ddp.py: Trainer(strategy="ddp", devices=2) on CPU (gloo), FastCkptIO on a
burst buffer whose uploads are slow (``replicate_bandwidth_Bps``), and rank 1 fails two steps
after rank 0's save of step 4 returned, while that save's upload still runs.

Lightning's launcher (this script, run again for rank 1) watches rank 1: once it exits with an
error, rank 0 is SIGKILLed within about 5 s, stuck as it is in the next collective. Rank 0 writes
ROOT/returned once its save of step 4 has returned; the test looks for the file at the dirpath.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from fastckpt import FastCkptIO
from tests.integration.test_lightning import TinyModel, loader

FAIL_AT = 6  # rank 1; ModelCheckpoint saves at step 4 (4 steps per epoch: 32 samples, 2 ranks, batch 4)


class Failing(TinyModel):
    def __init__(self) -> None:
        super().__init__()
        # 20 MB in the checkpoint, not trained (DDP and Adam leave it alone): an upload of about 8 s
        self.big = torch.nn.Parameter(torch.zeros(5_000_000), requires_grad=False)

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.trainer.global_step == FAIL_AT:
            raise RuntimeError("rank 1 fails (an OOM, a NaN check, a bad batch)")
        return super().training_step(batch, batch_idx)


class Returned(Callback):
    """Rank 0: ROOT/returned once the save of step 4 has returned (the step after it began)."""

    def __init__(self, root: str) -> None:
        self.root = root

    def on_train_batch_start(self, trainer, *args):  # noqa: ANN001, ANN002
        if trainer.global_rank == 0 and trainer.global_step == 5:
            with open(os.path.join(self.root, "returned"), "w") as f:
                f.write("step 4")


def main(root: str) -> None:
    faulthandler.dump_traceback_later(float(os.environ.get("FASTCKPT_TEST_WATCHDOG_S", "100")), exit=True)
    warnings.filterwarnings("ignore")
    io = FastCkptIO(local_dir=os.path.join(root, "nvme"), replicate_bandwidth_Bps=2.5e6)
    mc = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=4, save_top_k=-1)
    L.Trainer(max_steps=12, accelerator="cpu", devices=2, strategy="ddp", plugins=[io], logger=False,
              enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
              callbacks=[mc, Returned(root)]).fit(Failing(), loader())


if __name__ == "__main__":
    main(sys.argv[1])
