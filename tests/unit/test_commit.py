"""commit/: rank markers, group manifests, the latest pointer, discovery, removal.

Groups are built in one process with one Checkpointer per simulated rank (``rank=``,
``world_size=``) or with the marker functions directly; the multi-process protocol over
torch.distributed is covered by ``tests/integration/test_groups.py``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import fastckpt
from fastckpt.commit import fallback as W
from fastckpt.commit import protocol as P
from fastckpt.commit.deletion import delete_checkpoint
from fastckpt.commit.order import AHEAD_S
from fastckpt.errors import CommitTimeoutError, ConfigError, CorruptCheckpointError, IncompleteCheckpointError
from fastckpt.io import atomic as A
from fastckpt.io.ops import FileOps
from fastckpt.storage.homes import Homes
from fastckpt.testing import Fault, FaultyOps
from tests.helpers import flip_byte, latest, place, read_file_manifest, scan


def _missing(g: str, world: int) -> list[int]:
    got = P.read_markers(place(g))
    return [r for r in range(world) if r not in got or got[r]["world_size"] != world]


def _state(v: int) -> dict:
    return {"w": torch.arange(256, dtype=torch.int64) + v, "v": v}


def _ranks(n: int, **kw: object) -> list[fastckpt.Checkpointer]:
    return [fastckpt.Checkpointer(rank=r, world_size=n, **kw) for r in range(n)]


def _close(cks: list[fastckpt.Checkpointer]) -> None:
    for ck in cks:
        ck.close()


def _save_file(path: Path, v: int) -> str:
    """A single-file checkpoint, durable on return."""
    with fastckpt.Checkpointer(rank=0, world_size=1) as ck:
        ck.save(_state(v), str(path)).wait()
    return str(path)


def _save_group(group: Path, world: int = 2, step: int = 0, commit_ranks: tuple[int, ...] | None = None) -> str:
    """Every rank saves one file into ``group``; ``commit_ranks`` (default all) commit it.

    With some ranks left out, the others' commits are not waited on (rank 0's would time out):
    only their markers are written, as ``commit`` does first.
    """
    cks = _ranks(world)
    try:
        for r, ck in enumerate(cks):
            ck.save(_state(10 * step + r), str(group / f"shard{r}.pt"), group=str(group)).wait()
        if commit_ranks is None:
            for h in [ck.commit(str(group), step=step) for ck in cks]:
                h.wait()
        else:
            for r in commit_ranks:
                files = {f"shard{r}.pt": {"size": (group / f"shard{r}.pt").stat().st_size, "checksum": "x"}}
                P.write_marker(place(str(group)), r, world, files)
    finally:
        _close(cks)
    return str(group)


# --------------------------------------------------------------------------- markers
def test_markers_round_trip_and_missing_ranks(tmp_path: Path) -> None:
    g = str(tmp_path / "g")
    assert P.read_markers(place(g)) == {}  # no directory yet
    assert _missing(g, 3) == [0, 1, 2]
    files = {"a.pt": {"size": 5, "checksum": "abc"}}
    P.write_marker(place(g), 2, 3, files)
    P.write_marker(place(g), 0, 3, {})
    assert os.path.join(g, P.marker_rel(2)) == os.path.join(g, ".fastckpt", "rank-00002.json")
    got = P.read_markers(place(g))
    assert sorted(got) == [0, 2]
    assert got[2]["files"] == files and got[2]["world_size"] == 3 and got[2]["rank"] == 2
    assert _missing(g, 3) == [1]
    # a marker from an attempt at another world size does not count
    P.write_marker(place(g), 1, 4, {})
    assert _missing(g, 3) == [1]
    P.write_marker(place(g), 1, 3, {})
    assert _missing(g, 3) == []


def test_read_markers_skips_temp_and_foreign_files(tmp_path: Path) -> None:
    g = tmp_path / "g"
    P.write_marker(place(str(g)), 0, 2, {})
    mdir = g / ".fastckpt"
    (mdir / Path(A.tmp_name(str(mdir / "rank-00001.json"))).name).write_text("{partial")
    (mdir / "notes.txt").write_text("x")
    assert sorted(P.read_markers(place(str(g)))) == [0]


def test_wait_for_markers_returns_when_every_rank_is_there(tmp_path: Path) -> None:
    g = str(tmp_path / "g")
    P.write_marker(place(g), 0, 2, {})
    writer = threading.Thread(target=P.write_marker, args=(place(g), 1, 2, {"f": {"size": 1, "checksum": ""}}))
    writer.start()
    got = W.wait_for_markers(place(g), 2, 30, threading.Event())
    writer.join()
    assert sorted(got) == [0, 1]
    assert got[1]["files"] == {"f": {"size": 1, "checksum": ""}}


def test_wait_for_markers_times_out_naming_missing_ranks(tmp_path: Path) -> None:
    g = str(tmp_path / "g")
    P.write_marker(place(g), 1, 4, {})
    with pytest.raises(CommitTimeoutError, match=r"ranks \[0, 2, 3\] of 4") as ei:
        W.wait_for_markers(place(g), 4, 0.05, threading.Event())
    assert isinstance(ei.value, TimeoutError)
    assert g in str(ei.value)


def test_wait_for_markers_and_manifest_stop_early(tmp_path: Path) -> None:
    stop = threading.Event()
    stop.set()
    with pytest.raises(CommitTimeoutError):
        W.wait_for_markers(place(str(tmp_path)), 2, 3600, stop)
    with pytest.raises(CommitTimeoutError, match="did not publish"):
        W.wait_for_manifest(place(str(tmp_path)), 3600, stop)


def test_wait_for_manifest(tmp_path: Path) -> None:
    g = tmp_path / "g"
    g.mkdir()
    with pytest.raises(CommitTimeoutError, match="rank 0 did not publish"):
        W.wait_for_manifest(place(str(g)), 0.05, threading.Event())
    m = P.with_digest({"kind": "group", "files": {}, "tag": "g"})
    A.publish_bytes(FileOps(), str(g / P.GROUP_MANIFEST), json.dumps(m).encode())
    with pytest.raises(CommitTimeoutError, match="rank 0 did not publish"):  # no latest yet: it may be taken back
        W.wait_for_manifest(place(str(g)), 0.05, threading.Event())
    A.publish_bytes(FileOps(), str(tmp_path / P.LATEST), b"g")
    assert W.wait_for_manifest(place(str(g)), 1, threading.Event()) == m


# --------------------------------------------------------------------------- publish_group
def _fake_group(tmp_path: Path, sizes: dict[int, int]) -> tuple[str, dict[int, dict]]:
    g = tmp_path / "run" / "global_step7"
    g.mkdir(parents=True)
    for r, n in sizes.items():
        (g / f"r{r}.bin").write_bytes(b"x" * n)
        P.write_marker(place(str(g)), r, len(sizes), {f"r{r}.bin": {"size": n, "checksum": f"c{r}"}})
    return str(g), P.read_markers(place(str(g)))


def test_publish_group_writes_manifest_then_latest(tmp_path: Path) -> None:
    g, markers = _fake_group(tmp_path, {0: 3, 1: 5})
    order: list[str] = []
    ops = FaultyOps(on_call=lambda op, path: order.append(os.path.basename(A.final_path(path)))
                    if op == "replace" else None)
    m = P.publish_group(place(g, ops), 2, markers, {"step": 7})
    assert m["kind"] == "group" and m["world_size"] == 2 and m["step"] == 7
    assert m["files"] == {"r0.bin": {"size": 3, "checksum": "c0", "rank": 0},
                          "r1.bin": {"size": 5, "checksum": "c1", "rank": 1}}
    assert P.read_group_manifest(place(g)) == m
    assert (tmp_path / "run" / P.LATEST).read_text() == "global_step7"
    assert order == [P.GROUP_MANIFEST, "latest"]
    assert latest(str(tmp_path / "run")) == g


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_publish_group_refuses_a_file_that_does_not_match_its_marker(tmp_path: Path, damage: str) -> None:
    g, markers = _fake_group(tmp_path, {0: 3, 1: 5})
    A.publish_bytes(FileOps(), str(tmp_path / "run" / P.LATEST), b"global_step6")
    victim = Path(g) / "r1.bin"
    if damage == "missing":
        victim.unlink()
    else:
        victim.write_bytes(b"x")
    with pytest.raises(IncompleteCheckpointError, match=r"rank 1 committed r1.bin with 5 bytes"):
        P.publish_group(place(g, FileOps()), 2, markers, {})
    assert P.read_group_manifest(place(g)) is None
    assert (tmp_path / "run" / P.LATEST).read_text() == "global_step6"
    assert latest(str(tmp_path / "run")) is None


def test_read_group_manifest(tmp_path: Path) -> None:
    assert P.read_group_manifest(place(str(tmp_path))) is None
    (tmp_path / P.GROUP_MANIFEST).write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match=P.GROUP_MANIFEST):
        P.read_group_manifest(place(str(tmp_path)))


@pytest.mark.parametrize("shape", ["a list", "files a list", "an entry a string", "requested_at a string",
                                   "an entry without size"])
def test_a_group_manifest_of_the_wrong_shape_is_damage_to_every_reader(
        tmp_path: Path, shape: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Valid JSON of another shape (a damaged or foreign file) is corruption: never an
    AttributeError from load, latest or the CLI (helper review D1)."""
    from fastckpt.cli import main as cli

    for step in (1, 2):
        g = tmp_path / f"step-{step}"
        with fastckpt.Checkpointer(rank=0, world_size=1) as ck:
            ck.save(_state(step), str(g / "m.pt"), group=str(g))
            ck.commit(str(g), step=step).wait()
    m = json.loads((g / P.GROUP_MANIFEST).read_text())
    damaged = {"a list": [m], "files a list": {**m, "files": list(m["files"])},
               "an entry a string": {**m, "files": {"m.pt": "ok"}},
               "requested_at a string": {**m, "requested_at": "yesterday"},
               "an entry without size": {**m, "files": {"m.pt": {"checksum": m["files"]["m.pt"]["checksum"]}}}}[shape]
    if isinstance(damaged, dict):  # an older manifest: no digest to catch it
        damaged.pop("digest", None)
        damaged["format"] = 1
    (g / P.GROUP_MANIFEST).write_text(json.dumps(damaged))
    (tmp_path / P.LATEST).unlink()  # the scan decides: it skips the damaged group
    with pytest.raises(CorruptCheckpointError, match=rf"{P.GROUP_MANIFEST} is damaged"):
        fastckpt.load(str(g / "m.pt"))
    assert fastckpt.latest(str(tmp_path)) == str(tmp_path / "step-1")
    assert cli(["verify", str(g)]) != 0 and cli(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and "is damaged" in out.out + out.err


def test_a_group_manifest_damaged_where_it_still_parses_is_corruption(tmp_path: Path) -> None:
    """One digit of a file's checksum in the group's manifest: it parses and has the right shape,
    and the load said the file was "left by another attempt". Its digest tells the damage."""
    g = tmp_path / "step-1"
    with fastckpt.Checkpointer(rank=0, world_size=1) as ck:
        ck.save(_state(1), str(g / "m.pt"), group=str(g))
        ck.commit(str(g), step=1, note={2: "int keys come back as strings"}).wait()
    m = json.loads((g / P.GROUP_MANIFEST).read_text())
    assert P.read_group_manifest(place(str(g))) == m and m["digest"]  # what was written reads back whole
    digit = m["files"]["m.pt"]["checksum"][0]
    m["files"]["m.pt"]["checksum"] = ("1" if digit == "0" else "0") + m["files"]["m.pt"]["checksum"][1:]
    (g / P.GROUP_MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CorruptCheckpointError, match="does not match its digest"):
        fastckpt.load(str(g / "m.pt"))
    del m["digest"]  # one byte of its key damaged ("digesu"): the check was off
    (g / P.GROUP_MANIFEST).write_text(json.dumps({**m, "digesu": "0" * 16}))
    with pytest.raises(CorruptCheckpointError, match="digest is missing, which every manifest of format 2 has"):
        fastckpt.load(str(g / "m.pt"))
    (g / P.GROUP_MANIFEST).write_text(json.dumps({**m, "format": 3}))  # a digit of its format damaged
    with pytest.raises(CorruptCheckpointError, match="its format is 3, not 1 or 2"):
        fastckpt.load(str(g / "m.pt"))
    m["format"] = 1  # a manifest written before digests: read as it is
    (g / P.GROUP_MANIFEST).write_text(json.dumps(m))
    with pytest.raises(IncompleteCheckpointError, match="names another version"):
        fastckpt.load(str(g / "m.pt"))


def test_read_file_manifest(tmp_path: Path) -> None:
    plain = tmp_path / "plain.pt"
    torch.save(_state(1), plain)
    assert read_file_manifest(str(plain)) is None
    m = read_file_manifest(_save_file(tmp_path / "fast.pt", 1))
    assert m["kind"] == "file" and m["group"] is None and m["rank"] == 0


def test_incomplete_group_error_names_missing_ranks(tmp_path: Path) -> None:
    g = tmp_path / "g"
    g.mkdir()
    err = P.incomplete_group_error(place(str(g)), None)
    assert "no published manifest (its commit never finished, or it is being removed)" in str(err)
    P.write_marker(place(str(g)), 1, 3, {})
    err = P.incomplete_group_error(place(str(g)), None)
    assert isinstance(err, FileNotFoundError)
    assert "ranks [0, 2] of 3 never committed" in str(err)
    assert "fastckpt.latest" in str(err)


# --------------------------------------------------------------------------- scan / latest
def test_latest_of_nothing(tmp_path: Path) -> None:
    assert latest(str(tmp_path / "absent")) is None
    assert latest(str(tmp_path)) is None
    (tmp_path / "file.txt").write_text("hello")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "file.txt").read_bytes() * 10)
    assert scan(str(tmp_path)) == []
    torch.save(_state(0), tmp_path / "plain.pt")  # plain torch.save: a foreign checkpoint (tests/unit/test_foreign.py)
    assert [(f.foreign, os.path.basename(f.path)) for f in scan(str(tmp_path))] == [("torch.save", "plain.pt")]


