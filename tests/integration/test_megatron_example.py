"""examples/megatron: the 2-process CPU example runs through torchrun, and the Megatron-LM patch applies.

The patch check needs a Megatron-LM source: set FASTCKPT_MEGATRON_LM to a checkout or a bare
git directory that has the tag ``core_v0.16.1`` (``git clone https://github.com/NVIDIA/Megatron-LM``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "megatron", "run_cpu_example.py")
PATCH = os.path.join(ROOT, "examples", "megatron", "megatron_lm_fastckpt.patch")
TAG = "core_v0.16.1"


def test_cpu_example_runs_on_two_ranks(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           EXAMPLE, "--dir", str(tmp_path / "ckpt"), "--hidden", "128", "--layers", "2"],
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for line in ("loaded on 2 ranks (TP 2)", "loaded on 1 rank (TP 1, resharded)", "async save of iteration 2: blocked",
                 "tracker names iteration 2", "overhead:", "over 2 checkpoints saved"):  # iterations 1 and 2
        assert line in out, out[-6000:]
    assert out.rstrip().endswith("OK") or "\nOK" in out
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"


def _megatron_lm() -> str:
    src = os.environ.get("FASTCKPT_MEGATRON_LM")
    if not src:
        pytest.skip("set FASTCKPT_MEGATRON_LM to a Megatron-LM checkout or git directory (with tag core_v0.16.1) "
                    "to check that examples/megatron/megatron_lm_fastckpt.patch applies")
    return src


def test_megatron_lm_patch_applies_to_core_v0_16_1() -> None:
    src = _megatron_lm()
    git_dir = src if os.path.isfile(os.path.join(src, "HEAD")) and not os.path.isdir(os.path.join(src, ".git")) \
        else os.path.join(src, ".git") if os.path.isdir(os.path.join(src, ".git")) else src
    with tempfile.TemporaryDirectory() as work:
        env = dict(os.environ, GIT_DIR=git_dir, GIT_WORK_TREE=work, GIT_INDEX_FILE=os.path.join(work, ".index"))
        subprocess.run(["git", "read-tree", TAG], env=env, check=True, capture_output=True)
        check = subprocess.run(["git", "apply", "--check", "--cached", PATCH], env=env, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
