"""format.py: the layout torch writes under skip_data, the storage keys we derive, the manifest
in the zip comment, and that plain torch.load reads what fastckpt writes."""

from __future__ import annotations

import collections
import io
import json
import struct
import zipfile

import pytest
import torch
import xxhash
from torch.utils.serialization import config as ser_config

import fastckpt
from fastckpt.cli._listing import list_checkpoints
from fastckpt.errors import UnsupportedObjectError
from fastckpt.format import layout as F
from fastckpt.format import manifest as M
from fastckpt.format import walk


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


def _zip_offsets(buf: io.BytesIO) -> dict[str, int]:
    buf.seek(0)
    reader = torch._C.PyTorchFileReader(buf)
    return {r: reader.get_record_offset(r) for r in reader.get_all_records() if r.startswith("data/")}


@pytest.mark.parametrize("page_aligned", [None, True, False])
def test_plan_matches_torch_records(page_aligned) -> None:
    sd = _state()
    layout = F.plan(sd, page_aligned=page_aligned)
    assert layout.data_size > 0
    keys = [s.key for s in layout.storages]
    assert keys == [str(i) for i in range(len(keys))]
    # one record per distinct storage: w and view share theirs
    assert len(layout.storages) == 5
    assert layout.align == (F.ALIGN if page_aligned else F.SMALL_ALIGN)  # None: small tensors pack
    by_ptr = {s.storage.data_ptr(): s for s in layout.storages}
    assert by_ptr[sd["w"].untyped_storage().data_ptr()].nbytes == sd["w"].untyped_storage().nbytes()
    assert walk.key_path(sd, lambda v: v is sd["w"]) == "state['w']"
    # the offsets taken from torch's seeks are those its own reader finds in the written file
    buf = io.BytesIO()  # the same archive name as the plan's
    old = ser_config.save.storage_alignment
    ser_config.save.storage_alignment = layout.align
    try:
        torch.save(sd, buf)
    finally:
        ser_config.save.storage_alignment = old
    assert buf.getbuffer().nbytes == layout.data_size
    want = _zip_offsets(buf)
    assert {f"data/{s.key}": s.offset for s in layout.storages if s.nbytes} == \
        {k: v for k, v in want.items() if layout.storages[int(k[5:])].nbytes}
    assert all(s.offset % layout.align == 0 for s in layout.storages if s.nbytes)


def test_offsets_from_zip_directory_agree_with_seeks() -> None:
    # the slow way stays as the fallback: it must give the same answer
    sd = _state()
    layout = F.plan(sd)
    sizes = [s.nbytes for s in layout.storages]
    slow = F._offsets_from_zip(list(layout.segments), layout.data_size, sizes)
    assert [o for o, n in zip(slow, sizes) if n] == [s.offset for s in layout.storages if s.nbytes]


def test_alignment_choice() -> None:
    big = {"w": torch.zeros(1 << 20), **{f"s{i}": torch.tensor(float(i)) for i in range(10)}}
    assert F.plan(big).align == F.ALIGN  # at most 11 pages of padding on 4 MiB: under PAD_BUDGET
    small = {f"s{i}": torch.zeros(4) for i in range(10)}
    assert F.plan(small).align == F.SMALL_ALIGN
    assert F.choose_align([1 << 20] * 3) == F.ALIGN and F.choose_align([4096] * 3) == F.SMALL_ALIGN
    assert F.choose_align([4096], page_aligned=True) == F.ALIGN and F.choose_align([1 << 30], page_aligned=False) == 64


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


@pytest.mark.filterwarnings("ignore:.*quantize")
def test_quantized_tensor_named() -> None:
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(UnsupportedObjectError, match=r"state\['m'\]\['q'\].*dequantize\(\)"):
        F.plan({"m": {"w": torch.ones(2), "q": q}})


