"""Faults at every step of a save (through fastckpt.testing.FaultyOps) on the direct and nvme tiers.

After each fault: the error surfaces exactly once with its errno, the previous checkpoint at
the same path still loads and is unchanged, nothing partial is visible, no temp file is left,
and the Checkpointer keeps working. Also: flipped bytes, unsupported objects, mutation after
save, steady-state memory, and when_busy='skip'.
"""

from __future__ import annotations

import concurrent.futures
import errno
import gc
import logging
import os
import shutil
import subprocess
import zipfile
from dataclasses import dataclass
from types import SimpleNamespace

import psutil
import pytest
import torch

import fastckpt
from fastckpt import Checkpointer, CheckpointWriteError, CorruptCheckpointError, UnsupportedObjectError
from fastckpt.eventlog import error_type
from fastckpt.io.atomic import TMP_TAG
from fastckpt.io.ops import FileOps
from fastckpt.report import load_run
from fastckpt.save.tiers import probe_odirect
from fastckpt.testing import Fault, FaultyOps
from tests.helpers import collect_only_new, flip_byte


def _state(v: int) -> dict:
    # Integer tensors, so equality is exact; > 4 KiB so the payload pwrite can be cut short.
    return {"model": {"w": torch.full((4096,), v, dtype=torch.int64), "b": torch.arange(300, dtype=torch.int32) + v},
            "opt": [torch.tensor(v), {"lr": 0.1 * v}], "step": v}


def _assert_state(got: object, v: int) -> None:
    want = _state(v)
    assert isinstance(got, dict)
    assert got["step"] == want["step"]
    assert got["opt"][1] == want["opt"][1]
    assert torch.equal(got["model"]["w"], want["model"]["w"])
    assert torch.equal(got["model"]["b"], want["model"]["b"])
    assert torch.equal(got["opt"][0], want["opt"][0])


def _tmp_files(root) -> list[str]:  # noqa: ANN001
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if TMP_TAG in n]


@dataclass
class Env:
    root: str
    out: str
    local: str
    path: str
    tier: str

    def checkpointer(self, ops: FaultyOps | None = None, **kw) -> Checkpointer:  # noqa: ANN003
        return Checkpointer(local_dir=self.local if self.tier == "nvme" else None, ops=ops, **kw)


@pytest.fixture(params=["direct", "nvme"])
def env(request, tmp_path) -> Env:  # noqa: ANN001
    out = str(tmp_path / "out")
    return Env(str(tmp_path), out, str(tmp_path / "local"), os.path.join(out, "ck.pt"), request.param)


_ODIRECT = None


def _odirect_here(d: str) -> bool:
    global _ODIRECT
    if _ODIRECT is None:
        _ODIRECT = probe_odirect(d)[0]
    return _ODIRECT


# (case id, fault factory(prefix), errno raised). The prefix selects the stage: the final
# directory (direct tier, or the nvme tier's copy to the path) or local_dir (the nvme burst buffer).
CASES = {
    "open-EACCES": (lambda p: Fault("open", errno.EACCES, path_startswith=p), errno.EACCES),
    "makedirs-EACCES": (lambda p: Fault("makedirs", errno.EACCES, path_startswith=p), errno.EACCES),
    "pwrite-ENOSPC": (lambda p: Fault("pwrite", errno.ENOSPC, path_startswith=p), errno.ENOSPC),
    "pwrite-EIO": (lambda p: Fault("pwrite", errno.EIO, path_startswith=p), errno.EIO),
    "pwrite-ENOSPC-2nd": (lambda p: Fault("pwrite", errno.ENOSPC, nth=2, path_startswith=p), errno.ENOSPC),
    "pwrite-short0": (lambda p: Fault("pwrite", short=0, path_startswith=p), errno.EIO),
    "fsync-EIO": (lambda p: Fault("fsync", errno.EIO, path_startswith=p), errno.EIO),
    "ftruncate-EIO": (lambda p: Fault("ftruncate", errno.EIO, path_startswith=p), errno.EIO),
    "replace-EROFS": (lambda p: Fault("replace", errno.EROFS, path_startswith=p), errno.EROFS),
    "fsync_dir-EIO": (lambda p: Fault("fsync_dir", errno.EIO, path_startswith=p), errno.EIO),
}
# (tier, stage): stage "final" faults calls under the checkpoint's directory, "local" under local_dir.
STAGES = [("direct", "final"), ("nvme", "local"), ("nvme", "final")]


