"""load(..., into=state): the saved tensors land in tensors that exist already, read straight
into their memory where the layout allows (through a bounce buffer: torch's memory is not page
aligned), copied in where it does not; a mismatch is refused before any byte is written."""

from __future__ import annotations

import enum
import os
import re
import struct
import uuid
import zipfile
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import pytest
import torch

import fastckpt
from fastckpt import Checkpointer, ConfigError, CorruptCheckpointError
from fastckpt.io import engine
from fastckpt.io.ops import FileOps
from fastckpt.load.image import HeapImage, heap_image
from fastckpt.save.tiers import probe_odirect
from fastckpt.storage.homes import open_target
from tests.helpers import flip_byte

MiB = 1 << 20


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 300))


def _state(model: torch.nn.Module) -> dict:
    return {"model": model.state_dict(), "step": 7, "rng": torch.arange(5)}


def _read_into(path: str, dest: dict, direct: bool) -> engine.ReadResult:
    with ThreadPoolExecutor(3) as pool:
        return engine.read_file(FileOps(), pool, path, chunk_bytes=16 * MiB, odirect=direct,
                                into=partial(heap_image, into=dest))


def test_large_tensors_are_read_into_the_given_memory(tmp_path) -> None:
    saved, mine = _model(0), _model(1)
    path = str(tmp_path / "m.pt")
    with Checkpointer() as ck:
        ck.save(_state(saved), path).wait()
        ptrs = {k: v.data_ptr() for k, v in mine.state_dict().items()}
        got = ck.load(path, into={"model": mine.state_dict()})
    for k, v in saved.state_dict().items():
        assert torch.equal(mine.state_dict()[k], v)  # the module itself holds the saved values
        assert got["model"][k].data_ptr() == ptrs[k]  # the loaded object holds the module's tensors
    assert got["step"] == 7 and torch.equal(got["rng"], torch.arange(5))  # the rest loads as without into


@pytest.mark.parametrize("direct", [True, False], ids=["odirect", "buffered"])
def test_each_large_record_gets_the_given_tensor_as_its_piece(tmp_path, direct: bool) -> None:
    if direct and not probe_odirect(str(tmp_path))[0]:
        pytest.skip("needs O_DIRECT")
    saved, mine = _model(0), _model(1)
    path = str(tmp_path / "p.pt")
    with Checkpointer() as ck:
        ck.save(_state(saved), path).wait()
    dest = {"model": mine.state_dict()}
    res = _read_into(path, dest, direct)
    assert isinstance(res.buffer, HeapImage) and res.checksum == res.manifest["checksum"]["value"]
    big = [k for k, v in dest["model"].items() if v.nbytes >= 64 << 10]
    assert big == ["0.weight", "2.weight"]
    for k in big:  # read into the module's memory: no copy later
        assert torch.equal(dest["model"][k], saved.state_dict()[k])
    assert not torch.equal(dest["model"]["0.bias"], saved.state_dict()["0.bias"])  # small: copied in by place