def test_scan_orders_files_and_groups_and_skips_incomplete(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    f1 = _save_file(root / "step1.pt", 1)
    g2 = _save_group(root / "global_step2", step=2)
    f3 = _save_file(root / "sub" / "deeper" / "step3.pt", 3)  # nested subfolders
    g4 = _save_group(root / "sub" / "global_step4", world=3, step=4)
    _save_group(root / "global_step5", step=5, commit_ranks=(0,))  # newest, but rank 1 never committed
    _save_group(root / "global_step6", step=6, commit_ranks=())  # files only, no marker at all
    _save_file(root / ".hidden" / "step7.pt", 7)  # hidden folders are not searched
    (root / A.tmp_name(str(root / "step8.pt"))).write_bytes((root / "step1.pt").read_bytes())
    found = scan(str(root))
    assert [(f.path, f.kind) for f in found] == [(f1, "file"), (g2, "group"), (f3, "file"), (g4, "group")]
    assert [f.time for f in found] == sorted(f.time for f in found)
    assert found[1].manifest["step"] == 2 and found[3].manifest["world_size"] == 3
    assert latest(str(root / "sub")) == g4
    assert latest(str(root / "sub" / "deeper")) == f3
    # the pointer names the newest group published under its parent, as a bare tag name
    assert (root / P.LATEST).read_text() == "global_step2"
    assert (root / "sub" / P.LATEST).read_text() == "global_step4"
    # the pointer answers for its own directory (one rule for directories and URLs: the
    # pointer first); without it, the scan decides, subfolders included
    assert latest(str(root)) == g2
    (root / P.LATEST).unlink()
    assert latest(str(root)) == g4
    assert fastckpt.latest(str(root)) == g4


def test_scan_depth_limit(tmp_path: Path) -> None:
    deep = _save_file(tmp_path / "1" / "2" / "3" / "4" / "x.pt", 1)
    too_deep = tmp_path / "1" / "2" / "3" / "4" / "5" / "y.pt"
    _save_file(too_deep, 2)
    assert [f.path for f in scan(str(tmp_path))] == [deep]
    assert [f.path for f in scan(str(tmp_path), max_depth=5)] == [deep, str(too_deep)]


def test_files_of_an_incomplete_group_do_not_load(tmp_path: Path) -> None:
    g = Path(_save_group(tmp_path / "global_step5", world=3, step=5, commit_ranks=(0, 2)))
    for r in range(3):
        with pytest.raises(IncompleteCheckpointError, match=r"ranks \[1\] of 3 never committed"):
            fastckpt.load(str(g / f"shard{r}.pt"))
    # a plain torch.load is not stopped: the file itself is whole
    assert torch.equal(torch.load(g / "shard0.pt", weights_only=True)["w"], _state(50)["w"])


def test_files_of_a_complete_group_load(tmp_path: Path) -> None:
    g = Path(_save_group(tmp_path / "global_step3", step=3))
    for r in range(2):
        got = fastckpt.load(str(g / f"shard{r}.pt"))
        assert torch.equal(got["w"], _state(30 + r)["w"])


def test_a_group_file_copied_out_of_its_group_loads_on_its_own_verified(tmp_path: Path) -> None:
    """DeepSpeed's ds_to_universal copies mp_rank_* files into TAG_universal/: a file copied to a
    place that is not its group is a file of its own, which its checksum verifies."""
    g = Path(_save_group(tmp_path / "global_step3", step=3))
    copies = [tmp_path / "global_step3_universal" / "shard0.pt", tmp_path / "elsewhere" / "renamed.pt"]
    for c in copies:
        c.parent.mkdir()
        shutil.copy2(g / "shard0.pt", c)
        assert torch.equal(fastckpt.load(str(c))["w"], _state(30)["w"])
    off = torch._C.PyTorchFileReader(str(copies[0])).get_record_offset(_record(copies[0], "data/0"))
    flip_byte(copies[0], off + 8, mask=0x5A)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        fastckpt.load(str(copies[0]))


def test_a_group_file_where_its_group_lies_loads_only_once_that_group_is_published(tmp_path: Path) -> None:
    """The crash-safety side: in a directory named as its group (at the group's place, a
    directory of that name elsewhere, its re-save directory, a folder inside it), a file waits
    for that directory's published manifest."""
    g = Path(_save_group(tmp_path / "global_step5", world=3, step=5, commit_ranks=(0, 2)))
    places = [tmp_path / "copy" / "global_step5" / "shard0.pt",
              tmp_path / ".global_step5.fastckpt-next-0123456789ab" / "shard0.pt",
              tmp_path / ".global_step5.fastckpt-next" / "shard0.pt",
              g / "sub" / "shard0.pt"]
    for p in places:
        p.parent.mkdir(parents=True)
        shutil.copy2(g / "shard0.pt", p)
    for p in [g / "shard0.pt", *places]:
        with pytest.raises(IncompleteCheckpointError, match="is incomplete"):
            fastckpt.load(str(p))


def _record(path: Path, suffix: str) -> str:
    """The full name of the zip record ending in ``suffix`` (torch prefixes the archive's name)."""
    return next(n for n in torch._C.PyTorchFileReader(str(path)).get_all_records() if n.endswith(suffix))


def test_latest_pointer_follows_commit_order_when_publishes_overlap(tmp_path: Path) -> None:
    """Rank 0 commits step 1 then step 2; step 2 completes first (rank 1 was late for step 1).

    The step-1 manifest publish is held at a gate until step 2 is fully published, so the
    older group is published last: ``latest`` must still name step 2.
    """
    parent = tmp_path / "run"
    g1, g2 = parent / "global_step1", parent / "global_step2"
    ops = FaultyOps()
    gate = ops.gate("write_small", path_contains=f"global_step1{os.sep}{P.GROUP_MANIFEST}")
    ck = fastckpt.Checkpointer(rank=0, world_size=2, commit_timeout_s=60, ops=ops)
    try:
        handles = []
        for g in (g1, g2):
            ck.save(_state(1), str(g / "shard0.pt"), group=str(g)).wait()
            handles.append(ck.commit(str(g)))
        P.write_marker(place(str(g1)), 1, 2, {}, W.current_attempt(place(str(g1))))  # rank 1 echoes rank 0's attempt
        assert gate.wait_entered()
        P.write_marker(place(str(g2)), 1, 2, {}, W.current_attempt(place(str(g2))))
        handles[1].wait(timeout=60)
        assert (parent / P.LATEST).read_text() == "global_step2"
        gate.open()
        handles[0].wait(timeout=60)
    finally:
        gate.open()
        ck.close()
    assert P.read_group_manifest(place(str(g1))) is not None
    assert (parent / P.LATEST).read_text() == "global_step2"
    assert latest(str(parent)) == str(g2)


def test_latest_pointer_to_a_removed_or_damaged_group_is_replaced(tmp_path: Path) -> None:
    g, markers = _fake_group(tmp_path, {0: 3})
    pointer = tmp_path / "run" / P.LATEST
    for stale in (b"global_step99", b"", b"../elsewhere"):  # removed by retention, empty, foreign
        A.publish_bytes(FileOps(), str(pointer), stale)
        P.publish_group(place(g, FileOps()), 1, markers, {}, requested_at=float("-1e9"))
        assert pointer.read_text() == "global_step7"


@pytest.mark.parametrize("ahead_s", [3600.0, 30.0])
def test_a_pointer_dated_ahead_of_the_clock_by_a_skewed_node_is_replaced(tmp_path: Path, ahead_s: float) -> None:
    """The pointer only moves forward, by rank 0's clock at commit(). A group a node whose clock
    ran an hour ahead committed held it for that hour against every later run (a crash then
    resumed from it); a checkpoint dated more than a minute after this host's clock now is such
    a one, and is replaced. Within that minute it is taken as newer, as before."""
    parent = tmp_path / "run"
    g100, g200 = parent / "global_step100", parent / "global_step200"
    with fastckpt.Checkpointer(overhead_budget=0.99) as ck:
        ck.save(_state(1), str(g100 / "rank0.pt"), group=str(g100))
        ck.commit(str(g100), step=100).wait(60)
    m = json.loads((g100 / P.GROUP_MANIFEST).read_text())
    m["requested_at"] += ahead_s  # as the skewed node dated it
    A.publish_bytes(FileOps(), str(g100 / P.GROUP_MANIFEST), P.manifest_bytes(m))
    with fastckpt.Checkpointer(overhead_budget=0.99) as ck:  # the next run, on a node with the right time
        ck.save(_state(2), str(g200 / "rank0.pt"), group=str(g200))
        ck.commit(str(g200), step=200).wait(60)
    assert (parent / P.LATEST).read_text() == ("global_step200" if ahead_s > AHEAD_S else "global_step100")


def test_group_order_prefers_the_commit_request_time() -> None:
    assert P.group_order({"committed_at": 5.0}) == 5.0
    assert P.group_order({"committed_at": 5.0, "requested_at": 2.0}) == 2.0
    assert P.group_order({}) == 0.0


def test_files_of_one_group_do_not_wait_for_each_other(tmp_path: Path) -> None:
    """A rank's shards of one checkpoint each get a staging buffer: the second save does not
    wait for (or, with when_busy='skip', get dropped behind) the first one's write."""
    g = tmp_path / "global_step1"
    ops = FaultyOps()
    gate = ops.gate("fsync", path_contains="model")
    ck = fastckpt.Checkpointer(rank=0, world_size=1, when_busy="skip", ops=ops)
    try:
        ck.save(_state(1), str(g / "model.pt"), group=str(g))
        assert gate.wait_entered()  # the model file's write is in flight, holding its buffer
        optim = ck.save(_state(2), str(g / "optim.pt"), group=str(g))
        gate.open()
        assert optim.wait().skipped is False
        ck.commit(str(g)).wait()
    finally:
        gate.open()
        ck.close()
    assert torch.equal(fastckpt.load(str(g / "optim.pt"))["w"], _state(2)["w"])
    assert latest(str(tmp_path)) == str(g)


def test_a_group_commit_counts_durable_s_from_the_first_save_call(tmp_path: Path) -> None:
    """SaveRecord timings are seconds from the save call: a group's durable_s counts from its oldest file's save,
    not from commit(), so it is never less than its own files' (here the copies home, capped at 8 MB/s, take
    most of it, all before commit() is called)."""
    g = str(tmp_path / "home" / "global_step1")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), replicate_bandwidth_Bps=8e6, rank=0,
                               world_size=1) as ck:
        t0 = time.monotonic()
        handles = [ck.save({"w": torch.ones(1 << 20)}, f"{g}/{n}.pt", group=g) for n in ("model", "optim")]
        files = [h.wait() for h in handles]
        rec = ck.commit(g, step=1).wait()
        elapsed = time.monotonic() - t0
    assert max(r.durable_s for r in files) >= 2 * 4 * (1 << 20) / 8e6 * 0.9  # the cap held the copies
    assert max(r.durable_s for r in files) <= rec.durable_s <= elapsed
    assert rec.commit_s == rec.durable_s


