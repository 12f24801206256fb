"""The examples the docs point at run as their usage lines say (smaller, so the suite stays quick):
``make demo`` (examples/demo.py), examples/lightning/train.py and examples/deepspeed/train.py.
examples/megatron has its own test (tests/integration/test_megatron_example.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.blocks import ROOT


def _run(tmp_path: Path, *argv: str) -> str:
    done = subprocess.run([sys.executable, *argv], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stdout[-6000:]
    return done.stdout


def test_demo_saves_restores_and_reports(tmp_path: Path) -> None:
    out = _run(tmp_path, str(ROOT / "examples" / "demo.py"), "--steps", "40", "--every", "10", "--width", "256",
               "--local-dir", str(tmp_path / "nvme"))
    assert "tier=nvme" in out and "4 saves in a" in out and "(step 40, weights match)" in out
    assert (tmp_path / "demo_ckpt" / "step-00040.pt").exists() and (tmp_path / "demo_ckpt" / "events.jsonl").exists()


def test_lightning_example_trains_saves_and_resumes(tmp_path: Path) -> None:
    out = _run(tmp_path, str(ROOT / "examples" / "lightning" / "train.py"), "--steps", "20", "--every", "10")
    assert "weights match: True" in out and "global_step=20" in out
    assert (tmp_path / "lightning_ckpt" / "last.ckpt").exists()


def test_deepspeed_example_trains_saves_and_resumes(tmp_path: Path) -> None:
    """examples/deepspeed/README.md's command, on two processes, twice: the second run resumes."""
    pytest.importorskip("deepspeed")
    config = json.loads((ROOT / "examples" / "deepspeed" / "ds_config.json").read_text())
    config["fastckpt"]["local_dir"] = str(tmp_path / "nvme")
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    argv = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(ROOT / "examples" / "deepspeed" / "train.py"), "--config", str(tmp_path / "ds_config.json"),
            "--save-dir", str(tmp_path / "ckpt"), "--steps", "10", "--every", "5", "--width", "64"]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    first = _run(tmp_path, *argv)
    assert "starting from scratch" in first and "latest -> global_step10" in first
    second = _run(tmp_path, *argv)
    assert "at step 10" in second and "latest -> global_step20" in second
