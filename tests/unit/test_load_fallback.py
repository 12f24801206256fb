"""The burst-buffer copy as the fallback for a damaged home copy (``load.fallback``): only when
it is of the save the home holds. Another node's newer save, or another attempt of the group,
whose home file lost its trailer (the manifest) raises, as a flipped data byte does, instead of
resuming from this node's older state."""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.errors import CorruptCheckpointError


def _state(step: int) -> dict:
    return {"step": step, "w": torch.full((1000,), float(step))}


@pytest.mark.parametrize("damage", ["last byte lost", "cut 5000 bytes short"])
def test_a_damaged_newer_save_at_home_never_falls_back_to_an_older_local_copy(tmp_path: Path, damage: str) -> None:
    path = str(tmp_path / "home" / "last.pt")
    bb_a = str(tmp_path / "bbA")
    with fastckpt.Checkpointer(local_dir=bb_a) as a:
        a.save(_state(1), path).wait()
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bbB")) as b:  # another node saves the path since
        b.save(_state(2), path).wait()
    os.truncate(path, os.path.getsize(path) - (1 if damage == "last byte lost" else 5000))
    with fastckpt.Checkpointer(local_dir=bb_a) as a, pytest.raises(CorruptCheckpointError) as err:
        a.load(path)
    assert f"{path} is damaged" in str(err.value) and a.local_path(path) in str(err.value)
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bbB")) as b:  # B's copy is of that save: it loads
        assert b.load(path)["step"] == 2 and b.stats().last_restore_from == "local"


def _save_tag(store: dist.TCPStore, tag: str, val: int, bb: str) -> None:
    """Two ranks save and commit ``tag`` (r0 holds ``val``, r1 ``val + 1``), burst buffers ``bb0``, ``bb1``."""
    ranks = [fastckpt.Checkpointer(rank=r, world_size=2, store=store, local_dir=f"{bb}{r}") for r in range(2)]
    for ck in ranks:
        ck.save({"w": torch.full((4,), float(val + ck.rank))}, f"{tag}/r{ck.rank}.pt", group=tag)
    for h in [ck.commit(tag, step=4) for ck in ranks]:
        h.wait(60)
    for ck in ranks:
        ck.close()


@pytest.mark.parametrize("damage", ["last byte lost", "deleted"])
def test_a_damaged_group_file_never_falls_back_to_another_attempts_local_copy(tmp_path: Path, damage: str) -> None:
    """Per-file loads (DeepSpeed, Megatron) of a tag saved again by another job: the burst buffer
    still holds the first attempt with its group manifest; the home's r0 lost its last byte, or
    is gone. Before: r0 came from the burst buffer (first attempt, accepted by that stale group
    manifest), r1 from the home (second): a mixed state."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    tag = str(tmp_path / "home" / "global_step4")

    _save_tag(store, tag, 50, str(tmp_path / "bbX_"))
    _save_tag(store, tag, 60, str(tmp_path / "bbY_"))
    if damage == "deleted":
        os.unlink(f"{tag}/r0.pt")
    else:
        os.truncate(f"{tag}/r0.pt", os.path.getsize(f"{tag}/r0.pt") - 1)
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bbX_0")) as ck:
        with pytest.raises(CorruptCheckpointError if damage != "deleted" else FileNotFoundError) as err:
            ck.load(f"{tag}/r0.pt")
        assert damage != "deleted" or "not part of checkpoint group" in str(err.value.__notes__)
        assert ck.load(f"{tag}/r1.pt")["w"][0].item() == 61.0
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bbY_0")) as ck:  # the published attempt's copy loads
        assert ck.load(f"{tag}/r0.pt")["w"][0].item() == 60.0 and ck.stats().last_restore_from == "local"


def test_a_prefetch_of_a_group_file_is_judged_by_the_group_published_at_its_home(tmp_path: Path) -> None:
    """The tag removed and saved again by another job: the burst buffer still holds the first
    attempt's group manifest. Before: the prefetched file of the published attempt raised
    NotPublishedError (a FileNotFoundError: "nothing to resume") from that stale manifest."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    tag = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run/global_step4"

    _save_tag(store, tag, 50, str(tmp_path / "bbX_"))
    fsspec.filesystem("memory").rm(tag[len("memory://"):], recursive=True)  # another job removes the tag
    _save_tag(store, tag, 60, str(tmp_path / "bbY_"))
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bbX_0")) as ck:
        assert ck.load(f"{tag}/r1.pt", prefetch=True)["w"].tolist() == [61.0] * 4
        assert ck.stats().last_restore_from == "remote (prefetched)"
        assert ck.load(f"{tag}/r1.pt")["w"].tolist() == [61.0] * 4  # the download, by the home's group
        assert ck.stats().last_restore_from == "local"
        assert ck.load(f"{tag}/r0.pt")["w"].tolist() == [60.0] * 4  # the first attempt's local r0: not loaded


def test_a_home_copy_that_cannot_be_read_leaves_the_burst_buffer_copy_to_load(tmp_path: Path, caplog) -> None:
    """A home copy that fails with EIO (a failing disk, a stale NFS handle) shows no other save:
    d92cdb8 took the failed comparison for "another save" and refused this node's intact copy,
    with an error saying so. The copy loads, with a WARNING naming the risk."""
    import errno

    from fastckpt.testing import FaultyOps

    path, bb = str(tmp_path / "home" / "last.pt"), str(tmp_path / "bb")
    with fastckpt.Checkpointer(local_dir=bb) as ck:
        ck.save({"step": 2, "w": torch.full((20000,), 2.0)}, path).wait(60)

    def on_call(op: str, p: str) -> None:
        if p == path and op in ("open", "preadv", "map_private"):
            raise OSError(errno.EIO, "injected: I/O error reading the home copy", p)

    with fastckpt.Checkpointer(local_dir=bb, ops=FaultyOps([], on_call=on_call)) as ck, caplog.at_level("WARNING"):
        got = ck.load(path)
        assert got["step"] == 2 and ck.stats().last_restore_from == "local"
    assert "could not be read to compare it with its burst-buffer copy" in caplog.text