@pytest.mark.parametrize(("tier", "stage"), STAGES, ids=[f"{t}-{s}" for t, s in STAGES])
@pytest.mark.parametrize("case", list(CASES))
def test_fault_keeps_previous_checkpoint(tmp_path, tier: str, stage: str, case: str) -> None:
    out = str(tmp_path / "out")
    env = Env(str(tmp_path), out, str(tmp_path / "local"), os.path.join(out, "ck.pt"), tier)
    make_fault, code = CASES[case]
    if case == "ftruncate-EIO" and not _odirect_here(str(tmp_path)):
        pytest.skip("ftruncate is only used after O_DIRECT writes, which this filesystem refuses")
    if case == "pwrite-ENOSPC-2nd" and (tier, stage) == ("nvme", "final"):
        pytest.skip("the copy to the path writes a small file in one pwrite: there is no 2nd one")
    ops = FaultyOps()
    ck = env.checkpointer(ops)
    ck.save(_state(1), env.path).wait()
    ops.inject(make_fault(env.local if stage == "local" else env.out))
    try:
        h = ck.save(_state(2), env.path)
    except CheckpointWriteError as exc:  # the directory the save writes into is made at the call
        assert case == "makedirs-EACCES" and exc.errno == code, exc
        h = None
        raised = exc
    if stage == "local" and code == errno.ENOSPC:  # the burst buffer filled up: the file goes to its path
        rec = h.wait()
        ops.assert_all_reached()
        assert rec.tier == "direct" and rec.durable_s is not None
        _assert_state(fastckpt.load(env.path), 2)
        _assert_state(ck.load(env.path), 2)
        assert os.listdir(env.out) == ["ck.pt"] and _tmp_files(env.root) == []
        ck.close()
        return
    if h is not None:
        with pytest.raises(CheckpointWriteError) as ei:
            h.wait()
        raised = ei.value
    exc = raised
    assert isinstance(exc, OSError)
    assert exc.errno == code
    assert env.path in str(exc)
    if case == "pwrite-short0":
        assert "no progress" in str(exc)
    ops.assert_all_reached()
    ck.wait()  # surfaced once: not again

    # A failed fsync of the directory comes after the rename: the new file is complete and in
    # place (its directory entry is what may not be durable). Every other fault leaves v1.
    visible = 2 if case == "fsync_dir-EIO" and stage == "final" else 1
    _assert_state(fastckpt.load(env.path), visible)
    _assert_state(ck.load(env.path), visible)  # the burst-buffer copy must not win over the path
    assert fastckpt.latest(env.out) == env.path
    assert os.listdir(env.out) == ["ck.pt"]
    assert _tmp_files(env.root) == []

    rec = ck.save(_state(3), env.path).wait()  # the Checkpointer keeps working
    assert not rec.skipped
    _assert_state(fastckpt.load(env.path), 3)
    ck.close()  # and never raises the old error again


@pytest.mark.parametrize("case", ["pwrite-ENOSPC", "fsync-EIO", "replace-EROFS", "open-EACCES"])
def test_fault_on_first_save_leaves_nothing(env: Env, case: str) -> None:
    make_fault, code = CASES[case]
    ops = FaultyOps([make_fault(env.out)])
    with env.checkpointer(ops) as ck:
        with pytest.raises(CheckpointWriteError) as ei:
            ck.save(_state(1), env.path).wait()
        assert ei.value.errno == code
        ops.assert_all_reached()
        assert not os.path.exists(env.path)
        assert fastckpt.latest(env.out) is None
        assert fastckpt.latest(env.root) in (None, ck.local_path(env.path))
        assert _tmp_files(env.root) == []


