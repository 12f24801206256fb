"""The Megatron integration's pieces on real files, in one process: verified partial reads,
the tracker, and the resharding arithmetic."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

import fastckpt  # noqa: E402
from fastckpt import CorruptCheckpointError  # noqa: E402
from fastckpt.commit import protocol as P  # noqa: E402
from fastckpt.commit.order import AHEAD_S  # noqa: E402
from fastckpt.integrations import megatron as fm  # noqa: E402
from fastckpt.integrations._megatron.layout import Box, SavedTensor, byte_range, shard_view  # noqa: E402
from fastckpt.integrations._megatron.read import VerifiedFile  # noqa: E402
from fastckpt.io.atomic import publish_bytes  # noqa: E402
from fastckpt.io.ops import FileOps  # noqa: E402

MiB = 1 << 20
BLOCK = 16 * MiB


@pytest.fixture
def big_file(tmp_path) -> tuple[str, torch.Tensor]:
    t = torch.arange(80 * MiB, dtype=torch.uint8)  # 5 checksum blocks of data
    path = str(tmp_path / "big.pt")
    with fastckpt.Checkpointer() as ck:
        ck.save({"t": t}, path).wait()
    return path, t


def _data(vf: VerifiedFile, pool) -> tuple[int, int]:  # noqa: ANN001
    (name, (off, size)), = [(n, v) for n, v in vf.records(pool).items() if n.endswith("/data/0")]
    return off, size


def test_a_partial_read_reads_and_verifies_only_the_blocks_it_needs(big_file) -> None:
    path, t = big_file
    with ThreadPoolExecutor(4) as pool:
        vf = VerifiedFile(FileOps(), path)
        off, size = _data(vf, pool)
        before = vf.bytes_read  # the tail, the blocks holding the zip directory and the record's header
        lo, hi = off + 40 * MiB, off + 41 * MiB  # inside block 2
        vf.ensure([(lo, hi)], pool)
        assert vf.bytes_read - before == BLOCK
        assert torch.equal(vf.bytes(lo, hi), t[40 * MiB : 41 * MiB])
        assert vf.bytes_read < 0.7 * os.path.getsize(path)


def test_a_flipped_byte_is_caught_in_the_block_that_holds_it(big_file) -> None:
    path, _ = big_file
    with open(path, "r+b") as f:
        f.seek(BLOCK + 5)
        b = f.read(1)
        f.seek(BLOCK + 5)
        f.write(bytes([b[0] ^ 1]))
    with ThreadPoolExecutor(2) as pool:
        vf = VerifiedFile(FileOps(), path)
        off, _ = _data(vf, pool)
        vf.ensure([(off + 50 * MiB, off + 51 * MiB)], pool)  # block 3 is intact
        with pytest.raises(CorruptCheckpointError, match=r"big\.pt: bytes 16777216-33554432 \(checksum block 1\)"):
            vf.ensure([(off + BLOCK, off + BLOCK + 10)], pool)


def test_a_file_replaced_after_its_commit_is_refused(big_file) -> None:
    path, _ = big_file
    with pytest.raises(CorruptCheckpointError, match="replaced after the commit"):
        VerifiedFile(FileOps(), path, expect="0123456789abcdef")


def test_a_file_without_block_digests_is_read_and_verified_whole(tmp_path, monkeypatch) -> None:
    import fastckpt.format.manifest

    monkeypatch.setattr(fastckpt.format.manifest, "MAX_LISTED_BLOCKS", 0)  # as for files over 46.9 GiB
    path = str(tmp_path / "whole.pt")
    t = torch.arange(20 * MiB, dtype=torch.uint8)
    with fastckpt.Checkpointer() as ck:
        ck.save({"t": t}, path).wait()
    with ThreadPoolExecutor(2) as pool:
        vf = VerifiedFile(FileOps(), path)
        off, _ = _data(vf, pool)
        vf.ensure([(off, off + 10)], pool)
        assert vf.bytes_read >= os.path.getsize(path) - 65536
        assert torch.equal(vf.bytes(off, off + 10), t[:10])


def _group(root: str, it: int) -> str:
    d = os.path.join(root, f"iter_{it:07d}")
    with fastckpt.Checkpointer() as ck:
        ck.save({"x": torch.ones(2)}, os.path.join(d, "a.pt"), group=d)
        ck.commit(d).wait()
    return d


def test_the_tracker_names_the_iteration_just_committed_once_it_is_complete(tmp_path) -> None:
    root = str(tmp_path)
    _group(root, 2)
    os.makedirs(os.path.join(root, "iter_0000003"))  # never committed
    assert fm.advance_tracker(root, 3) is False and fm.read_tracker(root) is None
    assert fm.advance_tracker(root, 2) is True and fm.read_tracker(root) == 2
    _group(root, 1)  # a rollback: resumed from an earlier iteration, saved a lower number
    assert fm.advance_tracker(root, 1) is True and fm.read_tracker(root) == 1
    with open(os.path.join(root, fm.TRACKER)) as f:
        assert f.read() == "1"  # Megatron-LM's format: the number, nothing else
    _group(root, 5)
    _group(root, 6)
    assert fm.advance_tracker(root, 6) is True
    assert fm.advance_tracker(root, 5) is False  # committed before 6, finishing late: not back to it
    assert fm.read_tracker(root) == 6


def _edit_tracker(root: str, text: str) -> None:
    with open(os.path.join(root, fm.TRACKER), "w") as f:  # as a user rolling back does
        f.write(text)


def test_sync_tracker_keeps_a_users_rollback(tmp_path, caplog) -> None:
    root = str(tmp_path)
    for it in (100, 200):
        _group(root, it)
        fm.advance_tracker(root, it)  # Megatron-LM's finalize step
    _edit_tracker(root, "100")
    with caplog.at_level("WARNING", logger="fastckpt.megatron"):
        assert fm.sync_tracker(root) == 100 == fm.read_tracker(root)
    assert not [r for r in caplog.records if fm.TRACKER in r.getMessage()]
    _group(root, 150)  # the rerun from 100
    assert fm.advance_tracker(root, 150) is True
    assert fm.sync_tracker(root) == 150 == fm.read_tracker(root) == fm.newest_complete_iteration(root)
    assert fastckpt.latest(root) == os.path.join(root, "iter_0000150")


def test_sync_tracker_catches_up_with_a_commit_its_write_missed(tmp_path, caplog) -> None:
    root = str(tmp_path)
    _group(root, 1)
    assert fm.sync_tracker(root) == 1  # no tracker yet: a kill fell before its first write
    _group(root, 5)
    os.makedirs(os.path.join(root, "iter_0000006"))
    assert fm.newest_complete_iteration(root) == 5
    assert fm.read_tracker(root) == 1 and fm.sync_tracker(root) == 5 == fm.read_tracker(root)
    assert fastckpt.latest(root) == os.path.join(root, "iter_0000005")
    _edit_tracker(root, "1")  # a rollback, then the rerun's commit of 3 is killed before the tracker
    _group(root, 3)
    with caplog.at_level("WARNING", logger="fastckpt.megatron"):
        assert fm.sync_tracker(root) == 3 == fm.read_tracker(root)
    assert any("named 1, now 3" in r.getMessage() for r in caplog.records)


def test_ranks_that_sync_the_tracker_at_once_reach_the_same_iteration(tmp_path, monkeypatch) -> None:
    """Every rank runs sync_tracker before Megatron-LM reads the tracker. A rank that read the old
    tracker, then the record another rank had just written with the new one, took the tracker
    for a user's edit and kept the old iteration: the ranks resumed from different iterations."""
    from fastckpt.integrations._megatron import tracker as T

    root = str(tmp_path)
    _group(root, 2)
    fm.advance_tracker(root, 2)
    _group(root, 3)  # committed, then killed before the tracker moved: the tracker names 2
    read, other = T.read_tracker, []

    def read_then_let_another_rank_sync(save_dir: str) -> int | str | None:
        got = read(save_dir)
        if not other:  # the other rank's whole sync_tracker lands right after this rank's read
            other.append(True)
            other.append(T.sync_tracker(save_dir))
        return got

    monkeypatch.setattr(T, "read_tracker", read_then_let_another_rank_sync)
    mine = T.sync_tracker(root)
    assert (mine, other[1]) == (3, 3)  # before: (2, 3)
    assert fm.read_tracker(root) == 3