@pytest.mark.parametrize("cache", ["cold", "half cached"])
def test_records_of_odd_sizes_read_in_place_through_the_bounce_buffers(tmp_path, cache: str) -> None:
    """Records that end inside a page: the bytes after each (in the file's next page) are read
    from an unaligned offset, through the bounce buffer, from the cache where it holds them."""
    if not probe_odirect(str(tmp_path))[0]:
        pytest.skip("needs O_DIRECT")
    state = {f"t{i}": torch.randn(300_001 + 17 * i) for i in range(6)}  # 1,200,004 bytes and up
    path = str(tmp_path / "odd.pt")
    with Checkpointer() as ck:
        ck.save(state, path).wait()
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    if cache == "half cached":
        os.pread(fd, os.path.getsize(path) // 2, os.path.getsize(path) // 4)
    os.close(fd)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    res = _read_into(path, dest, True)
    assert res.checksum == res.manifest["checksum"]["value"]
    assert all(torch.equal(dest[k], v) for k, v in state.items())  # before deserialising: read in place
    ptrs = {s.data_ptr() for s, _, _ in res.buffer._pieces}
    assert {v.data_ptr() for v in dest.values()} <= ptrs


def test_other_dtype_device_view_or_layout_is_copied_in(tmp_path) -> None:
    """A tensor that cannot be the saved record's memory still receives its values."""
    path = str(tmp_path / "c.pt")
    w = torch.randn(300, 400)
    shared = torch.randn(200_000)
    state = {"half": w, "strided": w.clone(), "view": shared[:100_000], "rest": shared[100_000:], "ok": w.clone()}
    with Checkpointer() as ck:
        ck.save(state, path).wait()
        dest = {"half": torch.zeros(300, 400, dtype=torch.float64), "strided": torch.zeros(400, 300).t(),
                "view": torch.zeros(100_000), "ok": torch.zeros(300, 400)}
        got = ck.load(path, into=dest)
    assert torch.equal(dest["half"], w.double()) and torch.equal(dest["strided"], w)
    assert torch.equal(dest["view"], shared[:100_000]) and torch.equal(dest["ok"], w)
    assert all(got[k] is dest[k] for k in dest)
    assert torch.equal(got["rest"], shared[100_000:])


def test_conjugate_and_negative_views_receive_the_saved_values(tmp_path) -> None:
    """A conjugate or negative view's values are not its bytes: the saved bytes read into its
    memory read back as conj(saved) or -saved, silently. Either side's bit sends it through
    copy_, which resolves them."""
    z, r = torch.randn(300_000, dtype=torch.complex64), torch.randn(300_000)
    path = str(tmp_path / "bits.pt")
    with Checkpointer() as ck:
        ck.save({"z": z, "r": r, "zc": z.clone().conj(), "rn": torch._neg_view(r.clone())}, path).wait()
        dest = {"z": torch.zeros(300_000, dtype=torch.complex64).conj(), "r": torch._neg_view(torch.zeros(300_000)),
                "zc": torch.zeros(300_000, dtype=torch.complex64), "rn": torch.zeros(300_000)}
        got = ck.load(path, into=dest)
    assert torch.equal(dest["z"], z) and torch.equal(dest["r"], r)
    assert torch.equal(dest["zc"], z.conj()) and torch.equal(dest["rn"], -r)
    assert all(got[k] is dest[k] for k in dest)


def test_a_mismatch_is_refused_before_anything_is_written(tmp_path) -> None:
    saved = _model(0)
    path = str(tmp_path / "x.pt")
    with Checkpointer() as ck:
        ck.save(_state(saved), path).wait()
        wrong = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 301))
        before = {k: v.clone() for k, v in wrong.state_dict().items()}
        with pytest.raises(ConfigError, match=r"\['model'\]\['2.weight'\]: saved with shape \(300, 1024\), into= "
                                              r"has \(301, 1024\).*Nothing was read"):
            ck.load(path, into={"model": wrong.state_dict()})
        assert all(torch.equal(v, before[k]) for k, v in wrong.state_dict().items())
        with pytest.raises(ConfigError, match=r"\['optimizer'\]\['m'\]: not in the checkpoint.*'step'\]: the "
                                              r"checkpoint holds a int there"):
            ck.load(path, into={"optimizer": {"m": torch.zeros(3)}, "step": torch.zeros(1)})
        with pytest.raises(ConfigError, match="mmap=True"):
            ck.load(path, mmap=True, into={"model": wrong.state_dict()})


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("into, words", [
    (5, r"into is of type int, not the tensors to fill.*into=\{'model': model.state_dict\(\)\}"),
    ("model", r"into is of type str, not the tensors to fill"),
    (_model(1), r"into is a module \(Sequential\), which into= does not fill: pass its state_dict\(\)"),
    ({"model": _model(1)}, r"into\['model'\] is a module \(Sequential\).*pass its state_dict\(\)"),
    ({"opt": [_sgd(_model(1))]}, r"into\['opt'\]\[0\] is an optimizer \(SGD\).*pass its state_dict\(\)"),
    ({"model": _model(1).state_dict}, r"into\['model'\] is of type method \(a function or method: call it, "
                                      r"model.state_dict\(\)\), which into= does not fill"),
    ({"model": _model(1).state_dict().values()}, r"into\['model'\] is of type odict_values, which into= does not"),
    ({"model": [iter([torch.zeros(2)])]}, r"into\['model'\]\[0\] is of type list_iterator, which into= does not"),
])
def test_an_into_that_names_no_tensors_to_fill_is_refused(tmp_path, into: object, words: str) -> None:
    """``into=5`` or ``into=model`` (a module, not its state_dict) was passed over: the load returned
    the saved object and the module kept its fresh weights, without a word."""
    path = str(tmp_path / "x.pt")
    with Checkpointer() as ck:
        ck.save(_state(_model(0)), path).wait()
        with pytest.raises(ConfigError, match=words):
            ck.load(path, into=into)
    with pytest.raises(ConfigError, match=words):
        fastckpt.load(path, into=into)


