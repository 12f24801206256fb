"""Checkpoints written without fastckpt: recognised from their bytes (format/foreign.py), found by
``latest`` beside fastckpt's own and ordered by step (commit/discovery.py), listed as unverified
by ``fastckpt ls``; fastckpt files copied in by another tool are found and verified on load."""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import pickletools
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import fastckpt
from fastckpt.cli.ls import ls
from fastckpt.format import foreign
from tests.helpers import scan


def _torch_save(path: Path, step: int | None, mtime: float | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"state_dict": {"w": torch.full((256,), float(step or 0))}, "epoch": 0}
    if step is not None:
        state["global_step"] = step
    torch.save(state, path)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def _bytes_of(path: Path) -> tuple[bytes, int]:
    data = path.read_bytes()
    return data, len(data)


def _read_step(data: bytes) -> int | None:
    size = len(data)
    end = foreign.zip_end(data[-min(size, 65557):], size)
    if isinstance(end, int):
        end = foreign.zip_end(data[-min(size, 65557):], size, data[end:end + 56])
    assert isinstance(end, foreign.ZipEnd)
    rec = foreign.pickle_record(data[end.cd_offset:end.cd_offset + end.cd_size])
    assert rec is not None
    start = foreign.data_offset(data[rec.header_offset:rec.header_offset + 2000])
    return foreign.step_in_pickle(data[rec.header_offset + start:rec.header_offset + start + rec.size])


def test_a_torch_save_zip_is_recognised_and_its_step_read_without_running_it(tmp_path: Path) -> None:
    data, size = _bytes_of(_torch_save(tmp_path / "a.pt", 42))
    assert _read_step(data) == 42
    assert foreign.zip_end(data[:-1][-65557:], size - 1) is None  # cut short: the record no longer ends the file
    assert foreign.zip_end(b"hello world" * 10, 110) is None

    class Boom:
        def __reduce__(self):  # would run os.system on a real unpickle
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    torch.save({"step": 7, "evil": Boom()}, tmp_path / "evil.pt")
    assert _read_step((tmp_path / "evil.pt").read_bytes()) == 7
    assert not (tmp_path / "pwned").exists()


class _Hparams(dict):
    """A dict subclass of the user's, as Lightning's ``AttributeDict`` hyper-parameters are."""


class _Record:
    def __init__(self) -> None:
        self.lr = 0.1


class _History(list):
    pass


def test_the_step_is_read_past_dict_and_list_subclasses(tmp_path: Path) -> None:
    """Lightning saves ``model.state_dict()`` (an OrderedDict), hyper-parameters in a dict
    subclass, loops' states in defaultdicts: their classes are stubs (nothing is run), which
    still take the items the pickle sets or appends, so the step around them is read."""
    state = {"epoch": 9, "global_step": 1000, "state_dict": torch.nn.Linear(4, 4).state_dict(),
             "hyper_parameters": _Hparams(lr=0.1), "loops": collections.defaultdict(list, {"a": [1]}),
             "history": _History([1, 2]), "record": _Record(), "keyed": {_Record(): 1}}
    assert isinstance(state["state_dict"], collections.OrderedDict)
    torch.save(state, tmp_path / "l.ckpt")
    assert _read_step((tmp_path / "l.ckpt").read_bytes()) == 1000
    torch.save(collections.OrderedDict(state), tmp_path / "top.ckpt")  # an OrderedDict at the top too
    assert _read_step((tmp_path / "top.ckpt").read_bytes()) == 1000


def _zip64(path: Path, monkeypatch: pytest.MonkeyPatch) -> bytes:
    # torch writes zip64 records for files past 4 GiB; make Python's zipfile write them for a small
    # one (zip64 extra fields in the entries, a zip64 end record and locator), then mark the plain
    # end record's fields as overflowed, as a writer does for a big file
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 8)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps({"iteration": 5, "x": 1}, protocol=2))
        z.writestr("archive/version", b"3\n")
        z.writestr("archive/data/0", bytes(2048))  # a record: the scan reads 1 KiB past data.pkl's header
    monkeypatch.undo()
    data = bytearray(path.read_bytes())
    data[-22 + 8:-22 + 20] = struct.pack("<HHII", 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF)
    return bytes(data)


