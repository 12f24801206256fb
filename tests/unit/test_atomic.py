"""io/atomic.py: temp names, the temp -> fsync -> rename recipe, discard, the sweep of dead writers' files."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import pytest

from fastckpt.io import atomic as A
from fastckpt.io.ops import FileOps
from fastckpt.testing import Fault, FaultyOps
from tests.helpers import tmp_files


# --------------------------------------------------------------------------- publish_bytes
def test_tmp_name_is_hidden_unique_and_beside_the_path(tmp_path: Path) -> None:
    p = str(tmp_path / "dir" / "hpc_ckpt_1.ckpt")
    a, b = A.tmp_name(p), A.tmp_name(p)
    assert a != b
    assert os.path.dirname(a) == os.path.dirname(p)
    assert os.path.basename(a).startswith(".")
    # never the file's name: Lightning's SLURM resume parses a version out of any name holding "hpc_ckpt_"
    assert "hpc_ckpt" not in os.path.basename(a)
    assert A.final_path(a) == p and A.final_path(p) is None  # read back from the name (fault seams match it)
    long = str(tmp_path / ("x" * 200))
    assert len(os.path.basename(A.tmp_name(long))) <= A.NAME_MAX and A.final_path(A.tmp_name(long)) is None
    assert A.is_tmp(a) and A.is_tmp(os.path.basename(a))
    assert not A.is_tmp(p)


def test_publish_bytes_writes_and_replaces(tmp_path: Path) -> None:
    ops = FaultyOps()
    target = tmp_path / "latest"
    A.publish_bytes(ops, str(target), b"global_step1")
    assert target.read_bytes() == b"global_step1"
    A.publish_bytes(ops, str(target), b"global_step20")
    assert target.read_bytes() == b"global_step20"
    assert ops.calls("replace") == 2
    assert ops.calls("fsync_dir") == 2  # the rename itself is made durable
    assert tmp_files(tmp_path) == []


@pytest.mark.parametrize("fault", [Fault("write_small", errno.ENOSPC), Fault("pwrite", errno.EIO),
                                   Fault("pwrite", short=0), Fault("fsync", errno.EIO),
                                   Fault("replace", errno.EACCES)], ids=lambda f: f.describe())
def test_publish_bytes_failure_keeps_old_content_and_no_temp(tmp_path: Path, fault: Fault) -> None:
    target = tmp_path / "latest"
    A.publish_bytes(FileOps(), str(target), b"old")
    ops = FaultyOps([fault])
    with pytest.raises(OSError):
        A.publish_bytes(ops, str(target), b"new content")
    ops.assert_all_reached()
    assert target.read_bytes() == b"old"
    assert tmp_files(tmp_path) == []


def test_publish_bytes_failure_on_a_new_file_leaves_nothing(tmp_path: Path) -> None:
    ops = FaultyOps([Fault("fsync", errno.EIO)])
    with pytest.raises(OSError):
        A.publish_bytes(ops, str(tmp_path / "fastckpt-manifest.json"), b"{}")
    assert list(tmp_path.iterdir()) == []


def test_publish_bytes_readers_see_old_or_new_never_partial(tmp_path: Path) -> None:
    target = tmp_path / "latest"
    versions = [bytes([65 + i % 26]) * (1000 + 997 * i) for i in range(60)]
    A.publish_bytes(FileOps(), str(target), versions[0])
    done = threading.Event()
    seen: list[bytes] = []

    def reader() -> None:
        while not done.is_set():
            seen.append(target.read_bytes())

    th = threading.Thread(target=reader)
    th.start()
    try:
        for v in versions[1:]:
            A.publish_bytes(FileOps(), str(target), v)
    finally:
        done.set()
        th.join()
    seen.append(target.read_bytes())
    assert {s for s in seen if s not in versions} == set()
    assert seen[-1] == versions[-1]


def test_discard_ignores_missing_and_logs_other_errors(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    A.discard(FileOps(), str(tmp_path / "nothing"))  # no error
    victim = tmp_path / "x.tmp"
    victim.write_bytes(b"1")
    with caplog.at_level(logging.WARNING):
        A.discard(FaultyOps([Fault("unlink", errno.EBUSY)]), str(victim))
    assert victim.exists()
    assert any(str(victim) in r.getMessage() for r in caplog.records)


def test_sweep_removes_only_dead_local_processes_temp_files(tmp_path) -> None:
    import subprocess
    import sys

    from fastckpt.io.atomic import _HOST, sweep_stale_tmp, tmp_name

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    mine = tmp_name(str(tmp_path / "a.pt"))
    stale = str(tmp_path / f".fastckpt-tmp-{_HOST}.{dead}.0123456789ab~{b'b.pt'.hex()}")
    stale_old_form = str(tmp_path / f".b.pt.fastckpt-tmp-{_HOST}.{dead}.0123456789ab")  # earlier versions' names
    other_host = str(tmp_path / f".fastckpt-tmp-elsewhere.{dead}.0123456789ab~{b'c.pt'.hex()}")
    other_pidns = str(tmp_path / f".fastckpt-tmp-{_HOST.split('@')[0]}@1.{dead}.0123456789ab~{b'd.pt'.hex()}")
    for p in (mine, stale, stale_old_form, other_host, other_pidns):
        open(p, "wb").close()
    assert sweep_stale_tmp(FileOps(), str(tmp_path)) == 2
    assert os.path.exists(mine) and os.path.exists(other_host) and os.path.exists(other_pidns)
    assert not os.path.exists(stale) and not os.path.exists(stale_old_form)



def test_sweep_tree_removes_dead_processes_temp_files_in_every_folder_up_to_its_cap(tmp_path) -> None:
    """A burst buffer's whole tree (``Stripes`` at a Checkpointer's first save): the same rules as
    ``sweep_stale_tmp`` in each folder, symlinks not followed, and a cap on the names read."""
    import subprocess
    import sys

    from fastckpt.io.atomic import _HOST, sweep_tree, tmp_name

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    deep, outside = tmp_path / "bb" / "run" / "version_0" / "checkpoints", tmp_path / "outside"
    deep.mkdir(parents=True)
    outside.mkdir()
    (tmp_path / "bb" / "link").symlink_to(outside)
    stale = [str(d / f".fastckpt-tmp-{_HOST}.{dead}.0123456789ab~{b'last.ckpt'.hex()}") for d in (deep, outside)]
    kept = [tmp_name(str(deep / "a.pt")), str(deep / f".fastckpt-tmp-elsewhere.{dead}.0123456789ab")]
    for p in (*stale, *kept):
        open(p, "wb").close()
    assert sweep_tree(FileOps(), str(tmp_path / "bb"), max_names=2) == 0  # "run" and "link": stopped
    assert sweep_tree(FileOps(), str(tmp_path / "bb")) == 1
    assert not os.path.exists(stale[0]) and os.path.exists(stale[1])  # not through the symlink
    assert all(os.path.exists(p) for p in kept)

# --------------------------------------------------------------------------- replacing, the old file freed later
def _replace(ops: FileOps, target: Path, data: bytes, later: list[str]) -> None:
    with A.replacing(ops, str(target), later.append) as st:
        ops.write_small(st.tmp, data)


def test_the_replaced_file_keeps_a_temp_name_until_unlink_later_removes_it(tmp_path: Path) -> None:
    target = tmp_path / "ckpt.pt"
    target.write_bytes(b"old" * 1000)
    old_inode = os.stat(target).st_ino
    later: list[str] = []
    with open(target, "rb") as reader:  # opened before the replace: still reads the old bytes
        _replace(FileOps(), target, b"new", later)
        assert reader.read() == b"old" * 1000
    assert target.read_bytes() == b"new"
    # the rename dropped a name, not the file: it lives on under a hidden temp name, its only one
    assert len(later) == 1 and A.is_tmp(later[0]) and os.path.dirname(later[0]) == str(tmp_path)
    assert (os.stat(later[0]).st_ino, os.stat(later[0]).st_nlink) == (old_inode, 1)
    assert tmp_files(tmp_path) == later
    A.discard(FileOps(), later[0])
    assert tmp_files(tmp_path) == []


def test_a_first_save_or_a_file_system_without_hard_links_frees_in_the_rename(tmp_path: Path) -> None:
    later: list[str] = []
    _replace(FileOps(), tmp_path / "first.pt", b"1", later)  # nothing to replace
    target = tmp_path / "ckpt.pt"
    target.write_bytes(b"old")
    ops = FaultyOps([Fault("link", errno.EPERM)])  # as on file systems without hard links
    _replace(ops, target, b"new", later)
    ops.assert_all_reached()
    assert (later, target.read_bytes(), tmp_files(tmp_path)) == ([], b"new", [])


@pytest.mark.parametrize("fault", [Fault("replace", errno.EACCES), Fault("fsync_dir", errno.EIO)],
                         ids=lambda f: f.describe())
def test_a_failed_commit_leaves_no_second_name(tmp_path: Path, fault: Fault) -> None:
    target = tmp_path / "ckpt.pt"
    target.write_bytes(b"old")
    ops, later = FaultyOps([fault]), []
    with pytest.raises(OSError):
        _replace(ops, target, b"new", later)
    ops.assert_all_reached()
    # a failed rename keeps the old file; a failed directory fsync comes after it (the new one)
    assert target.read_bytes() == (b"old" if fault.op == "replace" else b"new")
    assert (later, tmp_files(tmp_path)) == ([], [])


def test_a_commit_that_fails_keeping_the_old_file_leaves_no_temp(tmp_path: Path) -> None:
    """The link that keeps the old file raised a ValueError for a name with a NUL (os.link:
    "embedded null byte") outside the commit's try: the whole new file stayed under its hidden
    temp name (its name is encoded, so it was written)."""
    later: list[str] = []
    with pytest.raises(ValueError, match="null"):
        _replace(FileOps(), tmp_path / "a\x00b.pt", b"new" * 1000, later)
    assert (later, tmp_files(tmp_path)) == ([], [])


def test_a_kill_before_the_old_file_is_removed_leaves_a_temp_name_the_sweep_removes(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    target = tmp_path / "ckpt.pt"
    target.write_bytes(b"old")
    child = ("import os, signal, sys\nfrom fastckpt.io import atomic as A\nfrom fastckpt.io.ops import FileOps\n"
             "ops = FileOps()\n"
             "with A.replacing(ops, sys.argv[1], lambda p: os.kill(os.getpid(), signal.SIGKILL)) as st:\n"
             "    ops.write_small(st.tmp, b'new')\n")
    proc = subprocess.run([sys.executable, "-c", child, str(target)], capture_output=True, text=True, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert target.read_bytes() == b"new"
    left = tmp_files(tmp_path)
    assert len(left) == 1 and Path(left[0]).read_bytes() == b"old"
    assert A.sweep_stale_tmp(FileOps(), str(tmp_path)) == 1
    assert tmp_files(tmp_path) == []


def test_reaper_drains_what_it_was_given_and_works_again_after_close(tmp_path: Path) -> None:
    ops = FaultyOps()
    gate = ops.gate("unlink")
    reaper = A.Reaper(ops)
    victims = [tmp_path / f"v{i}" for i in range(3)]
    for v in victims[:2]:
        v.write_bytes(b"x")
        reaper.unlink_later(str(v))
    assert gate.wait_entered()
    reaper.drain(timeout_s=0.05)  # returns at its timeout, the removals held at the gate go on
    assert victims[0].exists() and victims[1].exists()
    drained = threading.Thread(target=reaper.drain)
    drained.start()
    drained.join(timeout=0.2)
    assert drained.is_alive() and victims[1].exists()  # held at the gate: drain waits for both
    gate.open()
    drained.join()
    assert not any(v.exists() for v in victims[:2])
    reaper.close()
    victims[2].write_bytes(b"x")
    reaper.unlink_later(str(victims[2]))  # a pool closed by Homes.close() is made again
    reaper.drain()
    assert not victims[2].exists()
    reaper.close()


def test_sweep_tree_reads_no_more_names_than_its_cap_in_one_big_folder(tmp_path, monkeypatch) -> None:
    """The cap bounds the first save's delay only if it bounds what is read: a folder was listed
    whole before the names were counted (a 300,000-name folder took 1.4 s;
    ``d4_sweep_tree_cap_reads_whole_directory``)."""
    import fastckpt.io.atomic as atomic

    big = tmp_path / "scratch"
    big.mkdir()
    for i in range(300):
        (big / f"f{i}").touch()
    read, real = [0], os.scandir

    class Counting:
        def __init__(self, d: str) -> None:
            self.it = real(d)

        def __enter__(self) -> "Counting":
            return self

        def __exit__(self, *exc: object) -> None:
            self.it.close()

        def __iter__(self):  # noqa: ANN204 (os.scandir's entries)
            for e in self.it:
                read[0] += 1
                yield e

    monkeypatch.setattr(atomic.os, "scandir", Counting)
    atomic.sweep_tree(FileOps(), str(tmp_path), max_names=100)
    assert read[0] <= 101
