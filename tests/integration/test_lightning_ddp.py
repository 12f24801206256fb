"""FastCkptIO under DDP: 2 CPU processes (gloo), run in a subprocess so this one stays clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning")

import fastckpt  # noqa: E402
from tests.integration.test_lightning import leftovers, tree_equal  # noqa: E402
from tests.s3server import free_ports  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lightning_ddp_script.py")
PEER_CRASH_SCRIPT = os.path.join(os.path.dirname(SCRIPT), "_lightning_ddp_peer_crash_script.py")


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


def test_a_failure_on_rank_1_does_not_lose_a_save_rank_0_returned_for(tmp_path):
    """Rank 1 fails while rank 0's save of step 4 is still uploading. Lightning's launcher kills
    rank 0 within about 5 s of rank 1's exit, and rank 0, stuck in a collective, never flushed:
    the checkpoint was lost. Rank 1 now stays until rank 0's saves have ended (reported through
    the process group's store by the threads that end them), so the file is at its dirpath, whole."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    proc = subprocess.run([sys.executable, PEER_CRASH_SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                          check=False, timeout=150, start_new_session=True)
    assert proc.returncode != 0 and "rank 1 fails" in proc.stderr, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert (tmp_path / "returned").exists(), proc.stderr[-4000:]  # the save had returned before rank 1 failed
    assert "waiting (close_timeout_s=None) for 1 checkpoint save(s) rank 0 started" in proc.stderr, proc.stderr[-4000:]
    state = fastckpt.load(str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt"), weights_only=False)  # verified
    assert state["global_step"] == 4 and state["state_dict"]["big"].numel() == 5_000_000