def test_plain_values_beside_the_tensors_are_allowed(tmp_path) -> None:
    """An optimizer's state_dict holds numbers, bools, None and tuples in its param_groups: no
    tensors to fill, and no mistake either (only what could hide tensors is refused)."""
    path = str(tmp_path / "x.pt")
    model = _model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 512)).sum().backward()
    opt.step()
    with Checkpointer() as ck:
        ck.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": 7, "dtype": torch.float32}, path).wait()
        fresh = _model(1)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
        fresh(torch.ones(1, 512)).sum().backward()
        fresh_opt.step()
        got = ck.load(path, into={"model": fresh.state_dict(), "opt": fresh_opt.state_dict(), "step": 0,
                                  "dtype": torch.float32})
    assert torch.equal(fresh[0].weight, model[0].weight) and got["step"] == 7
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_a_plain_value_at_a_place_the_checkpoint_lacks_is_passed_over(tmp_path) -> None:
    """into={'model': ..., 'epoch': 0} on a checkpoint saved without 'epoch' (or with 'epoch' of
    another shape) raised a bare KeyError after the model's tensors were filled
    (r5c_into_plain_value_missing_keyerror): a place holding no tensor is passed over."""
    path = str(tmp_path / "x.pt")
    with Checkpointer() as ck:
        ck.save({"model": {"w": torch.ones(3)}, "meta": 5}, path).wait()
        w = torch.zeros(3)
        got = ck.load(path, into={"model": {"w": w}, "epoch": 0, "meta": {"a": 1}, "names": ["x"]})
    assert torch.equal(w, torch.ones(3)) and got == {"model": {"w": w}, "meta": 5}


class _Phase(enum.Enum):
    WARMUP = 1


def test_every_plain_value_beside_the_tensors_is_passed_over(tmp_path) -> None:
    """The saved object's other values (an Enum member, a set of tags, a slice, a Path, an
    argparse Namespace, a datetime) are passed in into= as they were saved: refusing every value
    not on a short list of allowed types broke loads that worked, where only what could hide
    tensors (a method, a dict view, an iterator) is a mistake."""
    import argparse
    import datetime
    import pathlib

    extra = {"phase": _Phase.WARMUP, "tags": {"a", "b"}, "frozen": frozenset({1}), "window": slice(0, 4),
             "dir": pathlib.Path("/runs/a"), "args": argparse.Namespace(lr=0.1), "at": datetime.datetime(2026, 1, 1)}
    path = str(tmp_path / "x.pt")
    model = _model(0)
    torch.save({"model": model.state_dict(), **extra}, path)
    fresh = _model(1)
    got = fastckpt.load(path, weights_only=False, into={"model": fresh.state_dict(), **extra})
    assert torch.equal(fresh[0].weight, model[0].weight)
    assert got["tags"] == {"a", "b"} and got["window"] == slice(0, 4) and got["args"].lr == 0.1


