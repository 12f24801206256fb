"""A prefetch never replaces a save that reached the burst buffer after the load looked at it.

Two Checkpointers share one ``local_dir`` and a remote home (a training and an eval process on
one node). The eval's ``load(..., prefetch=True)`` judges the burst-buffer copy (none there, or
an older save's) and downloads the home's copy; its download is held (FaultyOps) while the
training's save of the same path writes its local copy and waits for its upload. The download
then goes on: it must not land on that save's copy, which is its only one (before: renamed over
it, and the save failed as "changed after it was committed", its bytes gone), nor remove it
when the download does not verify (before: the clean-up unlinked whatever was at the path).
"""

from __future__ import annotations

import fcntl
import os
import threading
import uuid

import fsspec
import pytest
import torch

import fastckpt
from fastckpt.errors import CorruptCheckpointError
from fastckpt.io.atomic import is_tmp
from fastckpt.testing import FaultyOps


def _state(step: int) -> dict:
    return {"w": torch.full((1 << 12,), step, dtype=torch.int32), "step": step}


class Hold:
    """FaultyOps ``on_call``: holds the first call of ``op`` that ``match(path)`` accepts, made
    on a thread whose name starts with ``thread`` (any when None), once ``armed``."""

    def __init__(self, op: str, match, thread: str | None = None) -> None:  # noqa: ANN001
        self.op, self.match, self.thread, self.armed = op, match, thread, True
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, op: str, path: str) -> None:
        if not self.armed or op != self.op or self.entered.is_set() or not self.match(path):
            return
        if self.thread is not None and not threading.current_thread().name.startswith(self.thread):
            return
        self.entered.set()
        assert self.release.wait(60)


def _home_step(url: str) -> int:
    return fastckpt.load(url)["step"]


@pytest.mark.parametrize("local_copy", ["none", "older", "damaged download"])
def test_a_prefetch_never_lands_on_a_save_made_while_it_downloaded(tmp_path, local_copy: str) -> None:
    nvme = str(tmp_path / "nvme")
    url = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run/last.ckpt"
    held_upload = Hold("open", lambda p: p == local, thread="fastckpt-replicate")
    held_upload.armed = False
    train = fastckpt.Checkpointer(local_dir=nvme, ops=FaultyOps(on_call=held_upload))
    local = train.local_path(url)
    train.save(_state(1), url).wait()
    if local_copy == "older":  # another node saved the path since: the home's copy is newer than ours
        with fastckpt.Checkpointer(local_dir=str(tmp_path / "other")) as other:
            other.save(_state(2), url).wait()
    else:  # retention (or a wiped node) took the local copy
        os.unlink(local)
    if local_copy == "damaged download":
        fs, key = fsspec.filesystem("memory"), url.removeprefix("memory://")
        data = bytearray(fs.cat_file(key))
        data[len(data) // 3] ^= 1
        fs.pipe_file(key, bytes(data))
    # the download's data fsync: before its rename into the burst buffer, on every version
    held_download = Hold("fsync", lambda p: os.path.dirname(p) == os.path.dirname(local)
                         and is_tmp(os.path.basename(p)))
    evaluate = fastckpt.Checkpointer(local_dir=nvme, ops=FaultyOps(on_call=held_download))
    got: dict = {}

    def load() -> None:
        try:
            got["step"] = evaluate.load(url, prefetch=True)["step"]
        except CorruptCheckpointError as exc:
            got["error"] = exc

    loading = threading.Thread(target=load)
    try:
        loading.start()
        assert held_download.entered.wait(60)
        held_upload.armed = True
        handle = train.save(_state(3), url)  # lands in the burst buffer; its upload waits
        assert held_upload.entered.wait(60)
        held_download.release.set()
        loading.join(60)
        held_upload.release.set()
        assert handle.wait(60).durable_s is not None
    finally:
        held_download.release.set()
        held_upload.release.set()
        loading.join(60)
        evaluate.close()
        train.close()
    assert _home_step(url) == 3
    assert torch.load(local, weights_only=True)["step"] == 3
    if local_copy == "damaged download":
        assert "is corrupt" in str(got["error"]) and str(got["error"]).startswith("memory://")
    else:
        assert got["step"] == (2 if local_copy == "older" else 1)  # what the home held when the load read it
    assert not [n for n in os.listdir(os.path.dirname(local)) if is_tmp(n)]


def test_a_saves_rename_into_the_burst_buffer_holds_its_directory_shared(tmp_path) -> None:
    """The lock a prefetch compares and renames under (``storage.places.dir_lock``, exclusive) is
    held by a save's rename into the burst buffer, shared: the prefetch's comparison never has a
    save land between it and its rename, and saves never wait for one another."""
    seen: list[tuple[bool, bool]] = []
    nvme = tmp_path / "nvme"

    def probe(op: str, path: str) -> None:
        if op == "replace" and path.startswith(str(nvme)) and is_tmp(os.path.basename(path)):
            fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)  # as another process would
            try:
                seen.append((_can_flock(fd, fcntl.LOCK_SH), _can_flock(fd, fcntl.LOCK_EX)))
            finally:
                os.close(fd)

    with fastckpt.Checkpointer(local_dir=str(nvme), ops=FaultyOps(on_call=probe)) as ck:
        ck.save(_state(1), str(tmp_path / "home" / "last.ckpt")).wait()
    assert seen == [(True, False)]  # another save may rename beside it; a prefetch waits


def _can_flock(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True