# --------------------------------------------------------------------------- remove_group
def test_remove_group_unpublishes_first(tmp_path: Path) -> None:
    g_old = _save_group(tmp_path / "global_step1", step=1)
    g_new = _save_group(tmp_path / "global_step2", step=2)
    assert latest(str(tmp_path)) == g_new
    unlinked: list[str] = []
    ops = FaultyOps(on_call=lambda op, path: unlinked.append(path) if op == "unlink" else None)
    delete_checkpoint(Homes(ops=ops).resolve(g_new))
    assert unlinked[0] == os.path.join(g_new, P.GROUP_MANIFEST)
    assert not os.path.exists(g_new)
    assert latest(str(tmp_path)) == g_old


def test_remove_group_whose_manifest_cannot_be_removed_stays_whole(tmp_path: Path) -> None:
    g = _save_group(tmp_path / "global_step1", step=1)
    with pytest.raises(OSError):
        delete_checkpoint(Homes(ops=FaultyOps([Fault("unlink", errno.EACCES)])).resolve(g))
    assert latest(str(tmp_path)) == g
    assert torch.equal(fastckpt.load(os.path.join(g, "shard1.pt"))["w"], _state(11)["w"])


def test_remove_incomplete_group(tmp_path: Path) -> None:
    g = _save_group(tmp_path / "global_step1", step=1, commit_ranks=(1,))
    delete_checkpoint(Homes(ops=FileOps()).resolve(g))
    assert not os.path.exists(g)