def test_an_expanded_tensor_is_refused_before_anything_is_written(tmp_path) -> None:
    """An expanded tensor (stride 0) shares one element's memory among many: copy_ into it raised a
    bare RuntimeError after the tensors before it had been filled."""
    path = str(tmp_path / "x.pt")
    with Checkpointer() as ck:
        ck.save(_state(_model(0)), path).wait()
    fresh = _model(1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    into = {"model": {**fresh.state_dict(), "2.bias": torch.zeros(1).expand(300)}}
    with pytest.raises(ConfigError, match=r"into\['model'\]\['2.bias'\] is an expanded tensor \(shape \(300,\), "
                                          r"stride \(0,\)\).*\.clone\(\).*Nothing was read"):
        fastckpt.load(path, into=into)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    with pytest.raises(ConfigError, match=r"into is an expanded tensor"):
        fastckpt.load(path, into=torch.zeros(1, 5).expand(3, 5))


@pytest.mark.parametrize("view", [lambda: torch.zeros(600)[::2], lambda: torch.zeros(300, 2)[:, 1],
                                  lambda: torch.zeros(2, 310).as_strided((300,), (1,), 5)],
                         ids=["step", "column", "as_strided"])
def test_a_view_that_shares_no_element_is_filled(tmp_path, view) -> None:
    """A view of a larger buffer is not dense, so torch cannot tell whether its elements overlap
    (``_debug_has_internal_overlap`` answers 2): it shares none and is filled as before."""
    path = str(tmp_path / "x.pt")
    model = _model(0)
    with Checkpointer() as ck:
        ck.save(_state(model), path).wait()
    dest = view()
    fastckpt.load(path, into={"model": {"2.bias": dest}})
    assert torch.equal(dest, model[2].bias)


def test_a_tensor_whose_strides_overlap_is_refused_before_anything_is_written(tmp_path) -> None:
    """``unfold`` and ``as_strided`` views share memory without a stride of 0: copy_ filled them
    without error, later elements over earlier ones, and the load returned wrong values."""
    path = str(tmp_path / "x.pt")
    with Checkpointer() as ck:
        ck.save(_state(_model(0)), path).wait()
    fresh = _model(1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    for dest in (torch.zeros(1324).unfold(0, 1024, 1)[:300], torch.zeros(1624).as_strided((300, 1024), (2, 1))):
        into = {"model": {**fresh.state_dict(), "2.weight": dest}}
        words = re.escape(f"into['model']['2.weight'] is a tensor whose strides overlap (shape (300, 1024), stride "
                          f"{dest.stride()})")
        with pytest.raises(ConfigError, match=words + ".*Nothing was read"):
            fastckpt.load(path, into=into)
        assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


def test_a_tensor_on_the_meta_device_is_refused(tmp_path) -> None:
    """A module built on the meta device (fast init) has no memory: the copy into it was a no-op
    and the load returned meta tensors, no data, where the checkpoint holds values."""
    path = str(tmp_path / "x.pt")
    with Checkpointer() as ck:
        ck.save({"model": torch.nn.Linear(64, 32).state_dict()}, path).wait()
        with torch.device("meta"):
            model = torch.nn.Linear(64, 32)
        with pytest.raises(ConfigError, match=r"\['model'\]\['weight'\]: into= has a tensor on the meta device.*"
                                              r"module.to_empty\(device='cpu'\)"):
            ck.load(path, into={"model": model.state_dict()})
        model.to_empty(device="cpu")
        got = ck.load(path, into={"model": model.state_dict()})
        assert got["model"]["weight"].data_ptr() == model.weight.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["in-place", "copied"])
def test_an_inference_tensor_is_refused_outside_inference_mode(tmp_path, dtype: torch.dtype) -> None:
    """torch lets only code inside inference_mode write an inference tensor: the load wrote the
    saved bytes into it, then raised torch's RuntimeError. Now nothing is written; inside
    inference_mode the load reads into it."""
    path = str(tmp_path / "x.pt")
    with Checkpointer() as ck:
        ck.save({"w": torch.arange(4096.0)}, path).wait()
        with torch.inference_mode():
            mine = torch.zeros(4096, dtype=dtype)
        with pytest.raises(ConfigError, match=r"\['w'\]: into= has an inference tensor.*torch.inference_mode"):
            ck.load(path, into={"w": mine})
        assert not mine.any()
        with torch.inference_mode():
            got = ck.load(path, into={"w": mine})
        assert got["w"] is mine and torch.equal(mine, torch.arange(4096.0, dtype=dtype))


def test_a_sparse_tensor_and_a_dense_one_are_refused_for_each_other(tmp_path) -> None:
    """copy_ between dense and sparse tensors fails: it raised torch's RuntimeError after the read."""
    path = str(tmp_path / "x.pt")
    with Checkpointer() as ck:
        ck.save({"s": torch.eye(4).to_sparse(), "d": torch.ones(3)}, path).wait()
        with pytest.raises(ConfigError, match=r"\['s'\]: saved as a sparse_coo tensor, into= has a dense one.*"
                                              r"\['d'\]: saved as a dense tensor, into= has a sparse_coo one"):
            ck.load(path, into={"s": torch.zeros(4, 4), "d": torch.zeros(3).to_sparse()})
        got = ck.load(path, into={"s": torch.zeros(4, 4).to_sparse()})  # sparse into sparse: copied in
        assert torch.equal(got["s"].to_dense(), torch.eye(4))


def test_a_corrupt_local_copy_falls_back_and_the_tensors_end_right(tmp_path) -> None:
    """The first copy's damaged bytes were read into the tensors: the next copy reads them again."""
    saved, mine = _model(0), _model(1)
    path = str(tmp_path / "home" / "f.pt")
    with Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        ck.save(_state(saved), path).wait()
        flip_byte(ck.local_path(path), os.path.getsize(path) // 3)  # inside the first large record
        got = ck.load(path, into={"model": mine.state_dict()})
        assert all(torch.equal(mine.state_dict()[k], v) for k, v in saved.state_dict().items())
        assert got["model"]["0.weight"].data_ptr() == mine[0].weight.data_ptr()
        flip_byte(path, os.path.getsize(path) // 3)
        with pytest.raises(CorruptCheckpointError):
            ck.load(path, into={"model": mine.state_dict()})


def test_a_record_shared_by_two_places_is_read_once_into_their_memory(tmp_path) -> None:
    """Tied weights: two keys, one storage, saved once; into= ties them the same way."""
    w = torch.randn(256, 512)
    path = str(tmp_path / "t.pt")
    with Checkpointer() as ck:
        ck.save({"embed": w, "head": w}, path).wait()
        mine = torch.zeros(256, 512)
        got = ck.load(path, into={"embed": mine, "head": mine})
    assert got["embed"] is mine and got["head"] is mine and torch.equal(mine, w)


def test_module_load_reads_into_a_plain_torch_save_file(tmp_path) -> None:
    """A file written by torch.save (no manifest, 64-byte aligned records) loads unverified and
    still fills the tensors, by copy."""
    saved, mine = _model(0), _model(1)
    path = str(tmp_path / "plain.pt")
    torch.save(_state(saved), path)
    dest = {"model": mine.state_dict()}
    got = fastckpt.load(path, into=dest)
    assert all(torch.equal(mine.state_dict()[k], v) for k, v in saved.state_dict().items())
    assert got["model"]["2.weight"] is dest["model"]["2.weight"]


def test_into_over_an_object_store_read(tmp_path) -> None:
    """Ranged reads fill the given tensors' memory too (fsspec's memory file system)."""
    saved, mine = _model(0), _model(1)
    path = str(tmp_path / "m.pt")
    with Checkpointer() as ck:
        ck.save(_state(saved), path).wait()
    url = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run"
    open_target(url, parallelism=2).put_file(path, "m.pt", chunk_bytes=MiB)
    dest = {"model": mine.state_dict()}
    got = fastckpt.load(f"{url}/m.pt", into=dest)
    assert all(torch.equal(mine.state_dict()[k], v) for k, v in saved.state_dict().items())
    assert got["model"]["0.weight"].data_ptr() == mine[0].weight.data_ptr()


def test_only_the_named_tensors_memory_is_written(tmp_path) -> None:
    """A tensor of into that is a view of a larger buffer gets its values copied in: reading the
    record in place would also write the rest of the buffer, which into= does not name."""
    saved = torch.randn(200_000)
    path = str(tmp_path / "v.pt")
    with Checkpointer() as ck:
        ck.save({"w": saved[:100_000].clone(), "whole": saved}, path).wait()
        buf = torch.zeros(200_000)
        got = ck.load(path, into={"w": buf[:100_000]})
    assert torch.equal(buf[:100_000], saved[:100_000]) and torch.equal(buf[100_000:], torch.zeros(100_000))
    assert got["w"].data_ptr() == buf.data_ptr() and torch.equal(got["whole"], saved)


def test_a_graph_that_saved_a_tensor_read_in_place_refuses_to_use_it(tmp_path, monkeypatch) -> None:
    """Writing a parameter's memory bumps its version, as an in-place op would: backward through a
    graph built before the load raises instead of computing with the new values."""
    lin = torch.nn.Linear(1024, 1024)
    path = str(tmp_path / "g.pt")
    copies: list = []
    with Checkpointer() as ck:
        ck.save({"w": torch.randn(1024, 1024)}, path).wait()
        monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, *a: copies.append(1) or self)  # none may run
        x = torch.randn(4, 1024, requires_grad=True)
        loss = (x @ lin.weight).square().sum()  # saves lin.weight, for the gradient of x
        before = lin.weight._version
        ck.load(path, into={"w": lin.weight})
    assert copies == [] and lin.weight._version > before  # read in place, not copied in
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_trusted_pickle_is_not_run_before_its_file_is_verified(tmp_path) -> None:
    """weights_only=False: finding the records' places would run the file's pickle before its
    checksum is checked, so every tensor is copied in after the verified load instead."""
    state = {f"t{i}": torch.randn(300_000) for i in range(4)}
    path = str(tmp_path / "trusted.pt")
    with Checkpointer() as ck:
        ck.save(state, path).wait()
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        with ThreadPoolExecutor(2) as pool:
            res = engine.read_file(FileOps(), pool, path, chunk_bytes=16 * MiB,
                                   into=partial(heap_image, into=dest, weights_only=False))
        assert isinstance(res.buffer, HeapImage)
        assert all(torch.equal(v, torch.zeros_like(v)) for v in dest.values())  # nothing read into them
        got = ck.load(path, weights_only=False, into=dest)
    assert all(torch.equal(dest[k], v) and got[k] is dest[k] for k, v in state.items())


def _grow_record(path: str, record: str, by: int) -> None:
    """Damage the sizes the zip's central directory gives ``record`` (``.../data/0``): ``by`` more."""
    data = bytearray(open(path, "rb").read())
    name = next(n for n in zipfile.ZipFile(path).namelist() if n.endswith(f"/{record}")).encode()
    at = data.find(b"PK\x01\x02")
    while data[at + 46 : at + 46 + struct.unpack_from("<H", data, at + 28)[0]] != name:
        at = data.find(b"PK\x01\x02", at + 4)
    csize, usize = struct.unpack_from("<II", data, at + 20)
    struct.pack_into("<II", data, at + 20, csize + by, usize + by)
    open(path, "wb").write(data)


def test_a_damaged_record_size_never_writes_past_the_tensor(tmp_path) -> None:
    """The zip's directory is read before the checksum is known: a record size there that differs
    from the pickle's is damage, refused before any byte lands in the tensors (read in place, the
    64 bytes more went past the tensor's storage into memory it does not own)."""
    path = str(tmp_path / "x.pt")
    with Checkpointer() as ck:
        ck.save({"a": torch.randn(20_000), "b": torch.randn(2_000_000)}, path).wait()
    _grow_record(path, "data/0", 64)  # "a": 80,000 bytes, a record of its own
    backing = bytearray(b"\xaa" * (80_000 + 4096))  # the tensor's 80,000 bytes, then memory it does not own
    a = torch.frombuffer(memoryview(backing)[:80_000], dtype=torch.float32)
    assert a.untyped_storage().nbytes() == 80_000
    with pytest.raises(CorruptCheckpointError, match=str(path)):
        fastckpt.load(path, into={"a": a, "b": torch.zeros(2_000_000)})
    assert bytes(backing) == b"\xaa" * (80_000 + 4096)  # neither the tensor nor what follows it was written


def test_without_block_digests_the_checksum_judges_a_pickle_that_does_not_match(tmp_path, monkeypatch) -> None:
    """A file too large for its manifest to list block digests (over 46.9 GiB; here: none listed)
    cannot have its pickle verified alone: into= that does not match it is then judged after the
    whole file is read and verified, without reading into the tensors: damage is corruption, a
    genuine mismatch a ConfigError."""
    monkeypatch.setattr("fastckpt.format.manifest.MAX_LISTED_BLOCKS", 0)
    saved, mine = _model(0), _model(1)
    path = str(tmp_path / "x.pt")
    with Checkpointer() as ck:
        ck.save(_state(saved), path).wait()
        before = {k: v.clone() for k, v in mine.state_dict().items()}
        with pytest.raises(ConfigError, match="does not match"):
            ck.load(path, into={"model": mine.state_dict(), "extra": torch.zeros(3)})
        data = open(path, "rb").read()
        flip_byte(path, data.index(b"2.weight", torch._C.PyTorchFileReader(path).get_record_offset("data.pkl")), 0x01)
        with pytest.raises(CorruptCheckpointError, match=f"{path} is corrupt"):
            ck.load(path, into={"model": mine.state_dict()})
    assert all(torch.equal(v, before[k]) for k, v in mine.state_dict().items())


@pytest.mark.parametrize("map_location", ["meta", torch.device("meta"), {"cpu": "meta"}])
def test_into_with_map_location_meta_is_refused_naming_both(tmp_path, map_location: object) -> None:
    """The meta device holds no data to copy into into='s tensors: before, torch's bare
    NotImplementedError "Cannot copy out of meta tensor" came after the whole read."""
    path = str(tmp_path / "x.pt")
    with Checkpointer() as ck:
        ck.save({"w": torch.arange(8.0)}, path).wait()
    dest = {"w": torch.zeros(8)}
    with pytest.raises(ConfigError, match=r"map_location=.*meta.*into=.*Pass one of them"):
        fastckpt.load(path, map_location=map_location, into=dest)
    assert torch.equal(dest["w"], torch.zeros(8))
    assert fastckpt.load(path, map_location="meta")["w"].is_meta