@pytest.mark.parametrize("sync", ["handle", "ck.wait", "next save", "close"])
def test_error_surfaces_exactly_once(env: Env, sync: str) -> None:
    ops = FaultyOps()
    ck = env.checkpointer(ops)
    ck.save(_state(1), env.path).wait()
    ops.inject(Fault("pwrite", errno.ENOSPC, path_startswith=env.out))
    h = ck.save(_state(2), env.path)
    if sync == "handle":
        with pytest.raises(CheckpointWriteError) as ei:
            h.wait()
        ck.wait()
        ck.save(_state(3), env.path).wait()
        ck.close()
    elif sync == "ck.wait":
        with pytest.raises(CheckpointWriteError) as ei:
            ck.wait()
        ck.wait()
        ck.close()
    elif sync == "next save":
        # The failure is complete (its future is done) before the next save is called: that
        # save must raise it, even if the done-callbacks have not run yet.
        concurrent.futures.wait([h._future], timeout=60)
        with pytest.raises(CheckpointWriteError) as ei:
            ck.save(_state(3), env.path)
        ck.save(_state(3), env.path).wait()
        ck.wait()
        ck.close()
    else:
        with pytest.raises(CheckpointWriteError) as ei:
            ck.close()
        ck.close()
    assert ei.value.errno == errno.ENOSPC
    assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == errno.ENOSPC
    ops.assert_all_reached()
    _assert_state(fastckpt.load(env.path), 3 if sync in ("handle", "next save") else 1)


def test_repeated_failures_each_surface(tmp_path) -> None:
    """A failure whose handle was waited on must not hide later, unrelated failures."""
    ops = FaultyOps()
    path = str(tmp_path / "ck.pt")
    with Checkpointer(ops=ops) as ck, collect_only_new():
        ck.save(_state(0), path).wait()  # the tier probe's writes are done: the faults hit saves
        for i in range(5):
            ops.inject(Fault("pwrite", errno.EIO))
            with pytest.raises(CheckpointWriteError):
                ck.save(_state(i), path).wait()
            gc.collect()  # free the seen exception: its id must not be mistaken for a new one's
            ops.inject(Fault("pwrite", errno.ENOSPC))
            ck.save(_state(i), path)  # nobody waits on this handle
            with pytest.raises(CheckpointWriteError) as ei:
                ck.wait()
            assert ei.value.errno == errno.ENOSPC
            gc.collect()
        ops.assert_all_reached()


def test_short_write_with_progress_still_writes_a_correct_file(env: Env) -> None:
    # 4096: O_DIRECT short writes come in whole blocks. Two of them, in both stages on nvme.
    faults = [Fault("pwrite", short=4096, path_startswith=env.out),
              Fault("pwrite", short=4096, nth=2, path_startswith=env.out)]
    if env.tier == "nvme":
        faults.append(Fault("pwrite", short=4096, path_startswith=env.local))
    ops = FaultyOps(faults)
    with env.checkpointer(ops) as ck:
        ck.save(_state(1), env.path).wait()
        ops.assert_all_reached()
        _assert_state(ck.load(env.path), 1)
    _assert_state(torch.load(env.path, weights_only=True), 1)
    _assert_state(fastckpt.load(env.path), 1)


def test_unaligned_short_write_buffered(tmp_path) -> None:
    path = str(tmp_path / "ck.pt")
    ops = FaultyOps([Fault("pwrite", short=1), Fault("pwrite", short=777, nth=3)])
    with Checkpointer(ops=ops, odirect=False) as ck:
        rec = ck.save(_state(5), path).wait()
    assert rec.odirect is False
    ops.assert_all_reached()
    _assert_state(fastckpt.load(path), 5)


