"""Megatron loads: the saved shards must cover every element a request asks for.

Coverage used to be a sum of the overlaps' sizes, so a shard saved twice (two main replicas,
which megatron's own check lets through when Megatron-LM skips it on later saves with
``--ckpt-assume-constant-structure``) made up for one never saved, and the load returned
uninitialised memory for it. Now the boxes' union is measured.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from megatron.core.dist_checkpointing import ShardedTensor  # noqa: E402

from fastckpt.integrations._megatron.layout import Box, Index, ReshardingError, SavedTensor, plan_tensor, uncovered  # noqa: E402


def _saved(offset: tuple[int, int], shape: tuple[int, int]) -> SavedTensor:
    return SavedTensor("c", "float32", (4, 4), Box(offset, shape), "fastckpt-rank00000.pt", 0, 64, 0, (4, 1))


def _index(*shards: SavedTensor) -> Index:
    return Index({"c": shards}, {}, 1)


def test_a_shard_saved_twice_does_not_hide_one_never_saved() -> None:
    index = _index(_saved((0, 0), (2, 4)), _saved((2, 0), (1, 4)), _saved((2, 0), (1, 4)))  # row 3: nobody
    want = ShardedTensor.from_rank_offsets("c", torch.full((4, 4), -1.0))
    with pytest.raises(ReshardingError, match="leave 4 of its 16 elements uncovered"):
        plan_tensor(want, index)


def test_duplicate_shards_that_cover_everything_load() -> None:
    index = _index(_saved((0, 0), (3, 4)), _saved((0, 0), (3, 4)), _saved((3, 0), (1, 4)))
    parts = plan_tensor(ShardedTensor.from_rank_offsets("c", torch.zeros(4, 4)), index)
    assert len(parts) == 3


@pytest.mark.parametrize(("boxes", "missing"), [
    ([Box((0, 0), (4, 4))], 0),
    ([Box((0, 0), (2, 4)), Box((2, 0), (2, 2))], 4),
    ([Box((0, 0), (4, 2)), Box((0, 1), (4, 2)), Box((1, 3), (2, 1))], 2),  # overlapping, two holes
    ([], 16),
])
def test_uncovered_counts_the_union(boxes: list[Box], missing: int) -> None:
    assert uncovered(Box((0, 0), (4, 4)), boxes) == missing


def test_uncovered_of_a_scalar_and_a_long_flat_tensor() -> None:
    assert uncovered(Box((), ()), [Box((), ())]) == 0
    flat = [Box((i * 10,), (10,)) for i in range(1000) if i != 500]
    assert uncovered(Box((0,), (10_000,)), flat + flat[:3]) == 10


def test_a_main_replica_without_data_is_refused_at_save() -> None:
    """A rank holding a tensor's main replica with no data (``without_data()``) was skipped in
    silence: the checkpoint committed without the tensor and its first load failed. megatron's
    torch_dist refuses it; so does fastckpt now, naming the key."""
    from fastckpt.errors import UnsupportedObjectError
    from fastckpt.integrations._megatron.layout import split_rank_state

    full = ShardedTensor.from_rank_offsets("w", torch.ones(4))
    bare = ShardedTensor.from_rank_offsets("e", torch.ones(4)).without_data()
    tensors, _, saved, _ = split_rank_state([full], "r.pt", "o.pt")
    assert [s.key for s in saved] == ["w"] and len(tensors) == 1
    with pytest.raises(UnsupportedObjectError, match="'e': this rank holds its main replica but passes no data"):
        split_rank_state([full, bare], "r.pt", "o.pt")
    replica = ShardedTensor.from_rank_offsets("e", torch.ones(4), replica_id=1).without_data()
    assert [s.key for s in split_rank_state([full, replica], "r.pt", "o.pt")[2]] == ["w"]  # not the main one: fine
