"""examples/megatron: the 2-process CPU example runs through torchrun, the Megatron-LM patch applies,
and its finalize code keeps the iteration the tracker names.

The patch checks need a Megatron-LM source: set FASTCKPT_MEGATRON_LM to a checkout or a bare
git directory that has the tag ``core_v0.16.1`` (``git clone https://github.com/NVIDIA/Megatron-LM``).
"""

from __future__ import annotations

import ast
import os
import shutil
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
                    "to check examples/megatron/megatron_lm_fastckpt.patch against it")
    return src


def _git_env(work: str) -> dict[str, str]:
    """An environment whose git reads the Megatron-LM source and keeps its index in ``work``."""
    src = _megatron_lm()
    git_dir = src if os.path.isfile(os.path.join(src, "HEAD")) and not os.path.isdir(os.path.join(src, ".git")) \
        else os.path.join(src, ".git") if os.path.isdir(os.path.join(src, ".git")) else src
    return dict(os.environ, GIT_DIR=git_dir, GIT_WORK_TREE=work, GIT_INDEX_FILE=os.path.join(work, ".index"))


def test_megatron_lm_patch_applies_to_core_v0_16_1() -> None:
    with tempfile.TemporaryDirectory() as work:
        env = _git_env(work)
        subprocess.run(["git", "read-tree", TAG], env=env, check=True, capture_output=True)
        check = subprocess.run(["git", "apply", "--check", "--cached", PATCH], env=env, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def _patched_finalize() -> str:
    """Source of the patched Megatron-LM's ``iter_finalize_fn`` (the one ``save_checkpoint`` runs
    in the finalize step of a global checkpoint: the tracker, then ``--save-retain-interval``),
    with ``get_checkpoint_name``, which it calls."""
    with tempfile.TemporaryDirectory() as work:
        env = _git_env(work)
        subprocess.run(["git", "read-tree", TAG], env=env, check=True, capture_output=True)
        subprocess.run(["git", "apply", "--cached", PATCH], env=env, check=True, capture_output=True)
        source = subprocess.run(["git", "show", ":megatron/training/checkpointing.py"], env=env, check=True,
                                capture_output=True, text=True).stdout
    tree = ast.parse(source)
    top = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    (fn,) = [n for n in ast.walk(top["save_checkpoint"]) if isinstance(n, ast.FunctionDef)
             and n.name == "iter_finalize_fn" and "save_retain_interval" in ast.unparse(n)]
    return ast.unparse(top["get_checkpoint_name"]) + "\n" + ast.unparse(fn)


def test_megatron_lm_finalize_keeps_the_iteration_the_tracker_still_names(tmp_path) -> None:
    """With ``--save-retain-interval``, Megatron-LM's finalize deletes the iteration the tracker
    named before (unless a multiple of the interval). It deleted it even when ``advance_tracker``
    did not move the tracker (the new iteration is not complete: coalesced away; or a later commit
    holds the tracker): the tracker then named a deleted checkpoint. Here the patched finalize
    code itself (from Megatron-LM's source at the tag) runs against real checkpoints, with
    megatron-core's ``open_file`` and ``mpu``; Megatron-LM's print helper is ``print``."""
    import threading
    from datetime import datetime
    from types import SimpleNamespace

    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.msc_utils import open_file

    import fastckpt
    from fastckpt.integrations import megatron as fm

    code, save_dir = _patched_finalize(), str(tmp_path)

    def committed(n: int) -> str:
        group = os.path.join(save_dir, f"iter_{n:07d}")
        with fastckpt.Checkpointer() as ck:
            ck.save({"w": torch.full((4,), float(n))}, os.path.join(group, "fastckpt-rank00000.pt"), group=group)
            ck.commit(group).wait()
        return group

    def finalize(iteration: int) -> None:
        ns = {"os": os, "shutil": shutil, "threading": threading, "datetime": datetime, "open_file": open_file,
              "mpu": mpu, "print_rank_0": print, "save_dir": save_dir, "iteration": iteration, "release": False,
              "tracker_filename": os.path.join(save_dir, fm.TRACKER), "tensor_rank": 0, "pipeline_rank": 0,
              "args": SimpleNamespace(save=save_dir, save_retain_interval=1000, log_progress=False,
                                      async_save=True, ckpt_backend="fastckpt")}
        exec(code, ns)  # noqa: S102 (Megatron-LM's own code, patched)
        before = set(threading.enumerate())
        ns["iter_finalize_fn"]()
        for t in set(threading.enumerate()) - before:  # its deletion runs on a thread of its own
            t.join(60)

    mpu.set_tensor_model_parallel_world_size(1)
    mpu.set_pipeline_model_parallel_world_size(1)
    try:
        one = committed(1)
        finalize(1)
        assert fm.read_tracker(save_dir) == 1
        os.makedirs(os.path.join(save_dir, "iter_0000002"))  # a save that never committed (coalesced away)
        finalize(2)
        assert fm.read_tracker(save_dir) == 1 and os.path.isdir(one)  # before: iter_0000001 deleted
        assert fm.sync_tracker(save_dir) == 1
        committed(3)
        finalize(3)  # the tracker moves on: the iteration it named before goes (--save-retain-interval)
        assert fm.read_tracker(save_dir) == 3 and not os.path.exists(one)
    finally:
        mpu.set_tensor_model_parallel_world_size(None)
        mpu.set_pipeline_model_parallel_world_size(None)
