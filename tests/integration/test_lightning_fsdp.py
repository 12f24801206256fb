"""FastCkptIO under FSDPStrategy(state_dict_type="full"): 2 CPU processes (gloo), in a subprocess."""

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

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lightning_fsdp_script.py")


def run_fsdp_script(tmp_path, **env_extra: str) -> dict:
    """Run the script (Lightning starts the other ranks); return its summary."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1", **env_extra)
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True, check=False,
                          timeout=200, start_new_session=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((tmp_path / "summary.json").read_text())


def check_fsdp_summary(tmp_path, summary: dict) -> None:
    spe = summary["steps_per_epoch"]
    last = f"epoch=2-step={3 * spe}.ckpt"
    # rank 0 saved the gathered state through FastCkptIO (burst buffer, then the path); top-k ran
    assert summary["saved_by"] == "FastCkptIO"
    assert summary["ref_files"] == [last, "last.ckpt"]
    # the resumed run continued in the same directory: top-k state and last.ckpt were restored
    assert summary["run_files"] == [last, "last.ckpt"]
    assert leftovers(str(tmp_path / "ref"), str(tmp_path / "run")) == []
    assert sorted(r["ckpt/step"] for r in summary["ckpt_rows"]) == sorted([float(spe * k) for k in (1, 2, 3)] * 2)
    # the files are plain torch.save zips holding the full (unsharded) weights
    ck = torch.load(tmp_path / "ref" / "ckpt" / "last.ckpt", weights_only=True)
    assert ck["state_dict"]["net.0.weight"].shape == (32, 8), sorted(ck["state_dict"])

    # resumed from "last" (read by FSDPStrategy's own loader) == uninterrupted
    assert summary["global_step"] == 3 * spe
    w = torch.load(tmp_path / "weights.pt", weights_only=True)
    tree_equal(w["resumed"], w["ref"], "weights")
    tree_equal(w["resumed_opt"], w["ref_opt"], "optimizer")


def test_fsdp_full_state_dict_saves_through_fastckpt_and_resumes(tmp_path):
    """2 CPU processes, NO_SHARD (the script says why). Before the callback flushed in
    on_fit_end, this hung: Lightning's FSDPStrategy.teardown never calls CheckpointIO.teardown,
    so rank 0's last save was still in flight when the next fit resolved ckpt_path="last"."""
    summary = run_fsdp_script(tmp_path)
    check_fsdp_summary(tmp_path, summary)
    # FSDP sharded (Lightning's own dcp saves and last.ckpt link): top-k deletions keep up, and
    # latest names the newest directory, not a meta.pt inside it
    sharded = summary["sharded"]
    assert sharded["most"] <= 3 and sharded["files"] == ["epoch=1-step=6.ckpt", "last.ckpt"], sharded
    assert sharded["latest"] == "epoch=1-step=6.ckpt", sharded
