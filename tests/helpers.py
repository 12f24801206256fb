"""Small helpers shared by tests: the core's Place and discovery API, addressed by plain paths."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fastckpt.commit import discovery
from fastckpt.events import Event
from fastckpt.io.atomic import is_tmp
from fastckpt.io.ops import FileOps
from fastckpt.storage.homes import Homes
from fastckpt.storage.places import Place


def place(path: str | os.PathLike, ops: FileOps | None = None) -> Place:
    """The Place of a directory (a group, or a directory holding ``latest``)."""
    return Homes(ops=ops).resolve(os.fspath(path)).place()


def read_file_manifest(path: str | os.PathLike) -> dict | None:
    """The fastckpt manifest in a file's zip comment; None for a plain torch.save file."""
    loc = Homes().resolve(os.fspath(path))
    return loc.target.read_manifest(loc.key)


def scan(root: str | os.PathLike, **kw: int) -> list[discovery.Found]:
    return discovery.scan(Homes().resolve(os.fspath(root)), **kw)


def latest(root: str | os.PathLike) -> str | None:
    return discovery.latest(Homes(), os.fspath(root))


def tmp_files(*roots: str | os.PathLike) -> list[str]:
    """The temp and probe files under ``roots`` (``io.atomic.is_tmp``), sorted: a failed or
    finished save must leave none."""
    return sorted(str(p) for r in roots for p in Path(r).rglob("*") if is_tmp(p.name))



class Queued:
    """An EventSink: how many "queued" events (a save's local write ended; its upload waits) each
    path had; ``wait`` for the n-th, with no timing."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.changed = threading.Condition()

    def emit(self, ev) -> None:  # noqa: ANN001
        if ev.name == "queued":
            with self.changed:
                self.counts[ev.path] = self.counts.get(ev.path, 0) + 1
                self.changed.notify_all()

    def wait(self, path: str, n: int) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.counts.get(path, 0) >= n, timeout=60)


class WriteDetails:
    """An event sink (``Checkpointer(sinks=[...])``) that keeps the ``detail`` of each write event."""

    def __init__(self) -> None:
        self.details: list[str | None] = []

    def emit(self, event: Event) -> None:
        if event.name == "write":
            self.details.append(event.detail)


def flip_byte(path: str | os.PathLike, offset: int, mask: int = 0xFF) -> None:
    """Damage one byte of ``path`` in place (XOR with ``mask``)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def expect_aborted_by_rank_1(failing: object, waiting: list, group: str) -> None:
    """Rank 1's commit of ``group`` raises its own ENOSPC (at the call or from the handle, as its
    save may end first); the other ranks' commit handles ``waiting`` raise within 60 s that the
    save failed on rank 1 (the commit timeout of these tests is 600 s)."""
    import pytest

    from fastckpt.errors import CheckpointWriteError

    with pytest.raises(CheckpointWriteError, match="No space left"):
        failing.commit(group).wait(60)  # type: ignore[attr-defined]
    for h in waiting:
        with pytest.raises(CheckpointWriteError, match=r"failed on another rank \(rank 1: .*No space left"):
            h.wait(60)


def close_all(cks: list) -> None:
    """Close every Checkpointer; a failed save raised once more at close is expected."""
    from fastckpt.errors import CheckpointWriteError

    for ck in cks:
        try:
            ck.close()
        except CheckpointWriteError:
            pass


def claim_race(put_new: Callable[[str, bytes], bytes | None], key: str, n: int) -> bytes:
    """``n`` threads, released together by a barrier, each ``put_new(key, b"who <i>")``:
    asserts that exactly one created it and the others got its bytes; returns them."""
    barrier, results = threading.Barrier(n), {}

    def create(i: int) -> None:
        barrier.wait()
        results[i] = put_new(key, f"who {i}".encode())

    threads = [threading.Thread(target=create, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    winners = [i for i, got in results.items() if got is None]
    assert len(winners) == 1
    won = f"who {winners[0]}".encode()
    assert set(results.values()) == {None, won}
    return won


@contextlib.contextmanager
def collect_only_new() -> Iterator[None]:
    """Inside, ``gc.collect()`` scans only the objects made inside: everything older is frozen
    (``gc.freeze``). A full collection of the suite's heap (torch, Lightning, DeepSpeed, Megatron
    and botocore loaded by earlier tests) takes 0.5-2 s; a test that collects to free the
    garbage it made itself (an exception, a saved array) does not need to scan the rest."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _mounted(argv: list[str], path: Path, what: str) -> Iterator[Path]:
    """Run ``mount ARGV... path``, yield ``path``, unmount it (skip the test, saying it cannot
    ``what``, where this process may not mount)."""
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip(f"no `mount` binary: cannot {what}")
    r = subprocess.run(["mount", *argv, str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot {what} here (needs root/CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def bind_mount(src: Path, dst: Path) -> contextlib.AbstractContextManager[Path]:
    """Mount the directory ``src`` at ``dst`` too (skip the test where this process may not mount)."""
    return _mounted(["--bind", str(src)], dst, "show one directory at two paths (bind-mount)")


def tmpfs(path: Path, options: str, fstype: str = "tmpfs") -> contextlib.AbstractContextManager[Path]:
    """Mount a tmpfs (or ``fstype``: ``ramfs``, which reports no size and refuses O_DIRECT) at
    ``path`` (skip the test where this process may not mount)."""
    return _mounted(["-t", fstype, "-o", options, fstype], path, f"mount a {fstype} (a tiny or read-only file system)")


@contextlib.contextmanager
def coarse_ext4(path: Path) -> Iterator[Path]:
    """Mount at ``path`` a small ext4 image with 128-byte inodes, whose timestamps are whole
    seconds (skip the test where this process may not make or mount one)."""
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mkfs.ext4") is None or shutil.which("mount") is None:
        pytest.skip("no mkfs.ext4 or mount binary: cannot build an ext4 file system with coarse timestamps")
    img = path.with_name(path.name + ".img")
    with open(img, "wb") as f:
        f.truncate(16 << 20)
    r = subprocess.run(["mkfs.ext4", "-q", "-F", "-I", "128", str(img)], capture_output=True, text=True)
    if r.returncode == 0:
        r = subprocess.run(["mount", "-o", "loop", str(img), str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        img.unlink()
        pytest.skip(f"cannot make or mount an ext4 image here (needs root and a loop device): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)
        img.unlink()


class StubEngine:
    """What the DeepSpeed integration touches of a DeepSpeedEngine, with no process group:
    ``config`` (given: the dict DeepSpeed was given, which it stores in every checkpoint file) and
    the methods the hooks wrap."""

    global_rank = 0
    checkpoint_engine = None

    def __init__(self, config: dict | None = None) -> None:
        if config is not None:
            self.config = config

    def save_checkpoint(self, *args: object, **kwargs: object) -> bool:
        return True

    def load_checkpoint(self, *args: object, **kwargs: object) -> tuple:
        return None, None

    def destroy(self) -> None:
        pass