def test_zip64_directories_are_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _zip64(tmp_path / "z.pt", monkeypatch)
    assert isinstance(foreign.zip_end(data[-65557:], len(data)), int)  # asks for the zip64 record
    assert _read_step(data) == 5
    assert zipfile.ZipFile(io.BytesIO(data)).read("archive/data.pkl")  # Python's zipfile reads it too


def test_a_zip64_field_longer_than_its_entry_raises_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A damaged length of a zip64 extra field made the directory's parse read past the field
    (struct.error), and latest() failed with it: the values the field does hold are read."""
    (tmp_path / "run").mkdir()
    data = bytearray(_zip64(tmp_path / "run" / "z.pt", monkeypatch))
    entry = data.index(foreign.CD_SIG)
    (name_len,) = struct.unpack_from("<H", data, entry + 28)
    struct.pack_into("<H", data, entry + 46 + name_len + 2, 248)  # the zip64 field says 248 bytes, holds 16
    (tmp_path / "run" / "z.pt").write_bytes(bytes(data))
    assert _read_step(bytes(data)) == 5
    assert fastckpt.latest(str(tmp_path / "run")) == str(tmp_path / "run" / "z.pt")


def test_a_damaged_pickle_costs_its_step_and_raises_nothing() -> None:
    """A damaged length field made the unpickler raise OverflowError (and latest() with it): the
    step is only an ordering hint, so a pickle that does not parse records none."""
    good = pickle.dumps({"global_step": 5}, protocol=4)
    assert foreign.step_in_pickle(good) == 5
    frame = b"\x80\x04\x95" + struct.pack("<Q", 1 << 63) + good[11:]  # FRAME: 2**63 bytes follow
    unicode8 = b"\x80\x04\x8d" + struct.pack("<Q", 1 << 63) + b"step"  # BINUNICODE8 of 2**63 bytes
    assert foreign.step_in_pickle(frame) is None and foreign.step_in_pickle(unicode8) is None


_LATEST_UNDER_A_LIMIT = """
import resource, sys
import fastckpt
vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) << 10
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))  # 1 GiB more than it holds now
print(fastckpt.latest(sys.argv[1]))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads its address space from /proc")
def test_a_damaged_memo_index_does_not_make_latest_allocate_by_it(tmp_path: Path) -> None:
    """torch.save numbers its pickle's memo with 4-byte LONG_BINPUTs past 255 entries, and the C
    unpickler grows and zeroes its memo array to the index it reads: one flipped high byte asked
    for up to 32 GiB (an OOM kill) while latest() read the file's step. Run under an address-space
    limit, so that the old behaviour fails here as a MemoryError instead."""
    run = tmp_path / "run"
    run.mkdir()
    path = run / "epoch=3-step=300.ckpt"
    torch.save({"state_dict": {f"layer{i}.weight": torch.zeros(2) for i in range(150)}, "global_step": 300}, path)
    clean = path.read_bytes()
    with zipfile.ZipFile(path) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    at = clean.index(pkl) + next(pos for op, _, pos in pickletools.genops(pkl) if op.name == "LONG_BINPUT")
    for byte, mask in ((4, 0x10), (4, 0x80), (3, 0x08)):  # memo indices past 2**28, 2**31 and 2**19
        data = bytearray(clean)
        data[at + byte] ^= mask
        path.write_bytes(bytes(data))
        got = subprocess.run([sys.executable, "-c", _LATEST_UNDER_A_LIMIT, str(run)], capture_output=True, text=True,
                             timeout=120, check=False)
        assert got.returncode == 0, got.stderr[-2000:]
        assert got.stdout.strip() == str(path)
        assert [f.step for f in scan(run)] == [None]  # its step is lost, not the scan: ordered by time