@pytest.mark.parametrize("plain", [True, False])
def test_two_dtypes_viewing_one_storage_name_both_keys_and_the_clone(tmp_path, plain: bool) -> None:
    """torch.save refuses them naming neither; fastckpt said "cannot save state: ... Only tensors,
    containers and plain Python values can be saved", a wrong reason naming no key. ``plain``:
    the memoised walk's path; else the general one (a float key in the state)."""
    t = torch.arange(16, dtype=torch.float32)
    state = {"a": t, "opt": [t[2:4], {"b": t.view(torch.int32)}]}
    if not plain:
        state["extra"] = {2.5: "a float key"}
    why = (r"cannot save state\['a'\] \(torch.float32\) and state\['opt'\]\[1\]\['b'\] \(torch.int32\): they view "
           r"one storage as two dtypes, .*give one of them a copy of its own \(e.g. save "
           r"state\['opt'\]\[1\]\['b'\].clone\(\) in its place\)")
    with pytest.raises(UnsupportedObjectError, match=why):
        F.plan(state)
    with fastckpt.Checkpointer() as ck, pytest.raises(UnsupportedObjectError, match=why):
        ck.save(state, str(tmp_path / "x.pt")).wait()
    assert not (tmp_path / "x.pt").exists()
    state["opt"][1]["b"] = t.view(torch.int32).clone()  # the fix the message names
    with fastckpt.Checkpointer() as ck:
        ck.save(state, str(tmp_path / "x.pt")).wait()
    assert torch.equal(fastckpt.load(str(tmp_path / "x.pt"))["opt"][1]["b"], t.view(torch.int32))


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
    step = checksum.BLOCK_BYTES
    want = [checksum.block_digest(data[o : o + step]) for o in range(0, len(data), step)]
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
    cyclic: list = [torch.ones(2)]
    cyclic.append(cyclic)
    states.append({"c": cyclic, "t": (shared, [cyclic, torch.zeros(3)])})
    for sd in states:
        fast = walk.scan(sd)
        assert fast is not None
        assert [s._cdata for s in fast.storages] == [s._cdata for s in walk.pickling_order(sd)]


def test_custom_objects_fall_back_to_pickling_order(tmp_path) -> None:
    sd = {"cfg": F.StorageRecord, "w": torch.arange(5)}  # a class: not a plain value
    assert walk.scan(sd) is None
    path = tmp_path / "c.pt"
    with fastckpt.Checkpointer() as ck:
        ck.save(sd, str(path)).wait()
        assert torch.equal(ck.load(str(path), weights_only=False)["w"], torch.arange(5))