def test_odirect_einval_falls_back_to_buffered(tmp_path) -> None:
    if not _odirect_here(str(tmp_path)):
        pytest.skip("O_DIRECT is not honoured here")
    path = str(tmp_path / "ck.pt")
    ops = FaultyOps([Fault("pwrite", errno.EINVAL, path_contains=TMP_TAG)])  # not the tier probe
    with Checkpointer(ops=ops) as ck:
        rec = ck.save(_state(4), path).wait()
    ops.assert_all_reached()
    assert rec.odirect is False and "EINVAL" in (rec.odirect_reason or "")
    _assert_state(fastckpt.load(path), 4)


def test_odirect_einval_in_the_replication_falls_back_to_buffered(tmp_path) -> None:
    """The copy from the burst buffer to the path falls back as the save's own write does."""
    if not _odirect_here(str(tmp_path)):
        pytest.skip("O_DIRECT is not honoured here")
    home = str(tmp_path / "home")
    path = os.path.join(home, "ck.pt")

    class NoDirectWritesAtHome(FileOps):  # a file system that takes O_DIRECT at open, refuses its writes
        def __init__(self) -> None:
            self.direct: set[int] = set()
            self.refused = 0

        def open(self, path: str, flags: int, mode: int = 0o644) -> int:
            fd = super().open(path, flags, mode)
            writing_direct = flags & os.O_DIRECT and flags & os.O_WRONLY and path.startswith(home + os.sep + TMP_TAG)
            (self.direct.add if writing_direct else self.direct.discard)(fd)
            return fd

        def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
            if fd in self.direct:
                self.refused += 1
                raise OSError(errno.EINVAL, "Invalid argument")
            return super().pwrite(fd, data, offset)

    ops = NoDirectWritesAtHome()
    with Checkpointer(ops=ops, local_dir=str(tmp_path / "nvme")) as ck:
        rec = ck.save(_state(4), path).wait()
    assert ops.refused and rec.tier == "nvme" and rec.durable_s is not None
    _assert_state(fastckpt.load(path), 4)
    assert _tmp_files(tmp_path / "home") == []


def test_failed_reopen_after_einval_reports_the_open_error(tmp_path) -> None:
    """The buffered re-open fails: its error surfaces (not EBADF from closing the fd twice)."""
    if not _odirect_here(str(tmp_path)):
        pytest.skip("O_DIRECT is not honoured here")
    path = str(tmp_path / "ck.pt")
    ops = FaultyOps([Fault("pwrite", errno.EINVAL, path_contains=TMP_TAG),
                     Fault("open", errno.EACCES, nth=2, path_contains=TMP_TAG)])
    with Checkpointer(ops=ops) as ck:
        with pytest.raises(CheckpointWriteError) as ei:
            ck.save(_state(4), path).wait()
    assert ei.value.errno == errno.EACCES
    ops.assert_all_reached()
    assert _tmp_files(tmp_path) == []


def test_cleanup_failure_does_not_mask_the_error(tmp_path, caplog) -> None:
    path = str(tmp_path / "ck.pt")
    ops = FaultyOps()
    with Checkpointer(ops=ops) as ck:
        ck.save(_state(1), path).wait()
        ops.inject(Fault("pwrite", errno.ENOSPC), Fault("unlink", errno.EIO, path_contains=TMP_TAG))
        with caplog.at_level(logging.WARNING), pytest.raises(CheckpointWriteError) as ei:
            ck.save(_state(2), path).wait()
    assert ei.value.errno == errno.ENOSPC
    ops.assert_all_reached()
    assert any("could not remove temp file" in r.getMessage() for r in caplog.records)
    # The stray temp file is ignored by discovery and loading.
    assert len(_tmp_files(tmp_path)) == 1
    assert fastckpt.latest(str(tmp_path)) == path
    _assert_state(fastckpt.load(path), 1)