class _ReadOnly(FileOps):
    """What a read-only mount (a published model store) answers to writes under ``root``."""

    def __init__(self, root: str) -> None:
        super().__init__()
        self.root = root + os.sep

    def _refuse(self, path: str) -> None:
        if os.path.abspath(path).startswith(self.root):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            self._refuse(path)
        return super().open(path, flags, mode)

    def replace(self, src: str, dst: str) -> None:
        self._refuse(dst)
        super().replace(src, dst)


def test_sync_tracker_reads_a_read_only_copy_without_writing(tmp_path, caplog) -> None:
    """A published copy (``cp -r run/* pub/``: no record beside the tracker) on a read-only mount:
    sync_tracker wrote its record though the tracker was right, and the load failed with EROFS."""
    run, pub = str(tmp_path / "run"), str(tmp_path / "pub")
    for it in (100, 200):
        _group(run, it)
        fm.advance_tracker(run, it)
    shutil.copytree(run, pub, ignore=lambda d, names: [n for n in names if d == run and n.startswith(".")])
    ro = _ReadOnly(pub)
    assert fm.sync_tracker(pub, ops=ro) == 200 == fm.read_tracker(pub)
    _edit_tracker(pub, "300")  # names a missing iteration, and cannot be moved here: said, not raised
    with caplog.at_level("WARNING", logger="fastckpt.megatron"):
        assert fm.sync_tracker(pub, ops=ro) == 300 == fm.read_tracker(pub)
    assert any("cannot be written here" in r.getMessage() and "--ckpt-step 200" in r.getMessage()
               for r in caplog.records)


