"""FastCkptIO under DDP: 2 CPU processes (gloo), run in a subprocess so this one stays clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning")

from tests.integration.test_lightning import leftovers, tree_equal
from tests.s3server import free_ports

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lightning_ddp_script.py")


def test_ddp_two_processes_save_resume_top_k(tmp_path):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    # Lightning starts rank 1 from rank 0; the script's watchdog ends both if a rank hangs
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True, check=False,
                          timeout=150, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())

    # rank 0 saved; save_top_k=1 deleted the older checkpoints; nothing left half-written
    assert summary["ref_files"] == ["epoch=2-step=12.ckpt", "last.ckpt"]
    assert summary["run_files"] == ["epoch=2-step=12.ckpt", "last.ckpt"]
    assert leftovers(str(tmp_path / "ref"), str(tmp_path / "run"), str(tmp_path / "nvme")) == []
    # metrics reached the logger on rank 0: 3 saves + 3 last.ckpt saves
    assert sorted(r["ckpt/step"] for r in summary["ckpt_rows"]) == [4.0, 4.0, 8.0, 8.0, 12.0, 12.0]

    # resumed from "last" after one epoch == uninterrupted (with lazy snapshots), on both ranks
    assert summary["global_step"] == 12
    for rank in (0, 1):
        w = torch.load(tmp_path / f"weights-rank{rank}.pt", weights_only=True)
        tree_equal(w["resumed"], w["ref"], f"rank {rank} weights")
        tree_equal(w["resumed_opt"], w["ref_opt"], f"rank {rank} optimizer")
