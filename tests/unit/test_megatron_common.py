"""The common loader fastckpt registers in megatron's place for ``("torch", 1)`` loads a
checkpoint fastckpt did not save exactly as megatron's own loader does."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from megatron.core.dist_checkpointing.mapping import CheckpointingException  # noqa: E402
from megatron.core.dist_checkpointing.strategies.base import StrategyAction, get_default_strategy  # noqa: E402

import fastckpt.integrations.megatron as fm  # noqa: E402
from fastckpt.integrations._megatron import commonload  # noqa: E402


def test_importing_the_integration_puts_the_common_loader_in_megatrons_place() -> None:
    fm.register()
    assert isinstance(get_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1), fm.FastCkptCommonLoadStrategy)


def test_a_checkpoint_without_a_fastckpt_manifest_is_loaded_as_megatron_loads_it(tmp_path) -> None:
    torch.save({"iteration": 7, "args": {"lr": 0.5}}, tmp_path / "common.pt")
    assert fm.FastCkptCommonLoadStrategy().load_common(tmp_path) == {"iteration": 7, "args": {"lr": 0.5}}
    assert commonload.seen(str(tmp_path)) is None  # nothing noted: the sharded load checks nothing more


def test_a_missing_common_pt_is_megatrons_error(tmp_path) -> None:
    with pytest.raises(CheckpointingException, match="common.pt does not exist"):
        fm.FastCkptCommonLoadStrategy().load_common(tmp_path)
