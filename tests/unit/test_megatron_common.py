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


@pytest.mark.parametrize("backend", ["torch_dist", "fastckpt"])  # megatron's own, or ours never committed
def test_a_missing_common_pt_of_a_checkpoint_fastckpt_did_not_commit_names_it_and_the_directory(tmp_path,
                                                                                                backend) -> None:
    """``dist_checkpointing.load`` passes the directory as a str: megatron-core 0.16.1's own loader then
    raised ``AttributeError: 'str' object has no attribute 'iterdir'`` from its error path."""
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedTensor

    ck_dir = tmp_path / "iter_0000003"
    ck_dir.mkdir()
    (ck_dir / "metadata.json").write_text(f'{{"sharded_backend": "{backend}", "sharded_backend_version": 1}}')
    fm.register()
    with pytest.raises(CheckpointingException) as info:
        dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 8))}, str(ck_dir))
    msg = str(info.value)
    assert f"Common file {ck_dir / 'common.pt'} does not exist: the checkpoint directory {ck_dir} (holding " \
           "metadata.json) has no common.pt" in msg
    assert "Load another checkpoint (an earlier iteration)" in msg