def test_only_a_zip_can_be_a_damaged_checkpoint(tmp_path) -> None:
    """A damaged end record leaves a fastckpt file damaged, never a plain file, also when text
    grown onto its end pushes the record out of the tail; but a text file whose last bytes quote
    a manifest (a docs page, a test's source, a log) or a tar of a checkpoint starts as no zip:
    ls listed them damaged, verify failed them and remove() deleted them."""
    path = tmp_path / "a.pt"
    with fastckpt.Checkpointer() as ck:
        ck.save({"w": torch.zeros(4)}, str(path)).wait()
    data = path.read_bytes()
    at = data.rindex(M.EOCD_SIG)
    flipped = data[:at] + b"PK\x05\x07" + data[at + 4 :]  # one damaged byte in the signature
    with pytest.raises(fastckpt.CorruptCheckpointError, match="trailer holding the fastckpt manifest is damaged"):
        M.parse_tail(flipped[-M.TAIL_BYTES :], len(flipped))
    page = b"# Format\n\nThe zip comment reads:\n\n    " + data[at + M.EOCD_LEN :] + b"\n"
    (tmp_path / "format.md").write_bytes(page)
    assert M.parse_tail(page[-M.TAIL_BYTES :], len(page)) is None
    tar = tmp_path / "archive.tar"  # the archive's end record is followed by tar's padding
    tar.write_bytes(b"a.pt".ljust(512, b"\0") + data + bytes(512 - len(data) % 512) + bytes(1024))
    grown = tmp_path / "grown.pt"  # a log appended to the wrong name: the end record leaves the tail, "covered" not
    comment = data[at + M.EOCD_LEN :]
    grow = M.TAIL_BYTES - (len(comment) - comment.index(b'"covered":')) + 5
    grown.write_bytes(data + (b"I1207 step ok loss=0.1234\n" * (grow // 26 + 1))[:grow])
    with pytest.raises(fastckpt.CorruptCheckpointError, match="grown.pt: the zip trailer holding the fastckpt"):
        fastckpt.load(str(grown))
    grown.unlink()
    assert [(e.path, e.status) for e in list_checkpoints(str(tmp_path))] == [(str(path), "complete")]
    assert fastckpt.latest(str(tmp_path)) == str(path)
    with fastckpt.Checkpointer() as ck:
        for stray in (tar, tmp_path / "format.md"):
            with pytest.raises(fastckpt.ConfigError, match="it is not a checkpoint"):
                ck.remove(str(stray))
            assert stray.exists()


def test_a_signature_inside_the_end_record_never_makes_a_valid_file_look_cut_short(tmp_path) -> None:
    """The end-of-directory record's own fields can hold the bytes of its signature: here its
    directory offset ends in b"PK" and its comment is 0x0605 bytes long. The search finds that
    copy first; its "comment length" overruns the file, and the real record behind it fits."""
    path = tmp_path / "a.pt"
    with fastckpt.Checkpointer() as ck:
        ck.save({"w": torch.zeros(4)}, str(path)).wait()
    data = path.read_bytes()
    manifest = M.parse_tail(data[-M.TAIL_BYTES:], len(data))
    compact = json.dumps(manifest, separators=(",", ":"), sort_keys=True).encode()
    body = compact[:-1] + b" " * (0x0605 - 38 - len(compact)) + b"}"
    comment = b'{"fastckpt":' + body + b',"sum":"' + xxhash.xxh3_64_hexdigest(body).encode() + b'"}'
    assert len(comment) == 0x0605
    eocd = M.EOCD_SIG + bytes(12) + b"\x00\x00PK" + struct.pack("<H", len(comment))
    assert eocd.rfind(M.EOCD_SIG) == 18
    tail = b"\x00" * 64 + eocd + comment
    assert M.parse_tail(tail, len(tail)) == manifest


def test_a_file_of_a_later_format_says_a_newer_fastckpt_may_have_written_it(tmp_path, caplog) -> None:
    """A manifest of format 2, its sum intact (what a newer fastckpt would write), was reported
    only as "its format is 2 ... not 1": the reader was not told that upgrading may read it, nor
    that latest() resumes the checkpoint before it. Still damage to this version (a damaged digit
    reads the same), now with both told."""
    with fastckpt.Checkpointer() as ck:
        for step in (1, 2):
            ck.save({"w": torch.ones(8), "step": step}, str(tmp_path / f"step-{step}.pt")).wait()
    p = tmp_path / "step-2.pt"
    data = p.read_bytes()
    i = data.rfind(b"PK\x05\x06")
    m = json.loads(data[i + 22:])["fastckpt"]
    m["format"], m["versions"]["fastckpt"] = 2, "9.0.0"
    body = json.dumps(m, separators=(",", ":"), sort_keys=True).encode()
    new = b'{"fastckpt":' + body + b',"sum":"' + xxhash.xxh3_64_hexdigest(body).encode() + b'"}'
    p.write_bytes(data[: i + 20] + struct.pack("<H", len(new)) + new)
    told = "A newer fastckpt may have written it (it names fastckpt 9.0.0): this is fastckpt "
    with pytest.raises(fastckpt.CorruptCheckpointError, match="upgrade fastckpt where this runs") as e:
        fastckpt.load(str(p))
    assert told in str(e.value)
    with caplog.at_level("WARNING", logger="fastckpt"):
        assert fastckpt.latest(str(tmp_path)) == str(tmp_path / "step-1.pt")
    assert any(told in r.getMessage() and "a resume takes the one before" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="fastckpt"):  # a file is judged alone: its folder's others say nothing
        assert fastckpt.latest(str(tmp_path / "step-1.pt")) == str(tmp_path / "step-1.pt")
    assert not [r for r in caplog.records if "skipping" in r.getMessage()]


_DTENSOR_BESIDE_A_LOCK = """
import os, socket, sys, threading, torch, torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
import fastckpt
dt = distribute_tensor(torch.ones(4, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
try:
    with fastckpt.Checkpointer() as ck:
        ck.save({"model": {"w": dt}, "sampler_lock": threading.Lock()}, sys.argv[1]).wait()
except fastckpt.UnsupportedObjectError as exc:
    print("refused:", exc)
finally:
    dist.destroy_process_group()
"""


def test_a_dtensor_beside_an_unpicklable_entry_does_not_hide_its_name(tmp_path) -> None:
    """The two-dtypes diagnosis read every tensor's storage address; a DTensor (FSDP2, tensor
    parallel) has none to read, and its RuntimeError replaced the error naming the entry."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _DTENSOR_BESIDE_A_LOCK, str(tmp_path / "a.pt")], capture_output=True,
                       text=True, timeout=120)
    assert "refused: cannot save state['sampler_lock']: cannot pickle" in r.stdout, r.stdout + r.stderr

