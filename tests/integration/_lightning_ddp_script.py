"""Run by test_lightning_ddp.py: Trainer(strategy="ddp", devices=2) on CPU (gloo), FastCkptIO.

Lightning's launcher starts rank 1 by running this script again. Three fits: an uninterrupted
reference (lazy snapshot on), then a run stopped at an epoch boundary and one resumed from
"last". Rank 0 writes the final weights of the reference and the resumed run and a summary.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from fastckpt import FastCkptIO
from tests.integration._exit import leave
from tests.integration.test_lightning import SpyLogger, TinyModel, loader

STEPS_PER_EPOCH = 4  # 32 samples, 2 ranks, batch 4


def trainer(root: str, io: FastCkptIO, max_steps: int, logger: object = False) -> L.Trainer:
    return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=2, strategy="ddp", plugins=[io],
                     logger=logger, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                     callbacks=[ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=STEPS_PER_EPOCH,
                                                save_top_k=1, monitor="step", mode="max", save_last=True)])


def main(out: str) -> None:
    # a hung rank must not hang the test suite: print every thread's stack and exit
    faulthandler.dump_traceback_later(float(os.environ.get("FASTCKPT_TEST_WATCHDOG_S", "100")), exit=True)
    warnings.filterwarnings("ignore")
    spy = SpyLogger()
    L.seed_everything(0, verbose=False)
    ref = TinyModel()
    t_ref = trainer(os.path.join(out, "ref"), FastCkptIO(lazy_snapshot=True), 3 * STEPS_PER_EPOCH, logger=spy)
    t_ref.fit(ref, loader())

    L.seed_everything(0, verbose=False)
    trainer(os.path.join(out, "run"), FastCkptIO(local_dir=os.path.join(out, "nvme")), STEPS_PER_EPOCH).fit(
        TinyModel(), loader())
    # the same seed (Lightning's DistributedSampler takes its shuffle seed from it), other weights:
    # the checkpoint must restore them
    L.seed_everything(0, verbose=False)
    resumed = TinyModel()
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)
    t_res = trainer(os.path.join(out, "run"), FastCkptIO(local_dir=os.path.join(out, "nvme")), 3 * STEPS_PER_EPOCH)
    t_res.fit(resumed, loader(), ckpt_path="last")

    rank = t_res.global_rank
    torch.save({"ref": ref.state_dict(), "resumed": resumed.state_dict(),
                "ref_opt": t_ref.optimizers[0].state_dict(), "resumed_opt": t_res.optimizers[0].state_dict()},
               os.path.join(out, f"weights-rank{rank}.pt"))
    if rank == 0:
        summary = {"ckpt_rows": spy.ckpt_rows(), "global_step": t_res.global_step,
                   "ref_files": sorted(os.listdir(os.path.join(out, "ref", "ckpt"))),
                   "run_files": sorted(os.listdir(os.path.join(out, "run", "ckpt")))}
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f)


if __name__ == "__main__":
    main(sys.argv[1])
    leave()  # not through the interpreter's finalization: see _exit.leave