class _RecordRefused(FileOps):
    """A record another user owns in a sticky directory: the tracker can move, its record cannot."""

    def replace(self, src: str, dst: str) -> None:
        if os.path.basename(dst) == ".fastckpt-tracker.json":
            raise OSError(errno.EPERM, os.strerror(errno.EPERM), dst)
        super().replace(src, dst)


def test_sync_tracker_names_the_iteration_it_moved_to_when_only_the_record_fails(tmp_path, caplog) -> None:
    """The tracker moved to 200 and its record failed: it warned the tracker named 100, returned 100
    and put back 100's files, while Megatron-LM loaded 200 (and other ranks said 200)."""
    root = str(tmp_path)
    _group(root, 100)
    fm.advance_tracker(root, 100)
    _group(root, 200)  # committed; a kill before the tracker moved
    with caplog.at_level("WARNING", logger="fastckpt.megatron"):
        assert fm.sync_tracker(root, ops=_RecordRefused()) == 200 == fm.read_tracker(root)
    assert any("named 100, now 200" in r.getMessage() for r in caplog.records)


_TORN_COMMON_READ_ONLY = """
import errno, os, sys
import torch, torch.distributed as dist
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedTensor
import fastckpt
from fastckpt.integrations import megatron as fm
sys.path.insert(0, sys.argv[2])
from test_megatron_read import _ReadOnly
root = sys.argv[1]
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(root, ".store"), 1), rank=0, world_size=1)
it = os.path.join(root, "pub", "iter_0000005")
os.makedirs(it)
with fastckpt.Checkpointer() as ck:
    fm.register(ck)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4, 6)), "iteration": 1}, it, ("fastckpt", 1))
    assert fm.advance_tracker(os.path.dirname(it), 5)
    torch.save({"iteration": 99}, os.path.join(it, "common.pt"))  # a re-save killed after its in-place rewrite
    print("synced", fm.sync_tracker(os.path.dirname(it), ops=_ReadOnly(os.path.dirname(it))))
    got = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6))}, it)
    print("loaded", got["iteration"], float(got["w"][0, 0]))
dist.destroy_process_group()
"""


