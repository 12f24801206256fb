"""The CLI on a GPU machine (marked gpu; skipped without a CUDA device): bench --gds moves
blocks with kvikio when GPUDirect Storage works, else says why; the drill's built-in job
trains and restores on the GPU."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from fastckpt.cli import cli
from fastckpt.save.tiers import gds_unavailable_reason

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_bench_gds_runs_or_says_why_not(tmp_path) -> None:
    why = gds_unavailable_reason(True)
    r = CliRunner().invoke(cli, ["bench", "--dir", str(tmp_path), "--gds", "--workers", "2", "--size", "64MiB",
                                 "--block-size", "4MiB", "--verify", "--json"])
    d = json.loads(r.stdout)
    if why is not None:
        assert r.exit_code == 1 and d["gds_unavailable_reason"] == why
        return
    assert r.exit_code == 0, r.output
    assert d["gds"] and d["write_bytes"] == d["read_bytes"] == 2 * (64 << 20)
    assert all(w["bad_blocks"] == 0 for w in d["workers"])


def test_drill_on_the_gpu(tmp_path) -> None:
    r = CliRunner().invoke(cli, ["drill", "--trials", "3", "--state-size", "32MiB", "--every", "3",
                                 "--step-time", "20ms", "--device", "cuda", "--dir", str(tmp_path / "home"),
                                 "--local-dir", str(tmp_path / "bb"), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["restored"] == 3 and d["corrupt_loads"] == 0
