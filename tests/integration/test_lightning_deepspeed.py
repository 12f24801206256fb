"""FastCkptIO with Lightning's DeepSpeedStrategy, which never calls CheckpointIO to save: the
plugin installs fastckpt's DeepSpeed engine on ``trainer.strategy.deepspeed_engine``.

Lightning's DeepSpeedStrategy refuses CPU outright (``test_deepspeed_strategy_refuses_cpu``
shows the real error), so the run relaxes its CUDA-only checks and nothing else; see
``_lightning_deepspeed_script.py``. The first DeepSpeed init JIT-compiles a communication op
(about a minute) into TORCH_EXTENSIONS_DIR, cached in the venv by the Makefile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("deepspeed")

from tests.integration.test_lightning import leftovers, tree_equal
from tests.s3server import free_ports

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "_lightning_deepspeed_script.py")


def _env() -> dict[str, str]:
    return dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1",
                MASTER_PORT=str(free_ports(1)[0]), PYTHONWARNINGS="ignore",
                TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR",
                                                    os.path.join(REPO, ".venv", "torch_extensions")))


REFUSAL = """
import lightning as L, torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from fastckpt import FastCkptIO
class M(L.LightningModule):
    def __init__(self):
        super().__init__(); self.l = torch.nn.Linear(2, 1)
    def training_step(self, b, i): return self.l(b).sum()
    def configure_optimizers(self): return torch.optim.SGD(self.parameters(), lr=0.1)
    def train_dataloader(self): return torch.utils.data.DataLoader(torch.randn(4, 2))
try:
    L.Trainer(accelerator="cpu", devices=1, strategy=DeepSpeedStrategy(), plugins=[FastCkptIO()],
              max_steps=1, logger=False).fit(M())
except RuntimeError as e:
    print("REFUSED:", e)
"""


def test_deepspeed_strategy_refuses_cpu(lightning_python):
    proc = lightning_python.run_code(REFUSAL, [], 120, _env())
    assert "REFUSED: The DeepSpeed strategy is only supported on CUDA GPUs but `CPUAccelerator` is used." \
        in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_deepspeed_zero2_two_processes_save_resume_top_k(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], env=_env(), capture_output=True, text=True,
                          check=False,
                          timeout=400, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["engine"] == "FastCkptEngine"
    assert (summary["ref_fenced"], summary["run_fenced"]) == (False, True)  # lazy_snapshot reached the engine

    # Lightning's checkpoint "files" are DeepSpeed directories; save_top_k=1 removed the older ones
    assert summary["ref_files"] == summary["run_files"] == ["epoch=2-step=12.ckpt", "last.ckpt"]
    for run in ("ref", "run"):
        for name in summary["ref_files"]:
            group = tmp_path / run / "ckpt" / name / "checkpoint"
            manifest = json.loads((group / "fastckpt-manifest.json").read_text())
            assert manifest["world_size"] == 2
            assert sorted(manifest["files"]) == ["mp_rank_00_model_states.pt",
                                                 "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                 "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
            assert (tmp_path / run / "ckpt" / name / "latest").read_text() == "checkpoint"
            states = torch.load(group / "mp_rank_00_model_states.pt", weights_only=False)  # plain torch.load
            assert states["global_step"] == 12
    assert leftovers(str(tmp_path / "ref"), str(tmp_path / "run")) == []
    # one metrics row per group commit, on rank 0: 3 checkpoints + 3 last.ckpt
    assert sorted(r["ckpt/step"] for r in summary["ckpt_rows"]) == [4.0, 4.0, 8.0, 8.0, 12.0, 12.0]
    assert all(r["ckpt/durable_s"] > 0 for r in summary["ckpt_rows"])

    # resumed from "last" == uninterrupted, on both ranks
    assert summary["global_step"] == 12
    for rank in (0, 1):
        w = torch.load(tmp_path / f"weights-rank{rank}.pt", weights_only=True)
        tree_equal(w["resumed"], w["ref"], f"rank {rank} weights")