def test_sync_tracker_on_a_read_only_copy_with_a_torn_common_pt_loads_the_committed_one(tmp_path,
                                                                                        megatron_python) -> None:
    """The put-back of common.pt a killed re-save rewrote in place raised EROFS on a read-only
    --load, though the load reads the committed bytes (from the index) without it."""
    out = megatron_python.run_code(_TORN_COMMON_READ_ONLY, [str(tmp_path), os.path.dirname(__file__)], 300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "synced 5" in out.stdout and "loaded 1 1.0" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "could not put back the files a killed save rewrote in place" in out.stderr


def test_sync_tracker_moves_off_an_incomplete_iteration_only(tmp_path, caplog) -> None:
    root = str(tmp_path)
    _group(root, 4)
    fm.advance_tracker(root, 4)
    _edit_tracker(root, "9")  # no such checkpoint
    with caplog.at_level("WARNING", logger="fastckpt.megatron"):
        assert fm.sync_tracker(root) == 4
    assert any("iteration 9 is not a complete checkpoint" in r.getMessage() for r in caplog.records)
    half = os.path.join(root, "iter_0000008")
    with fastckpt.Checkpointer() as ck:
        ck.save({"x": torch.ones(2)}, os.path.join(half, fm.TENSOR_FILE.format(0)), group=half).wait()  # uncommitted
    _edit_tracker(root, "8")
    assert fm.sync_tracker(root) == 4
    other = os.path.join(root, "iter_0000002")  # a checkpoint of another format (torch_dist)
    os.makedirs(other)
    with open(os.path.join(other, "metadata.json"), "w") as f:
        f.write('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    _edit_tracker(root, "2")
    assert fm.sync_tracker(root) == 2 == fm.read_tracker(root)


@pytest.mark.parametrize("backend", ["torch_dist", "fastckpt"])
def test_sync_tracker_judges_an_iteration_by_its_metadata_json_before_our_leftovers(tmp_path, backend) -> None:
    """A fastckpt save of iteration 2 failed and left its files; megatron's torch_dist save into the
    same directory then completed and Megatron-LM pointed the tracker at 2. Our leftover names were
    judged first: sync_tracker called 2 incomplete and moved the tracker back to 1."""
    root = str(tmp_path)
    _group(root, 1)
    fm.advance_tracker(root, 1)
    two = os.path.join(root, "iter_0000002")
    with fastckpt.Checkpointer() as ck:  # the failed save's file, never committed
        ck.save({"x": torch.ones(2)}, os.path.join(two, fm.TENSOR_FILE.format(0)), group=two).wait()
    with open(os.path.join(two, "metadata.json"), "w") as f:  # written last by megatron's finalize
        f.write(f'{{"sharded_backend": "{backend}", "sharded_backend_version": 1}}')
    _edit_tracker(root, "2")
    want = 2 if backend == "torch_dist" else 1  # (ours never committed: incomplete, as before)
    assert fm.sync_tracker(root) == want == fm.read_tracker(root)


def test_repair_checkpoint_refuses_a_path_that_is_not_a_committed_checkpoint(tmp_path) -> None:
    """A misspelled iteration, or the save directory given for one, answered [] as an intact
    checkpoint does: the torn checkpoint stayed torn and the next load failed inside megatron."""
    from fastckpt.errors import CheckpointNotFoundError, ConfigError, IncompleteCheckpointError

    root = str(tmp_path)
    good = _group(root, 100)
    assert fm.repair_checkpoint(good) == []  # committed, nothing rewritten
    typo = os.path.join(root, "iter_000100")
    with pytest.raises(CheckpointNotFoundError, match=re.escape(typo) + " does not exist, so nothing was put back"):
        fm.repair_checkpoint(typo)
    with pytest.raises(IncompleteCheckpointError, match="its newest committed checkpoint is " + re.escape(good)):
        fm.repair_checkpoint(root)
    half = os.path.join(root, "iter_0000200")
    with fastckpt.Checkpointer() as ck:
        ck.save({"x": torch.ones(2)}, os.path.join(half, fm.TENSOR_FILE.format(0)), group=half).wait()  # uncommitted
    with pytest.raises(IncompleteCheckpointError, match="is not a committed fastckpt checkpoint .* load an earlier"):
        fm.repair_checkpoint(half)
    theirs = os.path.join(root, "iter_0000300")  # megatron's torch_dist checkpoint: nothing of ours to put back
    os.makedirs(theirs)
    with open(os.path.join(theirs, "metadata.json"), "w") as f:
        f.write('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    assert fm.repair_checkpoint(theirs) == []
    a_file = os.path.join(good, "fastckpt-manifest.json")
    with pytest.raises(CheckpointNotFoundError, match="is a file, not a checkpoint directory"):
        fm.repair_checkpoint(a_file)
    for given in (a_file, a_file + os.sep):  # with a trailing slash: os.path.exists said no, a raw error followed
        said = re.escape(given) + " is a file, not a save directory: give Megatron-LM's --save"
        for fn in (fm.sync_tracker, fm.read_tracker, fm.newest_complete_iteration,  # was: a raw NotADirectoryError
                   lambda f: fm.advance_tracker(f, 100)):  # was: a warning calling iteration 100 incomplete, and False
            with pytest.raises(ConfigError, match=said):
                fn(given)
    assert fm.newest_complete_iteration(os.path.join(root, "nothing-here")) is None
    assert fm.sync_tracker(os.path.join(root, "nothing-here")) is None


@pytest.mark.parametrize("damage", ["cut short", "not a manifest"])
def test_repair_checkpoint_of_a_damaged_manifest_names_the_file_and_the_fix(tmp_path, damage: str) -> None:
    """repair_checkpoint on an iteration whose group manifest is damaged raised the parse error
    alone: no fix. As sync_tracker's load of it does, it names the file, an earlier iteration to
    load (the newest complete one) and `fastckpt verify`."""
    root = str(tmp_path)
    only = _group(root, 100)
    manifest = os.path.join(only, P.GROUP_MANIFEST)
    with open(manifest) as f:
        text = f.read()
    with open(manifest, "w") as f:
        f.write(text[: len(text) // 2] if damage == "cut short" else '{"files": null}')
    with pytest.raises(CorruptCheckpointError, match=re.escape(manifest)) as raised:
        fm.repair_checkpoint(only)
    notes = " ".join(getattr(raised.value, "__notes__", []))
    assert f"Nothing was put back in {only}: load an earlier checkpoint, with --ckpt-step N" in notes, notes
    assert f"({root} holds none)" in notes and f"`fastckpt verify {only}` names what is damaged" in notes
    _group(root, 50)  # an earlier complete iteration: named
    with pytest.raises(CorruptCheckpointError, match=re.escape(manifest)) as raised:
        fm.repair_checkpoint(only)
    assert "(the newest is 50)" in " ".join(raised.value.__notes__)


def test_byte_range_and_view_of_a_non_contiguous_shard() -> None:
    base = torch.arange(30, dtype=torch.float32).reshape(10, 3)
    view = base.t()  # (3, 10), strides (1, 3)
    saved = SavedTensor("k", "float32", (6, 10), Box((3, 0), (3, 10)), "f", 0, base.untyped_storage().nbytes(),
                        view.storage_offset(), tuple(view.stride()))
    part = Box((4, 2), (2, 5))  # rows 1-2, columns 2-6 of the shard
    lo, hi = byte_range(saved, part)
    assert (lo, hi) == ((1 + 2 * 3) * 4, (2 + 6 * 3 + 1) * 4)
    record = torch.frombuffer(bytearray(base.numpy().tobytes()), dtype=torch.uint8)
    assert torch.equal(shard_view(saved, record)[part.within(saved.box)], view[1:3, 2:7])
    assert not saved.is_contiguous()


def test_box_intersections() -> None:
    a = Box((0, 0), (4, 8))
    assert a.intersect(Box((2, 4), (4, 8))) == Box((2, 4), (2, 4))
    assert a.intersect(Box((4, 0), (4, 8))) is None
    assert str(a) == "[0:4, 0:8]"


def _dated_ahead(group: str, ahead_s: float) -> None:
    """Date a group's commit as a node whose clock ran ``ahead_s`` ahead of this one's did."""
    path = os.path.join(group, P.GROUP_MANIFEST)
    with open(path) as f:
        manifest = json.load(f)
    manifest["requested_at"] += ahead_s
    publish_bytes(FileOps(), path, P.manifest_bytes(manifest))


@pytest.mark.parametrize("ahead_s", [600.0, 30.0])
@pytest.mark.parametrize("after", ["finalize", "kill"])
def test_a_tracker_a_clock_that_ran_ahead_wrote_moves_on_as_latest_does(tmp_path, caplog, ahead_s, after) -> None:
    """The previous run's clock ran ahead (or this host's is behind): the tracker's record of
    iteration 2 is dated after every commit of this run. advance_tracker refused each of them
    without a word and sync_tracker kept 2, while fastckpt.latest moved on: Megatron-LM resumed
    from 2. Both follow the pointer's rule now (a commit dated more than a minute ahead of this
    host's clock holds neither); within that minute the tracker stays, as the pointer does."""
    root = str(tmp_path)
    _group(root, 1)
    fm.advance_tracker(root, 1)
    _dated_ahead(_group(root, 2), ahead_s)  # committed by the previous run, on the skewed node
    assert fm.advance_tracker(root, 2) is True
    _group(root, 3)  # this run, on a host with the right time
    moves = ahead_s > AHEAD_S
    assert fastckpt.latest(root) == os.path.join(root, "iter_0000003" if moves else "iter_0000002")
    with caplog.at_level("WARNING", logger="fastckpt.megatron"):
        if after == "finalize":  # Megatron-LM's finalize step
            assert fm.advance_tracker(root, 3) is moves
            assert fm.read_tracker(root) == (3 if moves else 2) == fm.sync_tracker(root)
        else:  # killed before its finalize: the restart's sync_tracker
            assert fm.sync_tracker(root) == (3 if moves else 2) == fm.read_tracker(root)
    assert fm.newest_complete_iteration(root) == fm.read_tracker(root)
    declined = [r for r in caplog.records if "not pointing" in r.getMessage() and r.levelname == "WARNING"]
    assert len(declined) == (1 if after == "finalize" and not moves else 0)
    _group(root, 4)
    assert fm.advance_tracker(root, 4) is moves  # (within the minute: still held, as latest is)


def test_every_rank_syncs_the_tracker_to_one_iteration_whatever_its_clock(tmp_path, monkeypatch) -> None:
    """sync_tracker runs on every rank. Iteration 2 was committed on a node whose clock ran 600 s
    ahead; this run committed 3 (the pointer moved) and was killed before its tracker write. A
    rank on the skewed node kept 2 while one on a right clock moved to 3: two ranks of one job
    resumed different iterations. The pointer decides, not the rank's clock."""
    from fastckpt.commit import order

    root = str(tmp_path)
    _dated_ahead(_group(root, 2), 600.0)
    assert fm.advance_tracker(root, 2) is True
    _group(root, 3)
    assert fastckpt.latest(root) == os.path.join(root, "iter_0000003") and fm.read_tracker(root) == 2
    real = time.time
    monkeypatch.setattr(order, "time", SimpleNamespace(time=lambda: real() + 600.0))  # the skewed node
    on_skewed = fm.sync_tracker(root)
    monkeypatch.setattr(order, "time", time)
    assert on_skewed == fm.sync_tracker(root) == 3 == fm.read_tracker(root)


def test_a_damaged_group_manifest_is_an_incomplete_iteration_that_fails_only_its_own_load(tmp_path, caplog) -> None:
    """A group manifest cut short (bit rot, a partial copy) in any iteration made sync_tracker
    raise CorruptCheckpointError naming no fix: the patched Megatron-LM could not start at all,
    even with --ckpt-step for an intact iteration. It is not complete now, as for fastckpt.latest."""
    root = str(tmp_path)
    for it in (1, 2):
        _group(root, it)
        fm.advance_tracker(root, it)
    damaged = os.path.join(root, "iter_0000002", P.GROUP_MANIFEST)
    with open(damaged) as f:
        text = f.read()
    with open(damaged, "w") as f:
        f.write(text[: len(text) // 2])
    with caplog.at_level("WARNING", logger="fastckpt.megatron"):
        assert fm.sync_tracker(root, load_iteration=1) == 1 == fm.read_tracker(root)  # --ckpt-step 1
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(damaged in m and "does not parse" in m for m in said)
    assert any("named 2, now 1: iteration 2 is not a complete checkpoint" in m for m in said)
    assert fm.sync_tracker(root) == 1 == fm.newest_complete_iteration(root)
    assert fastckpt.latest(root) == os.path.join(root, "iter_0000001")
    assert fm.advance_tracker(root, 2) is False
    with pytest.raises(CorruptCheckpointError, match="does not parse") as raised:  # --ckpt-step 2: its own damage
        fm.sync_tracker(root, load_iteration=2)
    assert "load an earlier checkpoint, with --ckpt-step N" in str(raised.value.__notes__)
    assert "the newest is 1" in str(raised.value.__notes__)
