"""Run by test_lightning_deepspeed.py: Lightning's DeepSpeedStrategy (ZeRO-2), 2 CPU processes.

Lightning's DeepSpeedStrategy refuses CPU in three places that are not about checkpointing:
``setup_environment`` raises "The DeepSpeed strategy is only supported on CUDA GPUs",
``setup_distributed`` checks CUDA device indices, and ``deepspeed.initialize`` is given
``root_device.index`` (None for a CPU device). ``CPUDeepSpeedStrategy`` relaxes exactly those;
everything checkpoint-related (``save_checkpoint`` -> ``deepspeed_engine.save_checkpoint``, loading,
``remove_checkpoint``) is Lightning's own code.

Three fits, as in the DDP script: a reference, a run stopped after one epoch, and one resumed
from "last", both with the lazy snapshot (the engine's optimizer step waits for the copy). The
module's hyper-parameters hold a ``pathlib.Path``, which the resume unpickles (the engine loads
with ``weights_only=False`` on this path, as DeepSpeed's own). Each rank writes its final
weights; rank 0 writes a summary.
"""

from __future__ import annotations

import faulthandler
import json
import os
import pathlib
import sys
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import lightning as L
import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from fastckpt import FastCkptIO
from tests.integration._exit import leave
from tests.integration.test_lightning import SpyLogger, loader

STEPS_PER_EPOCH = 4  # 32 samples, 2 ranks, batch 4


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # skips only the CUDA-accelerator check

    def setup_distributed(self) -> None:  # as DeepSpeedStrategy's, minus the CUDA index check
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu", self.local_rank)  # deepspeed.initialize needs an index


class Model(L.LightningModule):  # DeepSpeed wants one optimizer and no BatchNorm subtleties
    def __init__(self, data_dir: pathlib.Path = pathlib.Path("/data")) -> None:
        super().__init__()
        self.save_hyperparameters()  # in every checkpoint's client_state: a Path is no plain type
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer(root: str, max_steps: int, logger: object = False, lazy: bool = False) -> L.Trainer:
    return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=2, strategy=CPUDeepSpeedStrategy(stage=2),
                     plugins=[FastCkptIO(local_dir=os.path.join(root, "nvme"), lazy_snapshot=lazy)], logger=logger,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                     callbacks=[ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=STEPS_PER_EPOCH,
                                                save_top_k=1, monitor="step", mode="max", save_last=True)])


def main(out: str) -> None:
    faulthandler.dump_traceback_later(float(os.environ.get("FASTCKPT_TEST_WATCHDOG_S", "200")), exit=True)
    warnings.filterwarnings("ignore")
    spy = SpyLogger()
    L.seed_everything(0, verbose=False)
    ref = Model()
    t_ref = trainer(os.path.join(out, "ref"), 3 * STEPS_PER_EPOCH, logger=spy)
    t_ref.fit(ref, loader())
    engine_name = type(t_ref.strategy.deepspeed_engine.checkpoint_engine).__name__

    L.seed_everything(0, verbose=False)
    trainer(os.path.join(out, "run"), STEPS_PER_EPOCH, lazy=True).fit(Model(), loader())
    L.seed_everything(0, verbose=False)
    resumed = Model()
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)  # the checkpoint must restore the weights
    t_res = trainer(os.path.join(out, "run"), 3 * STEPS_PER_EPOCH, lazy=True)
    t_res.fit(resumed, loader(), ckpt_path="last")
    fenced = "step" in vars(t_res.strategy.deepspeed_engine.optimizer)  # StepFence, on the instance

    rank = t_res.global_rank
    torch.save({"ref": ref.state_dict(), "resumed": resumed.state_dict()}, os.path.join(out, f"weights-rank{rank}.pt"))
    if rank == 0:
        summary = {"engine": engine_name, "ckpt_rows": spy.ckpt_rows(), "global_step": t_res.global_step,
                   "ref_fenced": "step" in vars(t_ref.strategy.deepspeed_engine.optimizer), "run_fenced": fenced,
                   "ref_files": sorted(os.listdir(os.path.join(out, "ref", "ckpt"))),
                   "run_files": sorted(os.listdir(os.path.join(out, "run", "ckpt")))}
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f)


if __name__ == "__main__":
    main(sys.argv[1])
    leave()  # not through the interpreter's finalization: see _exit.leave
