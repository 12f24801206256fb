"""Loads never report false corruption, never load damaged bytes unverified, and say clearly what
is wrong with a file that is not a checkpoint (issue #9 items 3, 4 and 10)."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import pickletools
import struct
import subprocess
import sys
import threading
import uuid
import zipfile
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt import CorruptCheckpointError, UnverifiableCheckpointError
from fastckpt.format.manifest import EOCD_LEN
from tests.helpers import flip_byte, read_file_manifest


def _state(v: int) -> dict:
    return {"w": torch.full((64 << 10,), v, dtype=torch.int32), "v": v}


def _save(path: Path, v: int = 1) -> Path:
    with fastckpt.Checkpointer() as ck:
        ck.save(_state(v), str(path)).wait()
    return path


def _comment_offset(path: Path) -> int:
    data = path.read_bytes()
    eocd = data.rfind(b"PK\x05\x06")
    (n,) = struct.unpack_from("<H", data, eocd + 20)
    assert eocd + EOCD_LEN + n == len(data)
    return eocd + EOCD_LEN


# ---------------------------------------------------------------------- 3: replace while reading
def test_loads_racing_a_writer_that_replaces_the_file_never_see_corruption(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    _save(path, 0)
    versions = 40
    done, errors, seen = threading.Event(), [], set()

    def reader() -> None:
        while not done.is_set():
            try:
                seen.add(int(fastckpt.load(str(path))["v"]))
            except Exception as exc:  # noqa: BLE001 (any error is a failure of the test)
                errors.append(exc)

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        with fastckpt.Checkpointer() as ck:
            for v in range(1, versions + 1):
                ck.save(_state(v), str(path)).wait()
    finally:
        done.set()
        for t in readers:
            t.join()
    assert errors == []
    assert seen <= set(range(versions + 1)) and len(seen) > 1


# ---------------------------------------------------------------------- 4: verification stays on
@pytest.mark.parametrize("where", ["comment's first byte", "manifest key", "comment length", "eocd signature",
                                   "comment zeroed", "length and comment zeroed", "cut after the comment length"])
def test_a_damaged_manifest_never_turns_verification_off(tmp_path: Path, where: str) -> None:
    """Also a comment overwritten with zeros, and a file cut right after its comment-length field
    (before: both loaded as plain torch.save files, unverified, and wrong tensors came back)."""
    path = _save(tmp_path / "a.pt")
    start = _comment_offset(path)
    if where in ("comment zeroed", "length and comment zeroed"):  # a lost last page, say
        data = path.read_bytes()
        cut = start if where == "comment zeroed" else start - 2
        path.write_bytes(data[:cut] + bytes(len(data) - cut))
    elif where == "cut after the comment length":
        path.write_bytes(path.read_bytes()[:start])
    else:
        offset = {"comment's first byte": start, "manifest key": start + 3, "comment length": start - 2,
                  "eocd signature": start - EOCD_LEN}[where]
        flip_byte(path, offset, mask=0xFF)
    flip_byte(path, 8192 + 5, mask=0xFF)  # and a data byte: without verification, wrong tensors would load
    with pytest.raises(CorruptCheckpointError):
        fastckpt.load(str(path))


def test_plain_torch_files_load_unverified_with_one_warning_and_verify_refuses_them(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "fastckpt-plain.pt"  # its zip records carry the name: not a manifest
    torch.save(_state(3), path)
    events = tmp_path / "events.jsonl"
    with caplog.at_level(logging.WARNING, logger="fastckpt"), \
            fastckpt.Checkpointer(event_log=str(events)) as ck:
        assert ck.load(str(path))["v"] == 3
        assert ck.load(str(path))["v"] == 3
        with pytest.raises(UnverifiableCheckpointError, match="verify=False"):
            ck.load(str(path), verify=True)
    warnings = [r for r in caplog.records if "unverified" in r.getMessage() and str(path) in r.getMessage()]
    assert len(warnings) == 1
    loads = [e for e in map(json.loads, events.read_text().splitlines()) if e["name"] == "load"]
    assert [(e["detail"] or "").endswith(" unverified") for e in loads] == [True, True, False]
    assert loads[2]["error"].startswith("UnverifiableCheckpointError(")  # refused: a failed load
    assert read_file_manifest(path) is None


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_legacy_torch_save_files_of_every_pickle_protocol_load(tmp_path: Path, protocol: int) -> None:
    """torch.save's pre-zip format starts with the pickle protocol's header (before: only
    protocol 2's was known, and 3-5 were reported corrupt)."""
    path = tmp_path / "legacy.pt"
    torch.save(_state(protocol), path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    if protocol >= 4:  # torch's weights-only unpickler refuses their FRAME opcode: so do we, the same way
        with pytest.raises(pickle.UnpicklingError):
            torch.load(path)
        with pytest.raises(pickle.UnpicklingError):
            fastckpt.load(str(path))
    got = fastckpt.load(str(path), weights_only=protocol < 4)
    assert got["v"] == protocol and torch.equal(got["w"], _state(protocol)["w"])


@pytest.mark.parametrize("trailer", [b"PK\x05\x06" + bytes(16) + b"\xff\xff",  # "comment" past the end
                                     b"PK\x05\x06" + bytes(16) + b"\x01\x00\x00"])  # a 1-byte "comment", not text
def test_a_legacy_file_ending_in_bytes_that_look_like_an_end_record_loads(tmp_path: Path, trailer: bytes) -> None:
    """A pre-zip torch.save file whose last tensor ends in the end-of-directory signature: only a
    record whose central directory (or zip64 locator) sits right before it is judged."""
    tail = torch.frombuffer(bytearray(trailer), dtype=torch.uint8)
    t = torch.cat([torch.arange(4096, dtype=torch.uint8) % 251, tail])
    path = tmp_path / "legacy.pt"
    torch.save({"w": t}, path, _use_new_zipfile_serialization=False)
    assert path.read_bytes().endswith(trailer)
    assert torch.equal(fastckpt.load(str(path))["w"], t)


def test_the_top_level_load_maps_the_file_with_mmap_true(tmp_path: Path) -> None:
    path = _save(tmp_path / "a.pt", v=4)
    got = fastckpt.load(str(path), mmap=True)
    assert got["v"] == 4 and torch.equal(got["w"], _state(4)["w"])


# ---------------------------------------------------------------------- 10: clear errors
@pytest.mark.parametrize("damage", ["empty", "not a zip", "truncated"])
def test_damaged_files_raise_corruption_naming_the_file(tmp_path: Path, damage: str) -> None:
    path = _save(tmp_path / "a.pt")
    data = path.read_bytes()
    path.write_bytes({"empty": b"", "not a zip": b"hello, world" * 100, "truncated": data[: len(data) // 2]}[damage])
    with pytest.raises(CorruptCheckpointError, match=str(path)) as ei:
        fastckpt.load(str(path))
    assert {"empty": "empty", "not a zip": "not a torch.save file", "truncated": "truncated"}[damage] in str(ei.value)


def test_an_intact_file_of_another_tool_is_not_called_truncated(tmp_path: Path) -> None:
    """A ``pickle.dump`` file "ends inside its pickle 2 of 5" (taken for torch's pre-zip format) and
    another tool's zip was "truncated or damaged": a false corruption report sending the user to an
    earlier checkpoint. Both are named as not torch.save files; a real pre-zip file still loads."""
    import pickle
    import zipfile

    pkl, zf = tmp_path / "results.pkl", tmp_path / "bundle.zip"
    pkl.write_bytes(pickle.dumps({"acc": 0.9}, protocol=2))
    with zipfile.ZipFile(zf, "w") as z:
        z.writestr("notes.txt", "hello")
        z.writestr("a/b/data.pkl", pickle.dumps(1))
    for path, what in ((pkl, "a pickle whose first object is not torch's magic number"),
                       (zf, "a zip archive without torch's <archive>/data.pkl")):
        with pytest.raises(CorruptCheckpointError, match="is not a torch.save file") as ei:
            fastckpt.load(str(path))
        assert what in str(ei.value) and "truncated" not in str(ei.value)
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, str(legacy), _use_new_zipfile_serialization=False)
    assert torch.equal(fastckpt.load(str(legacy))["w"], torch.ones(3))


# ---------------------------------------------------------------------- a manifest that parses, damaged
_DAMAGE = {"checksum key": (b'"checksum":', b'"checksul":'), "value key": (b'"value":', b'"valuf":'),
           "covered key": (b'"covered":', b'"coverec":'), "a block digest": (b'"blocks":"', b'"blocks":"x'),
           "group key": (b'"group":', b'"grouq":'), "format": (b'"format":1', b'"format":0'),
           "kind": (b'"kind":"file"', b'"kind":"filf"'), "rank": (b'"rank":0', b'"rank":1'),
           "tier": (b'"tier":"direct"', b'"tier":"dirEct"'), "sum key": (b'"sum":"', b'"sun":"')}


def _damage_manifest(path: str, what: str) -> None:
    """One byte of the manifest's JSON changed so that it still parses (``what``: ``_DAMAGE``)."""
    key, new = _DAMAGE[what]
    data = Path(path).read_bytes()
    at = data.rfind(key)
    assert at > _comment_offset(Path(path))
    cut = at + len(key) + (len(new) - len(key))  # "a block digest": its first digit replaced
    Path(path).write_bytes(data[:at] + new + data[cut:])


@pytest.mark.parametrize("what", list(_DAMAGE))
def test_a_manifest_that_parses_but_is_damaged_is_corruption(tmp_path: Path, what: str) -> None:
    """The manifest holds the checksum, so no checksum covers it: one damaged byte in a key still
    parses as JSON. That is corruption naming the file, not a KeyError."""
    path = _save(tmp_path / "a.pt")
    _damage_manifest(str(path), what)
    with pytest.raises(CorruptCheckpointError, match=str(path)):
        fastckpt.load(str(path))


def test_a_manifest_whose_listed_block_digest_changed_is_corruption(tmp_path: Path) -> None:
    """A block digest changed to another valid one: the manifest's sum says so (and, in a file
    written before there was a sum, the digests no longer combine to the checksum)."""
    path = _save(tmp_path / "a.pt")
    data = path.read_bytes()
    at = data.rfind(b'"blocks":"') + len(b'"blocks":"')
    digit = b"%x" % ((int(data[at : at + 1], 16) + 1) % 16)
    path.write_bytes(data[:at] + digit + data[at + 1 :])
    with pytest.raises(CorruptCheckpointError, match="sum"):
        fastckpt.load(str(path))
    _legacy_comment(path)
    with pytest.raises(CorruptCheckpointError, match="block digests"):
        fastckpt.load(str(path))


def _legacy_comment(path: Path) -> None:
    """Rewrite the file's comment as files were written before the manifest had a sum:
    ``{"fastckpt": manifest}`` alone (the checksum covers neither the length field nor it)."""
    start = _comment_offset(path)
    data = path.read_bytes()
    comment = data[start:]
    body = comment[len(b'{"fastckpt":') : comment.rindex(b',"sum":"')]
    legacy = b'{"fastckpt":' + body + b"}"
    path.write_bytes(data[: start - 2] + struct.pack("<H", len(legacy)) + legacy)


def test_a_file_written_before_the_manifest_had_a_sum_still_loads_verified(tmp_path: Path) -> None:
    path = _save(tmp_path / "a.pt", v=5)
    _legacy_comment(path)
    assert fastckpt.load(str(path), verify=True)["v"] == 5
    flip_byte(path, 8192 + 5, mask=0xFF)
    with pytest.raises(CorruptCheckpointError, match=str(path)):
        fastckpt.load(str(path))


@pytest.mark.parametrize("home", ["directory", "object store"])
def test_a_burst_buffer_copy_whose_manifest_lost_a_key_falls_back(tmp_path: Path, home: str) -> None:
    """The copy at home is good: the load reads it, as for any other damage to the local copy."""
    url = str(tmp_path / "home" / "x.pt") if home == "directory" else f"memory://fastckpt-{uuid.uuid4().hex[:8]}/x.pt"
    state = _state(5)
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        ck.save(state, url).wait()
        _damage_manifest(ck.local_path(url), "checksum key")
        got = ck.load(url)
        assert torch.equal(got["w"], state["w"]) and ck.stats().last_restore_from != "local"


@pytest.mark.parametrize("damage", ["cut 400 bytes short", "cut 5000 bytes short", "zeroed"])
def test_a_home_copy_that_lost_its_manifest_falls_back_to_the_burst_buffer(tmp_path: Path, damage: str) -> None:
    """Without its manifest the home copy is no plain torch.save file that replaced ours (that
    would be a complete zip): when the bytes it still holds are the local copy's, it is ours,
    damaged, and the intact local copy loads (helper review D6). A file zeroed whole shows no save:
    it may be another node's newer one, so the load refuses, naming both copies and the fix."""
    path = tmp_path / "home" / "x.pt"
    state = _state(6)
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        ck.save(state, str(path)).wait()
        size = path.stat().st_size
        if damage == "zeroed":
            path.write_bytes(bytes(size))
            with pytest.raises(CorruptCheckpointError, match="could not be shown to be of the same save") as err:
                ck.load(str(path))
            assert f"copy {ck.local_path(str(path))} over it" in str(err.value)
        else:
            os.truncate(path, size - int(damage.split()[1]))
            got = ck.load(str(path))
            assert torch.equal(got["w"], state["w"]) and ck.stats().last_restore_from == "local"
    torch.save({"plain": 1}, path)  # a complete plain zip there is another save: loaded, not ours
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        assert ck.load(str(path), verify=False) == {"plain": 1}


def test_a_corrupt_last_copy_is_reported_as_corrupt_not_missing(tmp_path: Path) -> None:
    """The copy at the path is missing (its replication never finished, or it was removed) and the
    burst-buffer copy is damaged: that is corruption, naming both, never "not found", which a job
    may take for "start fresh"."""
    path = str(tmp_path / "home" / "x.pt")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        ck.save(_state(2), path).wait()
        Path(path).unlink()
        flip_byte(ck.local_path(path), 300)
        with pytest.raises(CorruptCheckpointError) as err:
            ck.load(path)
    assert not isinstance(err.value, FileNotFoundError)
    assert f"{ck.local_path(path)} is corrupt" in str(err.value) and f"{path} does not exist" in str(err.value)


def test_latest_judges_a_file_whose_sidecar_is_damaged_by_its_object(tmp_path: Path) -> None:
    """On an object store a single file is published by its sidecar. A damaged one (a partial
    copy between buckets, an edit) says nothing: the object is judged by its own manifest, as a
    load judges it (it was passed over for the save before it, so a resume went back a save), and
    never fails every resume on a JSON error. An object damaged too is no candidate."""
    import fsspec

    bucket = f"fastckpt-{uuid.uuid4().hex[:8]}"
    root, fs = f"memory://{bucket}/run", fsspec.filesystem("memory")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        ck.save(_state(1), f"{root}/a.pt").wait()
        ck.save(_state(2), f"{root}/b.pt").wait()
        assert ck.latest(root).endswith(f"{bucket}/run/b.pt")
        fs.pipe_file(f"/{bucket}/run/b.pt.fastckpt.json", b'{"written_at": 1')
        assert ck.latest(root).endswith(f"{bucket}/run/b.pt")
        assert fastckpt.latest(root).endswith(f"{bucket}/run/b.pt")
        fs.pipe_file(f"/{bucket}/run/b.pt", fs.cat_file(f"/{bucket}/run/b.pt")[:-30])  # its own manifest cut off
        assert ck.latest(root).endswith(f"{bucket}/run/a.pt")
        assert fastckpt.latest(root).endswith(f"{bucket}/run/a.pt")


def _plain_state() -> dict:
    return {"m": {f"p{i}": torch.arange(100.0) + i for i in range(20)}, "step": 3}


@pytest.mark.parametrize("damage", ["legacy cut in its pickle", "legacy cut in its storages", "zip pickle opcode",
                                    "zip pickle argument"])
def test_damaged_plain_torch_files_raise_corruption_not_torch_internals(tmp_path: Path, damage: str) -> None:
    """A plain torch.save file has no checksum: whatever torch raises on its damaged bytes (before:
    a raw struct.error or IndexError, or an UnpicklingError whose note advised weights_only=False)
    is corruption naming the file."""
    path = tmp_path / "plain.pt"
    torch.save(_plain_state(), path, _use_new_zipfile_serialization=damage.startswith("zip"))
    data = bytearray(path.read_bytes())
    if damage.startswith("legacy"):
        data = data[: 417 if "pickle" in damage else 1407]
    else:
        pk = torch._C.PyTorchFileReader(str(path)).get_record_offset("data.pkl")
        at, mask = (pk + 7, 0x10) if damage == "zip pickle opcode" else (pk + 100, 0x01)
        data[at] ^= mask
    path.write_bytes(bytes(data))
    for mmap in (False, True):
        with pytest.raises(CorruptCheckpointError, match=f"{path} is truncated or damaged") as err:
            fastckpt.load(str(path), mmap=mmap)
        assert "weights_only=False" not in str(err.value) + "".join(getattr(err.value, "__notes__", []))


class _NotAllowed:
    """A class weights_only=True refuses."""


def test_a_plain_file_holding_a_refused_class_keeps_the_weights_only_refusal(tmp_path: Path) -> None:
    """Its pickle is well formed: that is a refusal to opt out of, not damage."""
    path = tmp_path / "obj.pt"
    torch.save({"cfg": _NotAllowed(), "w": torch.ones(3)}, path)
    with pytest.raises(pickle.UnpicklingError) as err:
        fastckpt.load(str(path))
    assert not isinstance(err.value, CorruptCheckpointError)
    assert "weights_only=False" in "".join(getattr(err.value, "__notes__", []))
    assert isinstance(fastckpt.load(str(path), weights_only=False)["cfg"], _NotAllowed)


@pytest.mark.parametrize("cut", ["empty", "half"])
def test_verify_true_reports_a_checkpoint_cut_short_as_damaged(tmp_path: Path, cut: str) -> None:
    """Not as a plain file to load with verify=False (before: "has no fastckpt manifest")."""
    path = _save(tmp_path / "a.pt")
    data = path.read_bytes()
    path.write_bytes(b"" if cut == "empty" else data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match=str(path)) as err:
        fastckpt.load(str(path), verify=True)
    assert not isinstance(err.value, UnverifiableCheckpointError)
    assert ("empty" if cut == "empty" else "truncated") in str(err.value) and "verify=False" not in str(err.value)


@pytest.mark.parametrize("protocol", [2, 5])  # 5: its pickles are framed
def test_verify_true_reports_a_pre_zip_file_cut_short_as_damaged(tmp_path: Path, protocol: int) -> None:
    """A pre-zip torch.save file has no end record: cut anywhere (in its pickles, in its storages,
    one byte short) it was refused as a plain file to load with verify=False. Its pickles, read
    without running them, say how long it must be; a whole one is still only unverifiable."""
    path = tmp_path / "legacy.pt"
    torch.save({**_plain_state(), "bf": torch.ones(5, dtype=torch.bfloat16), "model": torch.nn.Linear(2, 2)}, path,
               _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    data = path.read_bytes()
    with pytest.raises(UnverifiableCheckpointError, match="verify=False"):
        fastckpt.load(str(path), verify=True)
    for cut in (10, len(data) // 3, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(CorruptCheckpointError, match=f"{path} is truncated or damaged: a pre-zip") as err:
            fastckpt.load(str(path), verify=True)
        assert not isinstance(err.value, UnverifiableCheckpointError) and "verify=False" not in str(err.value)


_LOAD_UNDER_A_LIMIT = """
import resource, sys
import fastckpt
vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) << 10
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))  # 1 GiB more than it holds now
try:
    fastckpt.load(sys.argv[1], weights_only=False)
except fastckpt.CorruptCheckpointError as exc:
    print("corrupt:", exc)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads its address space from /proc")
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_damaged_memo_index_in_a_plain_file_is_corruption_not_gigabytes(tmp_path: Path, legacy: bool) -> None:
    """weights_only=False unpickles with the C unpickler, which grows and zeroes its memo array to
    the index a LONG_BINPUT names: one flipped high byte of a plain torch.save file asked for up
    to 32 GiB (a raw MemoryError here, under an address-space limit; the OOM killer without one)."""
    path = tmp_path / "plain.pt"
    state = {f"layer{i}.weight": torch.zeros(2) for i in range(150)}
    torch.save(state, path, _use_new_zipfile_serialization=not legacy)
    clean = path.read_bytes()
    if legacy:  # five pickles one after another (magic, protocol, sys info, the object, storage keys)
        start, stream = 0, io.BytesIO(clean)
        ops = [op for _ in range(5) for op in pickletools.genops(stream)]
    else:
        with zipfile.ZipFile(path) as z:
            pkl = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
        start, ops = clean.index(pkl), list(pickletools.genops(pkl))
    puts = [pos for op, _, pos in ops if op.name == "LONG_BINPUT"]
    data = bytearray(clean)
    data[start + puts[0] + 4] ^= 0x80  # its memo index past 2**31
    path.write_bytes(bytes(data))
    got = subprocess.run([sys.executable, "-c", _LOAD_UNDER_A_LIMIT, str(path)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert got.returncode == 0, got.stderr[-2000:]  # before: MemoryError
    assert got.stdout.startswith(f"corrupt: {path} is damaged: its pickle names a memo slot"), got.stdout


@pytest.mark.parametrize("verify", [True, False])
def test_a_pre_zip_length_field_past_the_end_is_damage_not_a_memory_error(tmp_path: Path, verify: bool) -> None:
    """A counted opcode (BINBYTES8) whose length got a flipped high byte: the walk of the pickles
    asked its reader for 2**62 bytes at once, and load() raised a bare MemoryError."""
    path = tmp_path / "legacy.pt"
    path.write_bytes(b"\x80\x02\x8e" + (2**62).to_bytes(8, "little") + b"x" * 100)
    with pytest.raises(CorruptCheckpointError, match=f"{path} is truncated or damaged"):
        fastckpt.load(str(path), verify=verify)


@pytest.mark.parametrize("mmap", [False, True])
def test_a_torchscript_archive_is_named_as_one_not_reported_damaged(tmp_path: Path, mmap: bool) -> None:
    """torch.load hands a TorchScript archive (torch.jit.save) to torch.jit.load; fastckpt's loader
    unpickled it as a checkpoint: a false CorruptCheckpointError (weights_only=True) or a bare
    ModuleNotFoundError '__torch__' (False). It says what the file is and what loads it."""
    path = tmp_path / "model.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))
    for weights_only in (True, False):
        with pytest.raises(fastckpt.ConfigError) as err:
            fastckpt.load(str(path), weights_only=weights_only, mmap=mmap)
        assert not isinstance(err.value, CorruptCheckpointError)
        assert str(err.value) == (f"{path} is a TorchScript archive (written by torch.jit.save), not a torch.save "
                                  f"checkpoint: load it with torch.jit.load({str(path)!r}).")
    assert isinstance(torch.jit.load(str(path)), torch.jit.ScriptModule)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a node without CUDA, where a GPU file needs map_location")
def test_an_intact_gpu_file_on_a_cpu_node_raises_torchs_error_not_corruption(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch refuses a GPU job's file on a CPU-only node without map_location (a RuntimeError
    naming the fix): that was reported as "truncated or damaged", and every earlier GPU
    checkpoint with it, so a resume script that skips damaged files dropped the run's state."""
    path = tmp_path / "gpu_step100.pt"
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")  # what a CUDA tensor records
        torch.save(_plain_state(), path)
    for mmap in (False, True):
        with pytest.raises(RuntimeError, match="map_location") as err:
            fastckpt.load(str(path), mmap=mmap)
        assert not isinstance(err.value, CorruptCheckpointError)
        assert f"{path} has no fastckpt manifest, but it is not damaged" in "".join(err.value.__notes__)
    assert fastckpt.load(str(path), map_location="cpu")["step"] == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a node without CUDA, where a GPU file needs map_location")
@pytest.mark.parametrize("forced", [False, True], ids=["default", "TORCH_FORCE_WEIGHTS_ONLY_LOAD"])
def test_an_intact_prezip_gpu_file_raises_torchs_error_without_a_copy_of_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forced: bool) -> None:
    """A pre-zip file torch cannot load here was reported "truncated or damaged" (so a resume
    script skipped it): its check went through torch.load, which copied the image and every
    storage (3x the file's memory) and, under TORCH_FORCE_WEIGHTS_ONLY_LOAD=1, refused the
    check's unpickler; then it was not checked at all. Its pickles are checked with storages on
    the meta device: none of the storages' bytes is read, and torch's error names the fix."""
    from fastckpt.load import soundness

    path = tmp_path / "gpu_step100.pt"
    state = {"m": {f"p{i}": torch.arange(4096.0) + i for i in range(20)}, "step": 3}
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(state, path, _use_new_zipfile_serialization=False)
    if forced:
        monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    fetched: list[int] = []
    real = soundness.fetcher

    def fetcher(buf):  # noqa: ANN001, ANN202 (records how many bytes each read of the image takes)
        fetch = real(buf)
        return lambda lo, hi: (fetched.append(hi - lo), fetch(lo, hi))[1]

    monkeypatch.setattr(soundness, "fetcher", fetcher)
    with pytest.raises(RuntimeError, match="map_location") as err:
        fastckpt.load(str(path))
    assert not isinstance(err.value, CorruptCheckpointError)
    note = "".join(err.value.__notes__)
    assert f"{path} has no fastckpt manifest, but it is not damaged" in note and "map_location='cpu'" in note
    assert fetched and sum(fetched) < path.stat().st_size // 4  # the pickles alone: no storage, no copy
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    assert fastckpt.load(str(path), map_location="cpu")["step"] == 3
    data = bytearray(path.read_bytes())  # the same file with a damaged name in its pickle is damage
    at = data.index(b"_rebuild_tensor_v2")
    data[at + 1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=f"{path} is truncated or damaged"):
        fastckpt.load(str(path), weights_only=False)  # (True: weights_only refuses the unknown name first)


def _prezip_storages(data: bytes) -> tuple[list, int]:
    """A pre-zip file's storage keys, and where its storages start (past its five pickles)."""
    stream = io.BytesIO(data)
    for _ in range(4):  # magic number, protocol, sys info, the object
        pickletools.dis(stream, out=io.StringIO())
    return pickle.load(stream), stream.tell()


@pytest.mark.parametrize("damage", ["storage count", "storage key"])
@pytest.mark.parametrize("weights_only", [True, False])
def test_a_prezip_file_with_a_damaged_storage_count_or_key_is_corruption_not_intact(
        tmp_path: Path, damage: str, weights_only: bool) -> None:
    """torch checks a pre-zip file's storage keys and each storage's element count only as it
    reads the storages, which the soundness check skips (``skip_data``): a file damaged there
    (torch: "storage has wrong byte size", "storage key ... not found") was called not damaged,
    with advice to pass weights_only=False. Its file is still as long as its pickles say."""
    from fastckpt.load.soundness import sound

    path = tmp_path / "prezip.pt"
    torch.save({"a": torch.arange(100.0), "b": torch.arange(50.0)}, path, _use_new_zipfile_serialization=False)
    data = bytearray(path.read_bytes())
    assert sound(bytes(data), len(data))
    keys, at = _prezip_storages(bytes(data))
    if damage == "storage count":  # the last storage's count one lower: the file is not short
        at += 8 + struct.unpack_from("<q", data, at)[0] * 4
        data[at:at + 8] = struct.pack("<q", struct.unpack_from("<q", data, at)[0] - 1)
    else:  # the last digit of a key in the keys' pickle: a storage the object never named
        i = data.rfind(str(keys[-1]).encode(), 0, at) + len(str(keys[-1])) - 1
        data[i] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=f"{path} is truncated or damaged") as err:
        fastckpt.load(str(path), weights_only=weights_only)
    assert "weights_only=False" not in str(err.value) + "".join(getattr(err.value, "__notes__", []))


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_intact_prezip_files_of_every_shape_are_sound(tmp_path: Path, protocol: int) -> None:
    """The soundness check repeats torch's checks of a pre-zip file's storages on their counts
    alone: an intact file (shared, sliced and empty storages, every element size) passes."""
    from fastckpt.load.soundness import sound

    base = torch.arange(24.0)
    state = {"shared": [base, base.view(4, 6), base[5:9]], "empty": torch.empty(0),
             "b": torch.ones(3, dtype=torch.bool), "i8": torch.arange(5, dtype=torch.int8),
             "c": torch.ones(2, dtype=torch.complex128), "bf": torch.ones(3, dtype=torch.bfloat16),
             "net": torch.nn.Linear(3, 2)}
    path = tmp_path / "prezip.pt"
    torch.save(state, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    data = path.read_bytes()
    assert sound(data, len(data))
    assert torch.equal(torch.load(path, weights_only=False)["shared"][2], base[5:9])


class _PatchedNet(torch.nn.Module):
    """A whole module saved with another source than this one (``dump_patches``: torch's legacy
    loader then writes a ``.patch`` file into the working directory)."""

    dump_patches = True


def test_an_intact_prezip_file_of_a_whole_module_whose_class_is_gone_raises_torchs_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.save of a whole nn.Module records each module class with its source; the check gave
    those to torch, which compared the source with a Stub's (no ``dump_patches``: an
    AttributeError taken for damage), so an intact file whose class is not importable here was
    "truncated or damaged"; and for a class it allows, torch wrote a ``.patch`` file into the
    working directory. The source says nothing of the bytes: the class is taken as it is."""
    import types

    from fastckpt.load.soundness import sound

    mod = types.ModuleType("fastckpt_test_whole_module")
    mod.Net = type("Net", (torch.nn.Module,), {"__module__": mod.__name__})
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    net, patched = mod.Net(), _PatchedNet()
    net.l = patched.l = torch.nn.Linear(3, 2)
    path, other = tmp_path / "net.pt", tmp_path / "patched.pt"
    with monkeypatch.context() as m:  # the source of each class as it was when saved (none for a class made here)
        m.setattr(torch.serialization, "get_source_lines_and_file", lambda obj: (["class Old: pass\n"], 1, "old.py"))
        torch.save(net, path, _use_new_zipfile_serialization=False)
        torch.save(patched, other, _use_new_zipfile_serialization=False)
    del mod.Net
    with pytest.raises(AttributeError, match="Can't get attribute 'Net'") as err:
        fastckpt.load(str(path), weights_only=False)
    assert not isinstance(err.value, CorruptCheckpointError)
    assert f"{path} has no fastckpt manifest, but it is not damaged" in "".join(err.value.__notes__)
    monkeypatch.chdir(tmp_path)
    data = other.read_bytes()
    with torch.serialization.safe_globals([_PatchedNet]):  # a class the check takes as it is
        assert sound(data, len(data))
    assert not list(tmp_path.glob("*.patch"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a node without CUDA, where a GPU file needs map_location")
def test_an_intact_gpu_file_holding_a_tensor_subclass_raises_torchs_error_not_corruption(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check stubs every class outside torch and the standard library; torch's rebuild of a
    Tensor subclass then called ``as_subclass(Stub)``, a TypeError taken for damage: an intact
    GPU file holding one, loaded on a CPU node, was reported "truncated or damaged"."""
    import types

    mod = types.ModuleType("fastckpt_test_tensor_subclass")
    mod.MyTensor = type("MyTensor", (torch.Tensor,), {"__module__": mod.__name__})
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    path = tmp_path / "gpu_subclass.pt"
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save({"t": torch.ones(3).as_subclass(mod.MyTensor), "step": 3}, path)
    with pytest.raises(RuntimeError, match="map_location") as err:
        fastckpt.load(str(path), weights_only=False)
    assert not isinstance(err.value, CorruptCheckpointError)
    assert f"{path} has no fastckpt manifest, but it is not damaged" in "".join(err.value.__notes__)
    got = fastckpt.load(str(path), weights_only=False, map_location="cpu")["t"]
    assert type(got) is mod.MyTensor and torch.equal(got, torch.ones(3))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a node without CUDA, where a GPU file needs map_location")
def test_a_check_this_process_cannot_finish_is_not_reported_as_damage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of memory while checking says nothing of the bytes: torch's error reaches the caller,
    with a note that the file could not be checked here (never "truncated or damaged")."""
    from fastckpt.load import soundness

    path = tmp_path / "gpu_step100.pt"
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(_plain_state(), path)

    def no_memory(storage, location):  # noqa: ANN001, ANN202 (each storage the check keeps)
        raise MemoryError("cannot allocate 400 bytes")

    monkeypatch.setattr(soundness, "_where_read", no_memory)
    with pytest.raises(RuntimeError, match="map_location") as err:
        fastckpt.load(str(path))
    assert not isinstance(err.value, CorruptCheckpointError)
    note = "".join(err.value.__notes__)
    assert (f"{path} has no fastckpt manifest, and fastckpt could not check here whether it is damaged "
            "(MemoryError while checking it: cannot allocate 400 bytes)") in note
    assert "map_location='cpu'" in note and "weights_only=False" in note


def test_an_intact_file_holding_a_class_renamed_since_raises_torchs_error_not_corruption(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """weights_only=False of a file whose class was renamed since: torch's AttributeError names
    the class; it was reported as a damaged file."""
    import dataclasses
    import types

    mod = types.ModuleType("fastckpt_test_renamed_cfg")
    mod.Config = dataclasses.make_dataclass("Config", [("lr", float, 0.1)])
    mod.Config.__module__ = mod.__name__
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    path = tmp_path / "cfg.pt"
    torch.save({**_plain_state(), "cfg": mod.Config()}, path)
    del mod.Config
    with pytest.raises(AttributeError, match="Can't get attribute 'Config'") as err:
        fastckpt.load(str(path), weights_only=False)
    assert not isinstance(err.value, CorruptCheckpointError)
    assert "it is not damaged" in "".join(err.value.__notes__)
    data = bytearray(path.read_bytes())  # the same name damaged in torch's own namespace is damage
    at = data.index(b"_rebuild_tensor_v2")
    data[at + 1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=f"{path} is truncated or damaged"):
        fastckpt.load(str(path), weights_only=False)


def test_a_resave_during_a_load_from_an_fsspec_url_is_read_again_not_called_corrupt(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """Only S3 pinned a version: at memory:// (and gs://, az://...) the tail of one save was
    combined with the body of the next, a false CorruptCheckpointError. The save now lands (object,
    then sidecar, as the replicator publishes them) right after the load's first ranged read."""
    import fsspec

    from fastckpt.storage.fsspec import FsspecTarget

    fs, root = fsspec.filesystem("memory"), f"/fastckpt-{uuid.uuid4().hex[:8]}"
    url, key, side = f"memory://{root}/last.pt", f"{root}/last.pt", f"{root}/last.pt.fastckpt.json"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        ck.save(_state(1), url).wait()
        b1, s1 = fs.cat_file(key), fs.cat_file(side)
        ck.save(_state(2), url).wait()
        b2, s2 = fs.cat_file(key), fs.cat_file(side)
    fs.pipe_file(key, b1)
    fs.pipe_file(side, s1)
    orig, reads = FsspecTarget.read_range, []

    def read_range(self: FsspecTarget, k: str, offset: int, length: int, **kw: object) -> bytes:
        out = orig(self, k, offset, length, **kw)  # type: ignore[arg-type]
        if k.endswith("last.pt") and not reads:
            reads.append(offset)
            fs.pipe_file(key, b2)
            fs.pipe_file(side, s2)
        return out

    monkeypatch.setattr(FsspecTarget, "read_range", read_range)
    assert fastckpt.load(url)["v"] == 2


def test_an_fsspec_object_replaced_after_its_version_was_read_is_refused() -> None:
    """A non-S3 fsspec store cannot ask for a version in a request: a range is checked against
    the version only when it proves wrong (here cut short by a shorter re-save), and then the error
    says the object was replaced, not that it is damaged."""
    from fastckpt.errors import ReplicationError
    from fastckpt.storage.fsspec import FsspecTarget
    from fastckpt.storage.types import ObjectChangedError

    t = FsspecTarget(f"memory://fastckpt-{uuid.uuid4().hex[:8]}")
    t.put_bytes("a.bin", b"1" * 64)
    size, version = t.version("a.bin")
    assert size == 64 and version is not None
    assert t.read_range("a.bin", 0, 8, version=version) == b"1" * 8
    t.put_bytes("a.bin", b"2" * 32)
    with pytest.raises(ObjectChangedError, match="is no longer version"):
        t.read_range("a.bin", 32, 32, version=version)
    with pytest.raises(ReplicationError, match="the object is shorter") as info:  # the same version: shorter
        t.read_range("a.bin", 32, 32, version=t.version("a.bin")[1])
    assert not isinstance(info.value, ObjectChangedError)


def test_a_healthy_read_from_an_fsspec_url_asks_for_no_version_per_range(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The version check of a non-S3 fsspec store was an extra ``info`` request after every ranged
    read (the tail, then each range): a load paid one request per range. It is now asked only when
    the checksum of what was read differs: a healthy read makes one ``info`` (its size and version),
    and a damaged object, the same version still, is then reported as damage after one more."""
    from fastckpt.format import checksum
    from fastckpt.storage.homes import open_target

    local = tmp_path / "big.pt"
    with fastckpt.Checkpointer() as ck:  # 40 MiB: three ranges of one checksum block, and the tail
        ck.save({"w": torch.ones(10 << 20)}, str(local)).wait()
    t = open_target(f"memory://fastckpt-{uuid.uuid4().hex[:8]}", parallelism=2)
    t.put_file(local, "big.pt")
    infos, ranges, orig_info, orig_read = [], [], t.fs.info, t.read_range

    def info(path: str, **kw: object) -> dict:
        infos.append(path)
        return orig_info(path, **kw)

    def read_range(key: str, offset: int, length: int, **kw: object) -> bytes:
        ranges.append(offset)
        return orig_read(key, offset, length, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(t.fs, "info", info)
    monkeypatch.setattr(t, "read_range", read_range)
    res = t.read_object("big.pt", chunk_bytes=checksum.BLOCK_BYTES)
    assert res.manifest is not None and res.checksum == res.manifest["checksum"]["value"]
    assert len(ranges) == 4 and len(infos) == 1

    data = bytearray(local.read_bytes())
    data[100] ^= 0xFF
    t.fs.pipe_file(t._full("big.pt"), bytes(data))  # damaged at rest, not replaced during the read
    infos.clear()
    res = t.read_object("big.pt", chunk_bytes=checksum.BLOCK_BYTES)
    assert res.manifest is not None and res.checksum != res.manifest["checksum"]["value"]
    assert len(infos) == 2


@pytest.mark.parametrize(("zip_format", "name"), [(True, "fastckpt_test_absent_cfg_zip"),
                                                  (False, "fastckpt_test_absent_cfg_legacy"), (True, "torcx")])
def test_an_intact_file_naming_a_module_not_installed_here_is_refused_not_called_damaged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, zip_format: bool, name: str) -> None:
    """A training repo's config class in a plain torch.save file, loaded in an eval env without
    that repo: the module lookup (``find_spec``) took the missing package for a damaged byte, so
    weights_only=True reported the intact file "truncated or damaged", and weights_only=False raised
    a bare ModuleNotFoundError. Each is now torch's error, noted as not damaged and naming the module.
    A module named one byte from ``torch`` (torcx) is one too where the zip's CRC-32 of the pickle holds."""
    mod = tmp_path / "repo"
    mod.mkdir()
    (mod / f"{name}.py").write_text(
        "import dataclasses\n@dataclasses.dataclass\nclass Cfg:\n    lr: float = 0.1\n")
    path = tmp_path / "plain.pt"
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(mod)!r}); import torch; "
                    f"import {name} as m; "
                    f"torch.save({{'w': torch.ones(3), 'cfg': m.Cfg()}}, {str(path)!r}, "
                    f"_use_new_zipfile_serialization={zip_format})"], check=True)
    with pytest.raises(pickle.UnpicklingError) as refused:
        fastckpt.load(str(path))
    assert not isinstance(refused.value, CorruptCheckpointError)
    note = "".join(refused.value.__notes__)
    assert f"{path} has no fastckpt manifest, but it is not damaged" in note
    assert f"make {name} importable here" in note and "weights_only=False" in note
    with pytest.raises(ModuleNotFoundError, match=name) as missing:
        fastckpt.load(str(path), weights_only=False)
    assert "it is not damaged" in "".join(missing.value.__notes__)
    assert f"make {name} importable here" in "".join(missing.value.__notes__)
    monkeypatch.syspath_prepend(str(mod))
    assert fastckpt.load(str(path), weights_only=False)["cfg"].lr == 0.1
    del sys.modules[name]
    whole = path.read_bytes()
    data = bytearray(whole)  # torch's own module name damaged (torcj) is still damage
    at = data.index(b"torch._utils\n_rebuild_tensor")
    data[at + 4] ^= 0x03
    path.write_bytes(bytes(data))
    for weights_only in (True, False):
        with pytest.raises(CorruptCheckpointError, match=f"{path} is truncated or damaged"):
            fastckpt.load(str(path), weights_only=weights_only)
    if zip_format:  # a damaged byte in the repo's own module's name: the zip's CRC-32 of the pickle says so
        data = bytearray(whole)
        at = data.index(f"{name}\nCfg".encode())
        data[at + len(name) - 1] ^= 0x01
        path.write_bytes(bytes(data))
        for weights_only in (True, False):
            with pytest.raises(CorruptCheckpointError, match=f"{path} is truncated or damaged"):
                fastckpt.load(str(path), weights_only=weights_only)
