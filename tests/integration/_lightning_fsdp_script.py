"""Run by test_lightning_fsdp.py: FSDPStrategy(state_dict_type="full"), 2 CPU processes (gloo);
and by tests/gpu/test_lightning_fsdp_cuda.py with ``FASTCKPT_TEST_FSDP_CUDA=1``: Lightning's
FSDPStrategy as it is (its own wrapping, FULL_SHARD) on the CUDA devices there are (up to 2).

Three things stand between Lightning's FSDPStrategy and a CPU, none about checkpoints:

- Lightning's accelerator connector refuses it with a type test, ``type(strategy) is
  FSDPStrategy`` ("The strategy `fsdp` requires a GPU accelerator"): ``CPUFSDPStrategy`` below is
  a subclass that overrides nothing.
- torch's FSDP on CPU needs ``device_id=torch.device("cpu")`` ("FSDP needs a non-CPU
  accelerator device" otherwise), but Lightning wraps the model with ``device_id=
  root_device.index``, None on CPU. So the model wraps its layers itself in ``configure_model``
  (Lightning's documented manual wrapping: it then wraps nothing more).
- With the parameters sharded (FULL_SHARD), torch 2.13 crashes (SIGSEGV, in FSDP's
  ``_full_post_state_dict_hook`` cloning a parameter) when Lightning gathers the full state
  dict with ``offload_to_cpu=True`` onto a CPU device. So the CPU run uses ``NO_SHARD``: every
  rank keeps whole parameters, and the rest of the path (FSDP's full-state-dict and optimizer
  state gathering to rank 0, Lightning's save and load) is the same. The GPU test shards.

Everything else is Lightning's and torch's own FSDP code: the full state dict gathered to rank 0,
rank 0 calling ``checkpoint_io.save_checkpoint``, and ``FSDPStrategy.load_checkpoint`` (which
reads the file itself and never calls CheckpointIO).

Three fits, as in the DDP script: an uninterrupted reference, a run stopped after one epoch,
and one resumed from "last" with other initial weights. Rank 0 writes the full state dicts
(weights and optimizer) of the reference and the resumed run, and a summary.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from fastckpt import FastCkptIO
from tests.integration._exit import leave
from tests.integration.test_lightning import SpyLogger, loader

CUDA = os.environ.get("FASTCKPT_TEST_FSDP_CUDA") == "1"
DEVICES = min(2, torch.cuda.device_count()) if CUDA else 2
STEPS_PER_EPOCH = 32 // (4 * DEVICES)  # 32 samples, batch 4 per rank


class CPUFSDPStrategy(FSDPStrategy):
    """FSDPStrategy, unchanged; only not of the exact type Lightning's CUDA check looks for."""


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def configure_model(self) -> None:
        if not CUDA and not isinstance(self.net, FullyShardedDataParallel):
            self.net = FullyShardedDataParallel(self.net, device_id=torch.device("cpu"), use_orig_params=True,
                                                sharding_strategy=ShardingStrategy.NO_SHARD)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def trainer(root: str, max_steps: int, logger: object = False) -> L.Trainer:
    strategy = FSDPStrategy(state_dict_type="full") if CUDA else CPUFSDPStrategy(state_dict_type="full")
    return L.Trainer(max_steps=max_steps, accelerator="cuda" if CUDA else "cpu", devices=DEVICES, strategy=strategy,
                     plugins=[FastCkptIO(local_dir=os.path.join(root, "nvme"))], logger=logger,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                     callbacks=[ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=STEPS_PER_EPOCH,
                                                save_top_k=1, monitor="step", mode="max", save_last=True)])


def full_state(t: L.Trainer) -> tuple[dict, dict]:
    """Weights and optimizer state, gathered to rank 0 (a collective: every rank calls it)."""
    return t.strategy.lightning_module_state_dict(), t.strategy.optimizer_state(t.optimizers[0])


class CountCheckpoints(L.Callback):
    """Rank 0, after each step (before that step's save): the checkpoints in ``directory``."""

    def __init__(self, directory: str) -> None:
        self.directory, self.counts = directory, []

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_rank == 0 and os.path.isdir(self.directory):
            self.counts.append(len([n for n in os.listdir(self.directory) if n != "last.ckpt"]))


def sharded_top_k(root: str) -> dict:
    """FSDP sharded: Lightning saves each checkpoint with dcp (never through CheckpointIO) and links
    last.ckpt itself; FastCkptIO deletes what save_top_k drops. Its deletion of a directory
    last.ckpt still named waited for a link only FastCkptIO makes, so every directory stayed
    until fit ended."""
    directory = os.path.join(root, "ckpt")
    count = CountCheckpoints(directory)
    t = L.Trainer(max_steps=6, accelerator="cpu", devices=DEVICES, strategy=CPUFSDPStrategy(state_dict_type="sharded"),
                  plugins=[FastCkptIO()], logger=False, enable_progress_bar=False, enable_model_summary=False,
                  default_root_dir=root, callbacks=[count, ModelCheckpoint(
                      dirpath=directory, every_n_train_steps=1, save_top_k=1, monitor="step", mode="max",
                      save_last="link")])
    t.fit(Model(), loader())
    if t.global_rank != 0:
        return {}
    import fastckpt

    return {"most": max(count.counts), "files": sorted(os.listdir(directory)),
            "latest": os.path.basename(fastckpt.latest(directory) or "")}


def main(out: str) -> None:
    faulthandler.dump_traceback_later(float(os.environ.get("FASTCKPT_TEST_WATCHDOG_S", "150")), exit=True)
    warnings.filterwarnings("ignore")
    spy = SpyLogger()
    L.seed_everything(0, verbose=False)
    t_ref = trainer(os.path.join(out, "ref"), 3 * STEPS_PER_EPOCH, logger=spy)
    t_ref.fit(Model(), loader())
    ref_w, ref_opt = full_state(t_ref)
    saved_by = type(t_ref.strategy.checkpoint_io).__name__

    L.seed_everything(0, verbose=False)
    trainer(os.path.join(out, "run"), STEPS_PER_EPOCH).fit(Model(), loader())
    L.seed_everything(0, verbose=False)
    resumed = Model()
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)
    t_res = trainer(os.path.join(out, "run"), 3 * STEPS_PER_EPOCH)
    t_res.fit(resumed, loader(), ckpt_path="last")
    res_w, res_opt = full_state(t_res)

    sharded = None if CUDA else sharded_top_k(os.path.join(out, "sharded"))

    if t_res.global_rank == 0:
        torch.save({"ref": ref_w, "resumed": res_w, "ref_opt": ref_opt, "resumed_opt": res_opt},
                   os.path.join(out, "weights.pt"))
        summary = {"ckpt_rows": spy.ckpt_rows(), "global_step": t_res.global_step, "saved_by": saved_by,
                   "steps_per_epoch": STEPS_PER_EPOCH,
                   "ref_files": sorted(os.listdir(os.path.join(out, "ref", "ckpt"))),
                   "run_files": sorted(os.listdir(os.path.join(out, "run", "ckpt"))), "sharded": sharded}
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f)


if __name__ == "__main__":
    main(sys.argv[1])
    leave()  # not through the interpreter's finalization: see _exit.leave