def test_group_commit_failure_keeps_previous_group(tmp_path) -> None:
    ops = FaultyOps()
    g1, g2 = str(tmp_path / "step-1"), str(tmp_path / "step-2")
    with Checkpointer(ops=ops, rank=0, world_size=1) as ck:
        ck.save(_state(1), os.path.join(g1, "model.pt"), group=g1)
        ck.commit(g1, step=1).wait()
        ops.inject(Fault("write_small", errno.EIO, path_contains="fastckpt-manifest"))
        ck.save(_state(2), os.path.join(g2, "model.pt"), group=g2)
        h = ck.commit(g2, step=2)
        with pytest.raises(OSError) as ei:
            h.wait()
        assert ei.value.errno == errno.EIO
        ck.wait()
    ops.assert_all_reached()
    assert fastckpt.latest(str(tmp_path)) == g1
    _assert_state(fastckpt.load(os.path.join(g1, "model.pt")), 1)
    with pytest.raises(fastckpt.IncompleteCheckpointError):
        fastckpt.load(os.path.join(g2, "model.pt"))
    assert _tmp_files(tmp_path) == []


def test_read_error_on_load(env: Env) -> None:
    ops = FaultyOps()
    with env.checkpointer(ops) as ck:
        ck.save(_state(1), env.path).wait()
        if env.tier == "nvme":
            # The burst-buffer copy fails to read: the copy at the path serves the load.
            ops.inject(Fault("preadv", errno.EIO, path_startswith=env.local))
            _assert_state(ck.load(env.path), 1)
        else:
            ops.inject(Fault("preadv", errno.EIO))
            with pytest.raises(OSError) as ei:
                ck.load(env.path)
            assert ei.value.errno == errno.EIO
        ops.assert_all_reached()


def test_replication_read_error(tmp_path) -> None:
    env = Env(str(tmp_path), str(tmp_path / "out"), str(tmp_path / "local"), str(tmp_path / "out" / "ck.pt"), "nvme")
    ops = FaultyOps()
    with env.checkpointer(ops) as ck:
        ck.save(_state(1), env.path).wait()
        ops.inject(Fault("preadv", errno.EIO, path_startswith=env.local))
        with pytest.raises(CheckpointWriteError) as ei:
            ck.save(_state(2), env.path).wait()
        assert ei.value.errno == errno.EIO
        _assert_state(ck.load(env.path), 1)
    ops.assert_all_reached()
    _assert_state(fastckpt.load(env.path), 1)
    assert _tmp_files(tmp_path) == []


# ---------------------------------------------------------------------- real permission errors
def _chattr(flag: str, path: str) -> bool:
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", flag, path], capture_output=True, check=False).returncode == 0


def test_real_immutable_directory(tmp_path) -> None:
    """A directory nobody may write, root included: ``chattr +i`` (EPERM on create/rename)."""
    out = tmp_path / "ro"
    out.mkdir()
    path = str(out / "ck.pt")
    ck = Checkpointer()
    ck.save(_state(1), path).wait()
    if not _chattr("+i", str(out)):
        ck.close()
        pytest.skip("chattr +i is not permitted here (needs CAP_LINUX_IMMUTABLE and ext4/xfs)")
    try:
        # The tier for this directory is already chosen: the failure comes from the writer.
        with pytest.raises(CheckpointWriteError) as ei:
            ck.save(_state(2), path).wait()
        assert ei.value.errno in (errno.EPERM, errno.EACCES)
        ck.wait()
        # A fresh Checkpointer probes the directory first: the save call itself fails.
        ck2 = Checkpointer()
        with pytest.raises(OSError) as ei2:
            ck2.save(_state(2), str(out / "other.pt"))
        assert ei2.value.errno in (errno.EPERM, errno.EACCES)
        ck2.close()
        _assert_state(fastckpt.load(path), 1)
        assert os.listdir(out) == ["ck.pt"]
    finally:
        _chattr("-i", str(out))
    ck.close()


def test_real_file_where_a_directory_is_expected(tmp_path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"x")
    with Checkpointer() as ck, pytest.raises(OSError) as ei:
        ck.save(_state(1), str(blocker / "sub" / "ck.pt"))
    assert ei.value.errno == errno.ENOTDIR
    assert blocker.read_bytes() == b"x"