def test_checkpointer_remove_of_a_group(tmp_path: Path) -> None:
    g = _save_group(tmp_path / "global_step1", step=1)
    with fastckpt.Checkpointer(rank=0, world_size=2) as ck:
        ck.remove(g)
    assert not os.path.exists(g)
    assert latest(str(tmp_path)) is None


def test_group_manifest_is_json_with_sizes_and_checksums(tmp_path: Path) -> None:
    g = Path(_save_group(tmp_path / "global_step9", world=2, step=9))
    m = json.loads((g / P.GROUP_MANIFEST).read_text())
    for name, info in m["files"].items():
        assert info["size"] == (g / name).stat().st_size
        assert info["checksum"] == read_file_manifest(str(g / name))["checksum"]["value"]
    assert m["format"] == 2 and m["step"] == 9  # 2: it carries a digest


def test_commit_without_moving_latest(tmp_path: Path) -> None:
    """``commit(group, move_latest=False)`` publishes the group but leaves ``latest`` alone
    (DeepSpeed's ``save_checkpoint(..., save_latest=False)``)."""
    parent = tmp_path / "run"
    with fastckpt.Checkpointer(rank=0, world_size=1) as ck:
        for name, move in (("global_step1", True), ("best", False)):
            g = str(parent / name)
            ck.save(_state(1), f"{g}/shard0.pt", group=g)
            ck.commit(g, move_latest=move).wait()
    assert P.read_group_manifest(place(parent / "best")) is not None
    assert (parent / P.LATEST).read_text() == "global_step1"


