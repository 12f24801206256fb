"""Lightning + fastckpt on the CPU: checkpoints every N steps through FastCkptIO.

    .venv/bin/python examples/lightning/train.py [--steps 200] [--every 25] [--local-dir DIR] [--lazy]

Trains a small MLP regressor (about 40 MB of weights, 120 MB of checkpoint with Adam's state)
with an unchanged ``ModelCheckpoint``; the only fastckpt line is the plugin. The per-save numbers
come back through the Trainer's logger (a CSVLogger here, ``ckpt/*`` columns), and the run ends
with the overhead fastckpt measured and a resume from ``last.ckpt``.
"""

from __future__ import annotations

import argparse
import csv
import os
import time
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from fastckpt import FastCkptIO


class MLP(L.LightningModule):
    def __init__(self, width: int = 1536, depth: int = 4) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = [torch.nn.Linear(64, width), torch.nn.GELU()]
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def data(n: int = 4096) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 64, generator=g)
    y = x.pow(2).sum(1, keepdim=True).sqrt()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=25, help="checkpoint every N training steps")
    ap.add_argument("--out", default="lightning_ckpt", help="ModelCheckpoint dirpath (the durable home)")
    ap.add_argument("--local-dir", default=None, help="burst buffer on node-local NVMe")
    ap.add_argument("--lazy", action="store_true", help="lazy snapshot (overlaps the next forward/backward)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", module="lightning")
    torch.manual_seed(0)

    io = FastCkptIO(local_dir=args.local_dir, lazy_snapshot=args.lazy)
    logger = CSVLogger(os.path.join(args.out, "logs"), name="", version="")
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, plugins=[io], logger=logger,
                        log_every_n_steps=10, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ModelCheckpoint(dirpath=args.out, every_n_train_steps=args.every, save_top_k=3,
                                                   monitor="step", mode="max", save_last="link")])
    model = MLP()
    t0 = time.perf_counter()
    trainer.fit(model, data())
    wall = time.perf_counter() - t0

    print(f"\n{'step':>6} {'blocked ms':>11} {'durable ms':>11} {'MB':>8} {'GB/s':>6} {'overhead %':>11}")
    with open(logger.experiment.metrics_file_path, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("ckpt/blocked_s"):
                durable = float(row["ckpt/durable_s"]) * 1e3 if row.get("ckpt/durable_s") else float("nan")
                print(f"{float(row['ckpt/step']):>6.0f} {float(row['ckpt/blocked_s']) * 1e3:>11.1f} {durable:>11.1f} "
                      f"{float(row['ckpt/GB']) * 1e3:>8.1f} {float(row['ckpt/write_GBps']):>6.2f} "
                      f"{float(row['ckpt/overhead_pct']):>11.2f}")
    st = io.stats()
    print(f"\n{st.saves} saves in a {wall:.1f} s fit: blocked {st.blocked_s:.3f} s in total, checkpoint overhead "
          f"{st.overhead:.2%} of wall time (budget {st.overhead_budget:.0%}); kept: {sorted(os.listdir(args.out))}")

    t1 = time.perf_counter()
    resumed = L.Trainer(max_steps=args.steps, accelerator="cpu", plugins=[FastCkptIO(local_dir=args.local_dir)],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    resumed.fit(MLP(), data(), ckpt_path=os.path.join(args.out, "last.ckpt"))  # restores, then stops: max_steps
    pairs = zip(model.state_dict().values(), resumed.lightning_module.state_dict().values())
    same = all(torch.equal(a, b) for a, b in pairs)
    print(f"resumed from last.ckpt in {time.perf_counter() - t1:.2f} s: global_step={resumed.global_step}, "
          f"weights match: {same}")


if __name__ == "__main__":
    main()
