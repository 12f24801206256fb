"""The Megatron strategy on GPUs: megatron's AsyncCallsQueue as it ships (CUDA calls, NCCL).

Marked gpu; needs 2 CUDA devices and megatron-core. On CPU the same queue runs in
tests/integration/test_megatron.py with its two CUDA calls stood in.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.integration.test_megatron import run_worker  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


def test_async_save_through_the_async_calls_queue_on_cuda(tmp_path) -> None:
    for rep in run_worker("cuda", str(tmp_path / "ckpt"), str(tmp_path / "cuda"), 2):
        assert rep["finalized"] == [0]
        assert rep["tracker"] == 1
        assert rep["on_cuda"] is True
        assert rep["equal"] is True