def test_a_group_is_deleted_manifest_first_and_commit_markers_last(tmp_path) -> None:
    """A reader that catches a group mid-deletion finds no manifest; were its rank markers gone
    before its files, it would be told that ranks "never committed" a group that was committed
    and is being removed."""
    from fastckpt.testing import FaultyOps

    g = str(tmp_path / "run" / "global_step7")
    gone: list[str] = []
    ops = FaultyOps(on_call=lambda op, path: gone.append(path) if op in ("unlink", "rmdir") else None)
    cks = [fastckpt.Checkpointer(rank=r, world_size=2, ops=ops) for r in range(2)]
    try:
        for ck in cks:
            ck.save({"w": torch.ones(4)}, f"{g}/r{ck.rank}.pt", group=g)
        for h in [ck.commit(g) for ck in cks]:
            h.wait(60)
        gone.clear()
        cks[0].remove(g)
    finally:
        for ck in cks:
            ck.close()
    names = [p.removeprefix(g + "/") for p in gone if p.startswith(g)]
    assert names[0] == "fastckpt-manifest.json"
    markers = [i for i, n in enumerate(names) if n.startswith(".fastckpt")]
    files = [i for i, n in enumerate(names) if n in ("r0.pt", "r1.pt")]
    assert len(files) == 2 and markers and max(files) < min(markers), names
    assert not os.path.exists(g)