def test_latest_finds_old_checkpoints_and_fastckpt_takes_over_by_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _torch_save(run / "step-100.pt", 100, mtime=1_000_000)
    _torch_save(run / "step-300.pt", 300, mtime=1_000_100)
    _torch_save(run / "step-200.pt", 200, mtime=1_000_200)  # copied in last, but an older step
    (run / "partial.pt").write_bytes((run / "step-100.pt").read_bytes()[:-100])  # a writer killed mid-file
    assert fastckpt.latest(str(run)) == str(run / "step-300.pt")
    found = scan(run)
    assert [(Path(f.path).name, f.foreign, f.step) for f in found] == [
        ("step-100.pt", "torch.save", 100), ("step-200.pt", "torch.save", 200), ("step-300.pt", "torch.save", 300)]
    state = fastckpt.load(fastckpt.latest(str(run)))  # loads, unverified
    assert state["global_step"] == 300
    with fastckpt.Checkpointer() as ck:  # the run switched to fastckpt and saves its next step
        ck.save({"w": torch.zeros(256), "global_step": 400}, str(run / "step-400.pt"))
    assert fastckpt.latest(str(run)) == str(run / "step-400.pt")
    assert [f.foreign for f in scan(run)][-1] is None


def test_without_a_step_everywhere_the_order_is_by_time(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _torch_save(run / "old.pt", 500, mtime=1_000_000)
    with fastckpt.Checkpointer() as ck:  # records no step: written now, so newer
        ck.save({"w": torch.zeros(8)}, str(run / "new.pt"))
    assert fastckpt.latest(str(run)) == str(run / "new.pt")


def test_ls_marks_foreign_checkpoints_unverified(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _torch_save(run / "epoch=0-step=20.ckpt", 20)
    with fastckpt.Checkpointer() as ck:
        ck.save({"w": torch.zeros(8), "global_step": 40}, str(run / "step-40.pt"))
    out = CliRunner().invoke(ls, [str(run), "--json"])
    assert out.exit_code == 0, out.output
    rows = {Path(c["path"]).name: c for c in json.loads(out.output)["checkpoints"]}
    row = rows["epoch=0-step=20.ckpt"]
    assert row["status"] == "unverified" and row["kind"] == "torch.save"
    assert rows["epoch=0-step=20.ckpt"]["step"] == 20 and rows["step-40.pt"]["step"] == 40
    assert rows["step-40.pt"]["status"] == "complete" and rows["step-40.pt"]["latest"]


def test_a_fastckpt_file_copied_in_by_another_tool_is_found_and_verified(tmp_path: Path) -> None:
    with fastckpt.Checkpointer() as ck:
        ck.save({"w": torch.arange(1000), "step": 9}, str(tmp_path / "elsewhere" / "step-9.pt"))
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy2(tmp_path / "elsewhere" / "step-9.pt", run / "step-9.pt")  # rsync -a, cp -p
    assert fastckpt.latest(str(run)) == str(run / "step-9.pt")
    assert [f.foreign for f in scan(run)] == [None]  # its manifest came with it: fastckpt's own
    assert torch.equal(fastckpt.load(str(run / "step-9.pt"))["w"], torch.arange(1000))
    data = bytearray((run / "step-9.pt").read_bytes())
    data[4096] ^= 0xFF
    (run / "step-9.pt").write_bytes(bytes(data))
    with pytest.raises(fastckpt.CorruptCheckpointError):
        fastckpt.load(str(run / "step-9.pt"))


def test_load_of_a_dcp_directory_latest_named_says_what_loads_it(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """latest() names a plain dcp.save directory (it counts DCP directories for Lightning's FSDP
    checkpoints), which fastckpt.load() does not read. Its refusal said "load a file inside it, or
    fastckpt.latest(<the directory>)", which named the same directory again: advice in a circle.
    It now names the checkpoint as DCP's and what loads it; so does latest()'s warning. (At a URL:
    tests/integration/test_groups_s3.py.)"""
    import warnings

    import torch.distributed.checkpoint as dcp

    run = tmp_path / "run3"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: dcp.save warns and saves as one rank
        dcp.save({"model": {"w": torch.ones(4)}, "step": 100}, checkpoint_id=str(run / "step-100"))
    with caplog.at_level("WARNING", logger="fastckpt"):
        named = fastckpt.latest(str(run))
    assert named == str(run / "step-100")
    assert "is a torch.distributed.checkpoint directory" in caplog.text and "loads unverified" not in caplog.text
    with pytest.raises(fastckpt.ConfigError) as refused:
        fastckpt.load(named)
    said = str(refused.value)
    assert said.startswith(f"{named} is a checkpoint written by torch.distributed.checkpoint (a directory holding "
                           ".metadata), not a torch.save file")
    assert f"torch.distributed.checkpoint.load(state, checkpoint_id={named!r})" in said
    assert f"dcp_to_torch_save({named!r}" in said and "fastckpt.latest(" not in said


def test_a_torch_distributed_checkpoint_directory_is_one_checkpoint(tmp_path: Path) -> None:
    """Lightning's FSDPStrategy(state_dict_type="sharded") saves each checkpoint as a DCP directory
    (``.metadata``, ``__0_0.distcp``) plus its own ``meta.pt``. latest() named that meta.pt, a
    piece of a checkpoint: fit(ckpt_path=...) with it failed with KeyError 'state_dict'."""
    import warnings

    import torch.distributed.checkpoint as dcp

    for step in (6, 8):
        d = tmp_path / f"epoch=0-step={step}.ckpt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no process group: dcp.save warns and saves as one rank
            dcp.save({"model": {"w": torch.full((4, 4), float(step))}}, checkpoint_id=str(d))
        torch.save({"epoch": 0, "global_step": step}, d / "meta.pt")
    assert fastckpt.latest(str(tmp_path)) == str(tmp_path / "epoch=0-step=8.ckpt")
    got = [(f.path, f.foreign, f.step) for f in scan(str(tmp_path))]
    assert got == [(str(tmp_path / f"epoch=0-step={s}.ckpt"), "torch.distributed.checkpoint", s) for s in (6, 8)]
    # Lightning writes meta.pt after dcp.save: a kill in between (none), or during it (cut short)
    for step, cut in ((9, None), (10, 100)):
        d = tmp_path / f"epoch=0-step={step}.ckpt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"model": {"w": torch.zeros(4, 4)}}, checkpoint_id=str(d))
        if cut is not None:
            torch.save({"epoch": 0, "global_step": step}, d / "meta.pt")
            os.truncate(d / "meta.pt", cut)
    assert fastckpt.latest(str(tmp_path)) == str(tmp_path / "epoch=0-step=8.ckpt")
    # a copy that does not keep file times (rsync without -t, an upload) is as whole; and latest of
    # the directory itself names it, not its meta.pt or a shard
    newest = tmp_path / "epoch=0-step=8.ckpt"
    done = os.stat(newest / ".metadata").st_mtime
    shard = next(p for p in newest.iterdir() if p.suffix == ".distcp")
    os.utime(shard, (done + 5, done + 5))
    assert fastckpt.latest(str(tmp_path)) == str(newest)
    assert fastckpt.latest(str(newest)) == str(newest)


def test_a_torchscript_export_beside_the_checkpoints_is_not_one(tmp_path: Path) -> None:
    """A TorchScript archive (``torch.jit.save``) is a zip with a ``data.pkl`` too, beside
    ``constants.pkl`` and ``code/``: written after the checkpoints, latest() named it, and a resume
    from it failed as "damaged". torch.load tells the two apart the same way."""
    run = tmp_path / "run"
    _torch_save(run / "step-1.pt", 1, mtime=1_000_000)
    with fastckpt.Checkpointer() as ck:
        ck.save({"w": torch.zeros(8), "step": 2}, str(run / "step-2.pt")).wait()
    export = run / "model_scripted.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(4, 4)), str(export))
    later = os.stat(run / "step-2.pt").st_mtime + 60
    os.utime(export, (later, later))
    assert fastckpt.latest(str(run)) == str(run / "step-2.pt")
    assert [Path(f.path).name for f in scan(run)] == ["step-1.pt", "step-2.pt"]
    data = export.read_bytes()
    end = foreign.zip_end(data[-65557:], len(data))
    assert isinstance(end, foreign.ZipEnd)
    assert foreign.pickle_record(data[end.cd_offset:end.cd_offset + end.cd_size]) is None


def test_pickle_plain_reads_the_plain_values_not_the_tensors(tmp_path) -> None:
    """What a Lightning last.ckpt names (its ModelCheckpoint state), read without its tensor data."""
    from fastckpt.commit.foreign import pickle_plain
    from fastckpt.storage.homes import Homes

    path = str(tmp_path / "last.ckpt")
    big = torch.zeros(1 << 20)
    torch.save({"state_dict": {"w": big}, "callbacks": {"ModelCheckpoint{'monitor': 'step'}": {
        "best_model_path": "/run/step=4.ckpt", "best_k_models": {"/run/step=4.ckpt": torch.tensor(4.0)}}}}, path)
    homes = Homes()
    try:
        loc = homes.resolve(path)
        plain = pickle_plain(loc.target, loc.key)
    finally:
        homes.close()
    state = plain["callbacks"]["ModelCheckpoint{'monitor': 'step'}"]
    assert state["best_model_path"] == "/run/step=4.ckpt" and list(state["best_k_models"]) == ["/run/step=4.ckpt"]
    assert plain["state_dict"]["w"] is not big and not isinstance(plain["state_dict"]["w"], torch.Tensor)


@pytest.mark.parametrize("size", ["past-the-end", "into-the-directory"])
def test_a_zip_directory_giving_the_pickle_a_size_past_its_bytes_costs_the_file_its_step(tmp_path: Path,
                                                                                          size: str) -> None:
    """Bit rot in a torch.save file's central directory (data.pkl's size running past the member's
    bytes) made the pickle read raise EIO ("ended at byte N"), so ``latest(DIR)`` raised for the
    whole folder, one damaged foreign file beside good checkpoints stopping a resume. The file is
    read as no pickle now: its step is unknown, nothing raises."""
    from fastckpt.commit.foreign import pickle_plain, pickle_step
    from fastckpt.storage.homes import Homes

    torch.save({"global_step": 1, "w": torch.randn(100)}, tmp_path / "good.pt")
    bad = tmp_path / "bad.pt"
    torch.save({"global_step": 2, "w": torch.randn(100)}, bad)
    data = bytearray(bad.read_bytes())
    at = data.find(b"PK\x01\x02")
    while not data[at + 46:at + 46 + struct.unpack_from("<H", data, at + 28)[0]].endswith(b"data.pkl"):
        at = data.find(b"PK\x01\x02", at + 4)
    cd = data.find(b"PK\x01\x02")
    struct.pack_into("<I", data, at + 20, len(data) if size == "past-the-end" else cd)
    bad.write_bytes(bytes(data))
    homes = Homes(None)
    try:
        loc = homes.resolve(str(bad))
        assert pickle_plain(loc.target, loc.key) is None and pickle_step(loc.target, loc.key) is None
    finally:
        homes.close()
    assert fastckpt.latest(str(tmp_path)) in (str(bad), str(tmp_path / "good.pt"))
