"""FastCkptIO under Lightning's FSDPStrategy as it is (its own wrapping, FULL_SHARD, full state
dict) on CUDA: what the CPU test cannot run (see tests/integration/_lightning_fsdp_script.py).
Marked gpu; skipped without a CUDA device. Not yet run: no GPU was lent to the session that
wrote it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning")

from tests.integration.test_lightning_fsdp import check_fsdp_summary, run_fsdp_script

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_fsdp_full_shard_saves_through_fastckpt_and_resumes(tmp_path):
    check_fsdp_summary(tmp_path, run_fsdp_script(tmp_path, FASTCKPT_TEST_FSDP_CUDA="1"))
