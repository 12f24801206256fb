"""The Megatron save strategy refuses a tensor it cannot save by its ShardedTensor key.

Each rank's main replicas go to ``Checkpointer.save`` as ``{"t0": ..., "t1": ...}``, so the core's
refusals named ``state['t1']`` (a tensor on the meta device), which traces back to no parameter;
a sparse tensor failed with torch's ``NotImplementedError: Cannot access storage of
SparseTensorImpl``. ``split_rank_state`` now refuses them itself, naming the key and the fix.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from megatron.core.dist_checkpointing import ShardedTensor  # noqa: E402

from fastckpt.errors import UnsupportedObjectError  # noqa: E402
from fastckpt.integrations._megatron.layout import split_rank_state  # noqa: E402

KEY = "decoder.layers.0.mlp.weight"


@pytest.mark.parametrize(("data", "says"), [
    (lambda: torch.empty(4, 4, device="meta"), "is a tensor on the meta device: it has no data to save. Materialise"),
    (lambda: torch.eye(4).to_sparse(), "is a tensor of layout torch.sparse_coo; fastckpt's Megatron strategy"),
    (lambda: torch.eye(4).to_sparse_csr(), "is a tensor of layout torch.sparse_csr"),
    (lambda: torch.quantize_per_tensor(torch.ones(4, 4), 0.1, 0, torch.qint8), "is a quantized tensor"),
])
def test_a_tensor_without_plain_bytes_is_refused_naming_its_sharded_tensor_key(data, says) -> None:
    good = ShardedTensor.from_rank_offsets("embedding.word_embeddings.weight", torch.ones(4, 2))
    bad = ShardedTensor.from_rank_offsets(KEY, data())
    with pytest.raises(UnsupportedObjectError) as info:
        split_rank_state([good, bad], "r.pt", "o.pt")
    assert str(info.value).startswith(f"ShardedTensor {KEY!r} {says}"), str(info.value)
    assert "t1" not in str(info.value)


def test_views_of_one_storage_with_different_dtypes_are_refused_naming_both_keys() -> None:
    """A packed buffer viewed as fp32 weights and as int32 flags: torch.save refuses two dtypes over
    one storage, and the core's error named neither ShardedTensor ("cannot save state ... drop or
    convert that entry", wrong advice for two plain tensors)."""
    buf = torch.randn(100)
    weights = ShardedTensor.from_rank_offsets("decoder.weight", buf[0:60].view(6, 10))
    flags = ShardedTensor.from_rank_offsets("decoder.flags", buf.view(torch.int32)[60:70])
    with pytest.raises(UnsupportedObjectError) as info:
        split_rank_state([weights, flags], "r.pt", "o.pt")
    assert str(info.value).startswith("ShardedTensors 'decoder.weight' (torch.float32) and 'decoder.flags' "
                                      "(torch.int32) view the same storage with different dtypes"), str(info.value)
    assert "'decoder.flags' cloned" in str(info.value)
    # one dtype over one storage (megatron's DDP buffers), or a clone of the other view, saves
    same = ShardedTensor.from_rank_offsets("decoder.bias", buf[60:70])
    cloned = ShardedTensor.from_rank_offsets("decoder.flags", buf.view(torch.int32)[60:70].clone())
    tensors, _, saved, _ = split_rank_state([weights, same, cloned], "r.pt", "o.pt")
    assert [s.storage for s in saved] == [0, 0, 1] and len(tensors) == 3
