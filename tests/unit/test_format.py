"""format.py: the layout torch writes under skip_data, the storage keys we derive, the manifest
in the zip comment, and that plain torch.load reads what fastckpt writes."""

from __future__ import annotations

import collections
import zipfile

import pytest
import torch

import fastckpt
from fastckpt.errors import UnsupportedObjectError
from fastckpt.format import layout as F
from fastckpt.format import manifest as M


def _state() -> dict:
    base = torch.arange(4096 * 3, dtype=torch.int64)
    return {
        "w": base,
        "view": base[::3],  # shares its base's storage: one record
        "bf16": torch.arange(100, dtype=torch.float32).to(torch.bfloat16),
        "nested": collections.OrderedDict(a=[torch.ones(7, dtype=torch.int16), 3, "x"], b=(1.5, None)),
        "empty": torch.empty(0),
        "scalar": torch.tensor(5),
    }


def test_plan_matches_torch_records() -> None:
    sd = _state()
    layout = F.plan(sd)
    assert layout.data_size > 0
    keys = [s.key for s in layout.storages]
    assert keys == [str(i) for i in range(len(keys))]
    # one record per distinct storage: w and view share theirs
    assert len(layout.storages) == 5
    assert all(s.offset % F.ALIGN == 0 for s in layout.storages)
    by_ptr = {s.storage.data_ptr(): s for s in layout.storages}
    assert by_ptr[sd["w"].untyped_storage().data_ptr()].nbytes == sd["w"].untyped_storage().nbytes()
    assert by_ptr[sd["w"].untyped_storage().data_ptr()].where == "state['w']"


def test_written_file_is_plain_torch_zip(tmp_path) -> None:
    sd = _state()
    path = tmp_path / "a.pt"
    with fastckpt.Checkpointer() as ck:
        ck.save(sd, str(path)).wait()
    out = torch.load(path, weights_only=True)
    assert torch.equal(out["w"], sd["w"])
    assert torch.equal(out["view"], sd["view"])
    assert out["view"].untyped_storage().data_ptr() == out["w"].untyped_storage().data_ptr()
    assert out["bf16"].dtype == torch.bfloat16 and torch.equal(out["bf16"], sd["bf16"])
    assert out["nested"]["a"][1:] == [3, "x"] and out["nested"]["b"] == (1.5, None)
    assert out["empty"].numel() == 0 and out["scalar"].item() == 5
    mm = torch.load(path, weights_only=True, mmap=True)
    assert torch.equal(mm["w"], sd["w"])
    # the manifest rides in the zip comment, which zip readers ignore
    comment = zipfile.ZipFile(path).comment
    manifest = M.parse_tail(comment and open(path, "rb").read()[-(len(comment) + 22):], 0)
    assert manifest["kind"] == "file" and manifest["checksum"]["algo"] == "xxh3_64-tree-16MiB"
    assert manifest["covered"] == path.stat().st_size - len(comment) - 2


def test_unpicklable_entry_named() -> None:
    with pytest.raises(UnsupportedObjectError, match=r"\['opt'\]\['hook'\]"):
        F.plan({"opt": {"lr": 1.0, "hook": lambda: 1}})


def test_meta_tensor_named() -> None:
    with pytest.raises(UnsupportedObjectError, match=r"\['m'\].*meta"):
        F.plan({"m": torch.empty(3, device="meta")})


def test_parse_tail_foreign_zip(tmp_path) -> None:
    path = tmp_path / "plain.pt"
    torch.save({"a": torch.ones(3)}, path)
    data = path.read_bytes()
    assert M.parse_tail(data[-1000:], len(data)) is None


def test_large_and_many_storages(tmp_path) -> None:
    sd = {f"t{i}": torch.full((1000 + i,), i, dtype=torch.int32) for i in range(300)}
    sd["big"] = torch.arange(40 << 20, dtype=torch.uint8)  # crosses several 16 MiB checksum blocks
    path = tmp_path / "many.pt"
    with fastckpt.Checkpointer(io_threads=3) as ck:
        ck.save(sd, str(path)).wait()
        out = ck.load(str(path))
    assert all(torch.equal(out[k], v) for k, v in sd.items())


def test_manifest_lists_block_digests(tmp_path) -> None:
    # a partial reader checks each 16 MiB block it reads against these (docs/format.md)
    from fastckpt.format import checksum
    from tests.helpers import read_file_manifest

    path = tmp_path / "blocks.pt"
    with fastckpt.Checkpointer() as ck:
        ck.save({"big": torch.arange(40 << 20, dtype=torch.uint8)}, str(path)).wait()
    m = read_file_manifest(str(path))["checksum"]
    data = path.read_bytes()[: read_file_manifest(str(path))["covered"]]
    want = [checksum.block_digest(data[o : o + checksum.BLOCK_BYTES]) for o in range(0, len(data), checksum.BLOCK_BYTES)]
    assert len(want) == 3
    assert [int(m["blocks"][i : i + 16], 16) for i in range(0, len(m["blocks"]), 16)] == want
    assert checksum.combine(want) == m["value"]


def test_fast_storage_order_matches_pickling_order() -> None:
    shared = torch.arange(10)
    states = [
        _state(),
        {"model": {f"l{i}.w": torch.full((i + 1,), i) for i in range(20)},
         "optim": {"state": {i: {"exp_avg": torch.zeros(i + 1), "step": torch.tensor(i)} for i in range(20)},
                   "param_groups": [{"lr": 0.1, "params": list(range(20))}]},
         "shared": [shared, shared[2:], (shared, 3)], "p": torch.nn.Parameter(torch.ones(3))},
    ]
    for sd in states:
        fast = F._fast_order(sd)
        slow = F._StorageOrder()
        slow.dump(sd)
        assert fast is not None
        assert [s._cdata for s in fast] == [s._cdata for s in slow.order]


def test_custom_objects_fall_back_to_pickling_order(tmp_path) -> None:
    sd = {"cfg": F.StorageRecord, "w": torch.arange(5)}  # a class: not a plain value
    assert F._fast_order(sd) is None
    path = tmp_path / "c.pt"
    with fastckpt.Checkpointer() as ck:
        ck.save(sd, str(path)).wait()
        assert torch.equal(ck.load(str(path), weights_only=False)["w"], torch.arange(5))