# ---------------------------------------------------------------------- corruption
def _record_span(path: str, suffix: str) -> tuple[int, int]:
    reader = torch._C.PyTorchFileReader(path)
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(suffix))
    return reader.get_record_offset(suffix.lstrip("/")), info.file_size


@pytest.mark.parametrize("where", ["storage", "pickle", "central directory", "manifest"])
def test_flipped_byte_is_detected(tmp_path, where: str) -> None:
    path = str(tmp_path / "ck.pt")
    with Checkpointer() as ck:
        ck.save(_state(7), path).wait()
    _assert_state(torch.load(path, weights_only=True), 7)  # a plain torch.save file
    size = os.path.getsize(path)
    if where == "storage":
        off, n = _record_span(path, "/data/0")
        flip_byte(path, off + n // 2, mask=0x5A)
    elif where == "pickle":
        off, n = _record_span(path, "/data.pkl")
        flip_byte(path, off + n // 2, mask=0x5A)
    elif where == "central directory":
        with zipfile.ZipFile(path) as zf:
            comment = len(zf.comment)
        flip_byte(path, size - comment - 22 - 30, mask=0x5A)  # inside the last central directory entry
    else:
        with zipfile.ZipFile(path) as zf:
            comment = zf.comment
        # Break the JSON's structure (a flipped digit of a timestamp would be harmless).
        flip_byte(path, size - len(comment) + comment.index(b":"), mask=0x5A)
    for load in (fastckpt.load, lambda p: Checkpointer().load(p)):
        with pytest.raises(CorruptCheckpointError) as ei:
            load(path)
        assert path in str(ei.value)


# ---------------------------------------------------------------------- unsupported objects
def test_unsupported_object_names_its_key(tmp_path) -> None:
    path = str(tmp_path / "ck.pt")
    with Checkpointer() as ck:
        with pytest.raises(UnsupportedObjectError) as ei:
            ck.save({"a": {"b": lambda: 1}}, path)
        assert "['a']['b']" in str(ei.value)
        with pytest.raises(UnsupportedObjectError) as ei:
            ck.save({"x": [torch.zeros(2), {"m": torch.empty(3, device="meta")}]}, path)
        assert "['x'][1]['m']" in str(ei.value)
        assert isinstance(ei.value, TypeError)
        ck.save(_state(1), path).wait()  # nothing was left half-done
    assert _tmp_files(tmp_path) == []
    _assert_state(fastckpt.load(path), 1)


# ---------------------------------------------------------------------- snapshot semantics
def test_mutation_after_save_returns_is_not_written(env: Env) -> None:
    ops = FaultyOps()
    gate = ops.gate("pwrite", path_contains=TMP_TAG)  # hold the writer until the tensors were changed
    state = {"w": torch.arange(1 << 16, dtype=torch.int64), "step": 1}
    before = state["w"].clone()
    with env.checkpointer(ops) as ck:
        h = ck.save(state, env.path)
        state["w"].add_(1000)
        state["w"][0] = -5
        assert gate.wait_entered()
        gate.open()
        h.wait()
        got = ck.load(env.path)
    assert torch.equal(got["w"], before)
    assert torch.equal(fastckpt.load(env.path)["w"], before)


def test_when_busy_skip(env: Env) -> None:
    ops = FaultyOps()
    gate = ops.gate("pwrite", path_contains=TMP_TAG)  # the file's write, not the tier probe
    p2 = os.path.join(env.out, "second.pt")
    with env.checkpointer(ops, when_busy="skip") as ck:
        h1 = ck.save(_state(1), env.path)
        assert gate.wait_entered()
        with pytest.warns(UserWarning, match="skipped"):
            h2 = ck.save(_state(2), p2)
        rec = h2.wait()
        assert rec.skipped and rec.bytes == 0
        assert ck.stats().skipped == 1
        gate.open()
        assert not h1.wait().skipped
        assert not ck.save(_state(3), p2).wait().skipped  # free again
    _assert_state(fastckpt.load(env.path), 1)
    _assert_state(fastckpt.load(p2), 3)


def test_resident_memory_is_flat_over_saves(env: Env) -> None:
    state = {"w": torch.arange(8 << 20, dtype=torch.int64)}  # 64 MiB
    nbytes = state["w"].numel() * 8
    proc = psutil.Process()
    # The nvme copy keeps one reusable chunk buffer per I/O thread (engine._chunk_buffer): with
    # 16 MiB chunks and 4 threads those may add up to 48 MiB after the baseline. A leaked
    # staging buffer or loaded image (64 MiB each, per save or per load) is far above the bound.
    with env.checkpointer(chunk_bytes=16 << 20, io_threads=4) as ck:
        for i in range(20):
            ck.save(state, env.path).wait()
            if i % 5 == 4:  # loads must not pin memory either
                assert torch.equal(ck.load(env.path)["w"], state["w"])
            if i == 1:
                gc.collect()
                base = proc.memory_info().rss
        gc.collect()
        grown = proc.memory_info().rss - base
    assert grown < nbytes, f"RSS grew by {grown / 2**20:.1f} MiB over 18 saves of a 64 MiB state"


def test_close_raises_one_background_failure_and_logs_every_other(tmp_path, caplog) -> None:
    """Two saves fail in the background and nobody calls wait() in between: close() raises one
    of them, and the other is logged with its traceback, not dropped (before: dropped)."""
    ops = FaultyOps([Fault("fsync", errno.EIO, path_contains=f"{tmp_path}/Y/"),
                     Fault("fsync", errno.EIO, path_contains=f"{tmp_path}/Z/")])
    ck = Checkpointer(ops=ops, overhead_budget=0.99)
    ck.save(_state(1), str(tmp_path / "Y" / "b.pt"))
    ck.save(_state(2), str(tmp_path / "Z" / "c.pt"))
    with caplog.at_level(logging.ERROR, logger="fastckpt"), pytest.raises(CheckpointWriteError) as err:
        ck.close()
    logged = "\n".join(r.getMessage() for r in caplog.records if "close() raised another failure" in r.getMessage())
    raised, other = ("b.pt", "c.pt") if "b.pt" in str(err.value) else ("c.pt", "b.pt")
    assert raised in str(err.value) and other in logged and raised not in logged
    ops.assert_all_reached()


def test_an_interrupted_exit_flush_says_it_was_interrupted_not_that_a_save_failed(caplog) -> None:
    """Ctrl-C while close() waits at exit: the log says the flush of N saves was interrupted."""
    from fastckpt.exits import close_at_exit

    def interrupted() -> None:
        raise KeyboardInterrupt

    from fastckpt import exits

    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        close_at_exit(interrupted, lambda: 2, lambda: [])
    exits._STOPS.clear()  # what the interpreter's exit would report, here after a direct call
    assert any("interrupted (Ctrl-C) while flushing 2 pending save(s)" in r.getMessage() for r in caplog.records)
    assert not any("failed at exit" in r.getMessage() for r in caplog.records)


def test_a_stop_in_an_exit_flush_bounded_by_close_timeout_says_what_it_lost(caplog) -> None:
    """With close_timeout_s set, a SIGTERM handler's exit while close() waits at exit stops the flush as
    that timeout would (its note says so); the log said the flush went on, and nothing was lost."""
    from fastckpt import exits
    from fastckpt.exits import close_at_exit
    from fastckpt.records import stopped_note

    def stopped() -> None:
        exc = SystemExit(143)
        exc.add_note(stopped_note(()))
        raise exc

    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        close_at_exit(stopped, lambda: 0, lambda: [])  # the abandoned saves are no longer pending after close()
        exits._flush_live()  # what the interpreter's exit runs next: its closing line
    said = [r.getMessage() for r in caplog.records]
    assert any("stopped by sys.exit(143) while flushing 0 pending save(s) at interpreter exit: close_timeout_s is "
               "set, so the flush stopped as at that timeout: close() stopped without them" in m for m in said), said
    assert any("during the exit flush, which went on first unless close_timeout_s bounds it" in m for m in said)
    assert not exits._STOPS


@pytest.mark.parametrize("local", [False, True])
def test_a_save_close_gave_up_on_before_its_write_started_says_so(tmp_path, local: bool) -> None:
    """close() past close_timeout_s while a.pt is being written and b.pt waits behind it: b.pt's
    handle raises a CheckpointWriteError naming it (before: a bare CancelledError, or, through
    the burst buffer, it never resolved), and close()'s error says what stopped."""
    ops = FaultyOps()
    held = ops.gate("pwrite", path_contains="a.pt")
    ck = Checkpointer(ops=ops, staging_buffers=2, close_timeout_s=0.5, overhead_budget=0.99,
                      local_dir=str(tmp_path / "nvme") if local else None)
    try:
        ck.save(_state(1), str(tmp_path / "home" / "a.pt"))
        queued = ck.save(_state(2), str(tmp_path / "home" / "b.pt"))
        assert held.wait_entered(30)
        with pytest.raises(fastckpt.ReplicationError, match="still pending after") as err:
            ck.close()
        notes = "\n".join(getattr(err.value, "__notes__", []))
        assert "a save whose write had not started is not written" in notes
        assert ("copies already in the burst buffer stay there" in notes) == local
        with pytest.raises(CheckpointWriteError, match="b.pt was not saved: close.. stopped"):
            queued.wait(30)
    finally:
        held.open()
    assert not (tmp_path / "home" / "b.pt").exists()


def test_a_wait_past_its_timeout_names_its_own_limit(tmp_path) -> None:
    """wait(timeout_s=...) that runs out named only close_timeout_s as the fix, an option wait()
    never reads: the error names the caller's own limit too."""
    ops = FaultyOps()
    held = ops.gate("fsync", path_contains="held.pt")
    ck = Checkpointer(ops=ops, overhead_budget=0.99)
    try:
        ck.save(_state(1), str(tmp_path / "held.pt"))
        assert held.wait_entered(30)
        with pytest.raises(fastckpt.ReplicationError, match=r"still pending after 0.05 s.*wait\(timeout_s=\.\.\.\)"):
            ck.wait(timeout_s=0.05)
    finally:
        held.open()
        ck.close()


@pytest.mark.parametrize("op, err, phase", [("pwrite", errno.ENOSPC, "write"), ("replace", errno.EIO, "commit")])
def test_a_failed_phase_is_counted_as_the_error_the_caller_gets(tmp_path, op: str, err: int, phase: str) -> None:
    """The save raises CheckpointWriteError, and its failed event (which fastckpt_failures_total's
    ``error`` label and ``fastckpt report``'s failures are made from) must say so. Before, the
    event carried the OSError inside it: counted as ``write: OSError``, so an alert on
    CheckpointWriteError never fired, and ENOSPC, EIO, EACCES... all read as one bare OSError."""
    events: list = []
    ops, log = FaultyOps(), tmp_path / "events.jsonl"
    with Checkpointer(ops=ops, event_log=str(log), sinks=(SimpleNamespace(emit=events.append),)) as ck:
        ck.save(_state(1), str(tmp_path / "a.pt")).wait()
        ops.inject(Fault(op, err, path_contains="b.pt"))
        with pytest.raises(CheckpointWriteError) as raised:
            ck.save(_state(2), str(tmp_path / "b.pt")).wait()
    ops.assert_all_reached()
    assert raised.value.errno == err
    (failed,) = [e for e in events if e.error is not None]
    assert (failed.name, error_type(failed.error)) == (phase, "CheckpointWriteError")
    assert f"saving {tmp_path / 'b.pt'} failed" in failed.error  # the message the caller got
    assert load_run([str(log)])[1].failures == {f"{phase}: CheckpointWriteError": 1}