def test_a_load_reads_the_home_group_manifest_once_and_a_later_load_reads_it_again(tmp_path: Path) -> None:
    """Each of a group's files loaded from the burst buffer while its home copy is damaged: the
    load asked the home's group manifest whether the copy may stand in, then whether the copy
    read is of the group, and read it for each question (2 reads per file, 1200 for 600 files).
    Once per load now, and never once for several loads: a re-save between two is seen."""
    from fastckpt.testing import FaultyOps

    tag, bb, n = str(tmp_path / "home" / "global_step4"), str(tmp_path / "bb"), 3
    with fastckpt.Checkpointer(local_dir=bb) as ck:
        for i in range(n):
            ck.save({"w": torch.full((4,), float(i))}, f"{tag}/r{i}.pt", group=tag)
        ck.commit(tag, step=4).wait(60)
    for i in range(n):  # the home copies lose their last byte: the burst-buffer copies stand in
        os.truncate(f"{tag}/r{i}.pt", os.path.getsize(f"{tag}/r{i}.pt") - 1)
    reads: list[str] = []

    def on_call(op: str, p: str) -> None:
        if op == "open" and p == f"{tag}/fastckpt-manifest.json":
            reads.append(p)

    with fastckpt.Checkpointer(local_dir=bb, ops=FaultyOps([], on_call=on_call)) as ck:
        for i in range(n):
            assert ck.load(f"{tag}/r{i}.pt")["w"][0].item() == float(i)
            assert ck.stats().last_restore_from == "local"
        assert len(reads) == n
        with fastckpt.Checkpointer(local_dir=str(tmp_path / "bbY")) as other:  # another job saves the tag again
            other.save({"w": torch.full((4,), 60.0)}, f"{tag}/r0.pt", group=tag)
            other.commit(tag, step=4).wait(60)
        os.truncate(f"{tag}/r0.pt", os.path.getsize(f"{tag}/r0.pt") - 1)
        with pytest.raises(CorruptCheckpointError):  # this node's r0 is of the earlier save: never loaded
            ck.load(f"{tag}/r0.pt")


def test_a_burst_buffer_folder_that_is_a_file_leaves_the_home_copy_to_load(tmp_path: Path, caplog) -> None:
    """A plain file where the burst-buffer copy's folder should be (ENOTDIR): the copy cannot
    be looked at, which makes it unusable, not the checkpoint. The load raised that OSError
    (``load.prefetch.identity`` took only "no such file" for "no copy"); it reads the home copy,
    with one WARNING naming the copy."""
    path, bb = str(tmp_path / "home" / "a.pt"), str(tmp_path / "bb")
    with fastckpt.Checkpointer(local_dir=bb) as ck:
        ck.save(_state(3), path).wait(60)
        folder = os.path.dirname(ck.local_path(path))
    shutil.rmtree(folder)
    Path(folder).touch()
    with fastckpt.Checkpointer(local_dir=bb) as ck, caplog.at_level("WARNING"):
        assert ck.load(path)["step"] == 3 and ck.stats().last_restore_from == "path"
        assert ck.load(path, prefetch=True)["step"] == 3  # a mounted home: no download either way
    warned = [r.getMessage() for r in caplog.records if "cannot be looked at" in r.getMessage()]
    assert len(warned) == 1 and f"{folder}/a.pt" in warned[0] and "Not a directory" in warned[0]


_AS_NOBODY = """
import sys, fastckpt
with fastckpt.Checkpointer(local_dir=sys.argv[1]) as ck:
    print(ck.load(sys.argv[2])["step"], ck.stats().last_restore_from)
"""


def test_another_users_private_burst_buffer_folder_leaves_the_home_copy_to_load() -> None:
    """A shared ``local_dir`` where another user's job left its mode-700 folder (EACCES for this
    user): the load reads the home copy. Run as nobody (root ignores mode bits)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv, to load as another user than the folder's owner")
    base = Path(tempfile.mkdtemp())  # /tmp: a path nobody can reach (pytest's tmp_path is 0700)
    try:
        base.chmod(0o755)
        path, bb = str(base / "home" / "a.pt"), str(base / "bb")
        with fastckpt.Checkpointer(local_dir=bb) as ck:
            ck.save(_state(4), path).wait(60)
            folder = os.path.dirname(ck.local_path(path))
        for d, _, files in os.walk(base):
            os.chmod(d, 0o777 if d.startswith(bb) else 0o755)
            for f in files:
                os.chmod(os.path.join(d, f), 0o644)
        os.chmod(folder, 0o700)  # root's private folder in the shared burst buffer
        res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                              _AS_NOBODY, bb, path], capture_output=True, text=True, cwd=base,
                             env={**os.environ, "HOME": str(base)})
    finally:
        shutil.rmtree(base)
    if "ModuleNotFoundError" in res.stderr:
        pytest.skip(f"fastckpt cannot run as nobody here (its files unreadable to that user): {res.stderr[-300:]}")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["4", "path"] and "Permission denied" in res.stderr