@pytest.mark.parametrize("step", ["100", -1, True, 1.0, torch.tensor(True), torch.tensor([False]),
                                  np.array(True)], ids=["str", "negative", "bool", "float", "bool-tensor",
                                                        "bool-tensor-1", "bool-array"])
def test_commit_refuses_a_step_that_is_no_int_from_zero(tmp_path: Path, step: object) -> None:
    """A step orders the groups (``latest``, retention): one that is no int >= 0 was written to the
    manifest, then passed over for the tag's number, without a word. It is refused before
    anything is done, so the same commit with a good step still publishes the group."""
    group = str(tmp_path / "global_step5")
    with fastckpt.Checkpointer(rank=0, world_size=1) as ck:
        ck.save(_state(5), f"{group}/r0.pt", group=group)
        with pytest.raises(ConfigError, match=r"the step must be an integer >= 0"):
            ck.commit(group, step=step)
        ck.commit(group, step=5).wait()
    assert json.loads((Path(group) / P.GROUP_MANIFEST).read_text())["step"] == 5


@pytest.mark.parametrize("step", [np.int64(7), torch.tensor(7)], ids=["numpy", "tensor"])
def test_commit_records_an_integer_step_of_another_type_as_an_int(tmp_path: Path, step: object) -> None:
    """A training loop's step is often a numpy integer or a 0-dim tensor: its value is the step."""
    group = str(tmp_path / "global_step7")
    with fastckpt.Checkpointer(rank=0, world_size=1) as ck:
        ck.save(_state(7), f"{group}/r0.pt", group=group)
        ck.commit(group, step=step).wait()
    manifest = json.loads((Path(group) / P.GROUP_MANIFEST).read_text())
    assert manifest["step"] == 7 and type(manifest["step"]) is int
