"""``replicate_in_order=True``: a single file becomes final at its path only after every single
file saved before it is final, or failed, or was cancelled (``save.ordering``).

Lightning reads "the newest" by mtime (``ckpt_path="last"``) and trusts ``last.ckpt``'s
``best_model_path``; with ``replicate_workers`` > 1, or a later save's local write ending first
on another drive, a later file landed first. The earlier file's copy or local write is held by a
FaultyOps hook; the later one's "queued" event says it waits, and every call on its home copy
checks that the earlier file is already final: no timing.

A later file written straight to its path (a full burst buffer, or ENOSPC there mid-write) took
no place in that order and landed first; now its writer waits for its turn before the rename.
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
import threading
import time

import pytest
import torch

import fastckpt
from fastckpt.config import CheckpointerConfig
from fastckpt.errors import ConfigError, ReplicationError
from fastckpt.io.atomic import final_path
from fastckpt.save.ordering import CallOrder
from fastckpt.testing import Fault, FaultyOps
from tests.helpers import coarse_ext4, tmpfs


def _state(step: int) -> dict:
    return {"w": torch.full((1 << 14,), step, dtype=torch.int32), "step": step}


class Hook:
    """FaultyOps ``on_call``: holds the call ``op`` on ``held`` (a final path, or its temp name)
    under ``where`` until ``release``, then raises ``fail`` if set; records, for every call on
    the home copy of ``later``, whether ``earlier`` was final at its path then."""

    def __init__(self, op: str, where: str, held: str, earlier: str, later: str) -> None:
        self.op, self.where, self.held, self.earlier, self.later = op, where, held, earlier, later
        self.entered, self.release = threading.Event(), threading.Event()
        self.fail: OSError | None = None
        self.earlier_final_at_later_calls: list[bool] = []

    def __call__(self, op: str, path: str) -> None:
        p = final_path(path) or path
        if p == self.later:
            self.earlier_final_at_later_calls.append(os.path.exists(self.earlier))
        if op == self.op and path.startswith(self.where) and os.path.basename(p) == os.path.basename(self.held) \
                and not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(60)
            if self.fail is not None:
                raise self.fail


class Queued:
    """An EventSink: the detail of the "queued" event of ``path``."""

    def __init__(self, path: str) -> None:
        self.path, self.event, self.detail = path, threading.Event(), ""

    def emit(self, ev) -> None:  # noqa: ANN001
        if ev.name == "queued" and ev.path == self.path:
            self.detail = ev.detail or ""
            self.event.set()


def _checkpointer(tmp_path, local, hook: Hook, queued: Queued, **kw) -> fastckpt.Checkpointer:  # noqa: ANN001
    return fastckpt.Checkpointer(local_dir=local, ops=FaultyOps(on_call=hook), replicate_policy="all",
                                 replicate_in_order=True, sinks=(queued,), staging_buffers=2, rank=0, world_size=1,
                                 **kw)


def _both_final_in_order(ck: fastckpt.Checkpointer, hook: Hook, ha: object, hb: object) -> None:
    """Both saves durable, and at every call on the later file's home copy the earlier was final."""
    assert ha.wait(60).durable_s is not None and hb.wait(60).durable_s is not None
    ck.close()
    assert hook.earlier_final_at_later_calls and all(hook.earlier_final_at_later_calls)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_later_file_is_final_only_after_the_earlier_ones_copy(tmp_path, workers) -> None:  # noqa: ANN001
    home = str(tmp_path / "home")
    a, b = f"{home}/step=4.ckpt", f"{home}/last.ckpt"
    hook, queued = Hook("replace", home, a, a, b), Queued(b)  # a's rename at its home is held
    ck = _checkpointer(tmp_path, str(tmp_path / "nvme"), hook, queued, replicate_workers=workers)
    try:
        ha = ck.save(_state(4), a)
        assert hook.entered.wait(60)
        hb = ck.save(_state(4), b)
        assert queued.event.wait(60)
        assert "behind=earlier saves" in queued.detail  # was: copied beside a (workers=2) and final first
        assert not hb.done() and not os.path.exists(b)
    finally:
        hook.release.set()
    _both_final_in_order(ck, hook, ha, hb)
    assert torch.load(b, weights_only=True)["step"] == 4


def test_an_earlier_local_write_on_another_drive_holds_the_later_replica(tmp_path) -> None:  # noqa: ANN001
    """Striped burst buffer: the later save's local write, on the other drive, ends first. The
    earlier save, not yet handed to the replicator, counts as outstanding."""
    home, dirs = str(tmp_path / "home"), [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    a, b = f"{home}/step=1.ckpt", f"{home}/last.ckpt"
    hook, queued = Hook("fsync", str(tmp_path / "nvme"), a, a, b), Queued(b)  # a's local write is held
    ck = _checkpointer(tmp_path, dirs, hook, queued)
    try:
        ha = ck.save(_state(1), a)
        assert hook.entered.wait(60)
        hb = ck.save(_state(1), b)
        assert queued.event.wait(60)  # its local write ended: on the other drive
        assert "behind=earlier saves" in queued.detail
        assert not hb.done() and not os.path.exists(b)
    finally:
        hook.release.set()
    _both_final_in_order(ck, hook, ha, hb)


def test_a_failed_earlier_save_lets_the_later_one_go(tmp_path) -> None:  # noqa: ANN001
    home, dirs = str(tmp_path / "home"), [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    a, b = f"{home}/step=1.ckpt", f"{home}/last.ckpt"
    hook, queued = Hook("fsync", str(tmp_path / "nvme"), a, a, b), Queued(b)
    hook.fail = OSError(errno.EIO, "injected: the drive failed")  # a's local write fails once released
    ck = _checkpointer(tmp_path, dirs, hook, queued)
    try:
        ha = ck.save(_state(1), a)
        assert hook.entered.wait(60)
        hb = ck.save(_state(1), b)
        assert queued.event.wait(60) and "behind=earlier saves" in queued.detail
    finally:
        hook.release.set()
    with pytest.raises(OSError):  # a CheckpointWriteError naming the drive
        ha.wait(60)
    assert hb.wait(60).durable_s is not None  # released by a's failure: no worker waits for ever
    ck.close()
    assert not os.path.exists(a) and torch.load(b, weights_only=True)["step"] == 1


def test_close_that_gives_up_resolves_a_held_later_save(tmp_path) -> None:  # noqa: ANN001
    """close() past close_timeout_s while the earlier local write is held: the later save,
    queued behind it, resolves as not replicated, and close() returns (no worker waits on it)."""
    home, dirs = str(tmp_path / "home"), [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    a, b = f"{home}/step=1.ckpt", f"{home}/last.ckpt"
    hook, queued = Hook("fsync", str(tmp_path / "nvme"), a, a, b), Queued(b)
    ck = _checkpointer(tmp_path, dirs, hook, queued, close_timeout_s=0.1)
    try:
        ha = ck.save(_state(1), a)
        assert hook.entered.wait(60)
        hb = ck.save(_state(1), b)
        assert queued.event.wait(60) and "behind=earlier saves" in queued.detail
        with pytest.raises(ReplicationError, match="still pending"):  # close() gave up on them
            ck.close()
        with pytest.raises(ReplicationError):
            hb.wait(60)
    finally:
        hook.release.set()
    with pytest.raises(OSError):  # its write ended after close(): nothing replicates it
        ha.wait(60)
    assert not os.path.exists(b)


@pytest.mark.parametrize("earlier_fails", [False, True])
@pytest.mark.parametrize("how", ["full", "enospc"])
def test_a_file_written_straight_to_its_path_waits_for_the_earlier_ones(tmp_path, monkeypatch, how,
                                                                        earlier_fails) -> None:  # noqa: ANN001
    """The later file skips the burst buffer ("full": a 4 MiB tmpfs with no room for it;
    "enospc": its local write runs out of space and falls back to its path) while the earlier
    file's rename at its home is held. Its rename waits until the earlier one is final (or
    failed: a failed earlier save holds nothing back). Released once the later write either
    waits for its turn (``CallOrder.wait``) or renames (the old code): no timing."""
    home, nvme = str(tmp_path / "home"), tmp_path / "nvme"
    a, b = f"{home}/step=4.ckpt", f"{home}/last.ckpt"
    hook = Hook("replace", home, a, a, "")  # a's rename at its home is held
    hook.fail = OSError(errno.EIO, "injected: the home refused the rename") if earlier_fails else None
    b_at_turn, wait, a_final_at_b_rename = threading.Event(), getattr(CallOrder, "wait", None), []

    def waiting(self, key) -> None:  # noqa: ANN001
        b_at_turn.set()
        wait(self, key)

    def on_call(op: str, path: str) -> None:
        if op == "replace" and (final_path(path) or path) == b:  # b becomes final (the old code: at once)
            a_final_at_b_rename.append(os.path.exists(a))
            b_at_turn.set()
        hook(op, path)

    monkeypatch.setattr(CallOrder, "wait", waiting, raising=False)
    with (tmpfs(nvme, "size=4m") if how == "full" else _made(nvme)) as local:
        faults = [Fault("pwrite", errno.ENOSPC, path_startswith=str(local), path_contains="last.ckpt")] \
            if how == "enospc" else []
        ck = fastckpt.Checkpointer(local_dir=str(local), ops=FaultyOps(faults, on_call=on_call),
                                   replicate_policy="all", replicate_in_order=True, rank=0, world_size=1)
        try:
            ha = ck.save(_state(4), a)
            assert hook.entered.wait(60)
            hb = ck.save({"w": torch.zeros(1 << 20 if how == "full" else 1 << 14)}, b)  # full: 4 MiB
            assert b_at_turn.wait(60)
            assert not hb.done() and not os.path.exists(b)  # was: final before a
        finally:
            hook.release.set()
        if earlier_fails:
            with pytest.raises(OSError):
                ha.wait(60)
        else:
            assert ha.wait(60).tier == "nvme"
        assert hb.wait(60).tier == "direct" and hb.wait().durable_s is not None
        ck.close()
    assert a_final_at_b_rename == [not earlier_fails]  # a failed: b went on without it
    assert os.path.exists(a) != earlier_fails and os.path.exists(b)


def test_a_file_written_straight_to_its_path_is_newer_by_mtime_than_the_earlier_ones(tmp_path) -> None:  # noqa: ANN001
    """The later file runs out of room in the burst buffer and is written to its path at once,
    while the earlier file's upload is held; its bytes are then dated an hour back (a real upload
    takes minutes: no sleep). It kept that mtime once final, older than the earlier file's replica,
    so a reader taking the newest file by mtime (Lightning's ``ckpt_path="last"``) resumed from the
    earlier save. Now its mtime is set as its turn comes, before the rename."""
    home, nvme = str(tmp_path / "home"), str(tmp_path / "nvme")
    a, b = f"{home}/step=4.ckpt", f"{home}/step=8.ckpt"
    hook, b_written = Hook("pwrite", home, a, a, ""), threading.Event()  # a's upload to its home is held

    def on_call(op: str, path: str) -> None:
        if op == "fsync" and path.startswith(home) and final_path(path) == b:  # b's bytes are at its path
            hour_ago = time.time_ns() - 3600 * 10**9
            os.utime(path, ns=(hour_ago, hour_ago))
            b_written.set()
        hook(op, path)

    ck = fastckpt.Checkpointer(local_dir=nvme, ops=FaultyOps([Fault("pwrite", errno.ENOSPC, path_startswith=nvme,
                                                                    path_contains="step=8")], on_call=on_call),
                               replicate_policy="all", replicate_in_order=True, rank=0, world_size=1)
    try:
        ha = ck.save(_state(4), a)
        assert hook.entered.wait(60)
        hb = ck.save(_state(8), b)
        assert b_written.wait(60)
    finally:
        hook.release.set()
    assert ha.wait(60).tier == "nvme" and hb.wait(60).tier == "direct"
    ck.close()
    assert os.stat(b).st_mtime_ns > os.stat(a).st_mtime_ns  # was: an hour older


class _made:
    """A plain directory as the burst buffer (``tmpfs``'s shape)."""

    def __init__(self, path) -> None:  # noqa: ANN001
        self.path = path

    def __enter__(self):  # noqa: ANN204
        self.path.mkdir(parents=True, exist_ok=True)
        return self.path

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        return None


def test_the_core_default_keeps_replicating_in_parallel() -> None:
    assert CheckpointerConfig().replicate_in_order is False
    with pytest.raises(ConfigError, match="replicate_in_order"):
        CheckpointerConfig(replicate_in_order="yes")


@pytest.mark.parametrize("local", [False, True], ids=["direct", "burst-buffer"])
def test_files_saved_back_to_back_are_strictly_ordered_by_mtime(tmp_path, local) -> None:  # noqa: ANN001
    """Tiny files saved one after another, in two folders (two ``ModelCheckpoint``s): at their
    paths their mtimes follow the calls strictly, in nanoseconds and in the float seconds rounded
    to microseconds that Lightning's ``ckpt_path="last"`` compares. Was: the kernel dated each by
    its coarse clock (the last write of the file or its copy), and files made final within one
    tick had the same mtime, so a reader taking the newest picked either."""
    home = tmp_path / "home"
    paths = [str(home / f"cb{i % 2}" / f"step={i}.ckpt") for i in range(40)]
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme") if local else None, replicate_policy="all",
                               replicate_in_order=True, rank=0, world_size=1) as ck:
        handles = [ck.save({"step": torch.tensor(i)}, p) for i, p in enumerate(paths)]
        assert all(h.wait(60).durable_s is not None for h in handles)
    stats = [os.stat(p) for p in paths]
    ns = [st.st_mtime_ns for st in stats]
    assert all(a < b for a, b in zip(ns, ns[1:])), ns
    seen = [datetime.datetime.fromtimestamp(st.st_mtime, tz=datetime.UTC) for st in stats]  # as fsspec's modified()
    assert all(a < b for a, b in zip(seen, seen[1:])), seen


@pytest.mark.parametrize("local", [False, True], ids=["direct", "burst-buffer"])
def test_a_file_whose_mtime_cannot_be_set_still_lands_with_a_warning(tmp_path, caplog, local) -> None:  # noqa: ANN001
    home = str(tmp_path / "home")
    path = f"{home}/last.ckpt"
    ops = FaultyOps([Fault("utime", errno.EPERM, path_startswith=home)])
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme") if local else None, ops=ops, replicate_policy="all",
                               replicate_in_order=True, rank=0, world_size=1) as ck:
        assert ck.save(_state(3), path).wait(60).durable_s is not None
    ops.assert_all_reached()
    assert torch.load(path, weights_only=True)["step"] == 3
    assert f"could not set the modification time of {path}" in caplog.text


@pytest.mark.parametrize("local", [False, True], ids=["direct", "burst-buffer"])
def test_a_home_that_refuses_every_utime_warns_once(tmp_path, caplog, local) -> None:  # noqa: ANN001
    """A home that refuses to set times (a FUSE/NFS/SMB mount) refuses it for every file: each file
    of each save logged its own WARNING. Now the first one warns (for this Checkpointer and file
    system) and the others go to DEBUG; every file still lands."""
    home = str(tmp_path / "home")
    paths = [f"{home}/step{step}/shard{shard}.pt" for step in range(3) for shard in range(2)]
    ops = FaultyOps([Fault("utime", errno.EPERM, nth=k, path_startswith=home) for k in range(1, len(paths) + 1)])
    caplog.set_level(logging.DEBUG, logger="fastckpt")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme") if local else None, ops=ops, replicate_policy="all",
                               rank=0, world_size=1) as ck:
        for i, p in enumerate(paths):
            assert ck.save(_state(i), p).wait(60).durable_s is not None
    ops.assert_all_reached()
    told = [r for r in caplog.records if "could not set the modification time" in r.getMessage()]
    assert [r.levelno for r in told] == [logging.WARNING] + [logging.DEBUG] * (len(paths) - 1)
    assert "said once per file system" in told[0].getMessage()
    assert [torch.load(p, weights_only=True)["step"] for p in paths] == list(range(len(paths)))


@pytest.mark.parametrize("local", [False, True], ids=["direct", "burst-buffer"])
def test_a_file_system_with_coarse_timestamps_is_told_to_order_by_latest(tmp_path, caplog, local) -> None:  # noqa: ANN001
    """On ext4 with 128-byte inodes (timestamps in seconds; likewise FAT, NFS servers and FUSE
    mounts that keep seconds) two last.ckpt files saved back to back tie by mtime, and nothing
    said so while the docs promised strict order. Now a WARNING says, once, that this file system
    cannot order files by mtime and to resume from fastckpt.latest() or the newest step."""
    with coarse_ext4(tmp_path / "ext4") as mnt:
        paths = [str(mnt / "run" / "a" / "last.ckpt"), str(mnt / "run" / "b" / "last.ckpt")]
        with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme") if local else None, replicate_in_order=True,
                                   rank=0, world_size=1) as ck:
            for step, p in enumerate(paths):
                assert ck.save(_state(step), p).wait(60).durable_s is not None
        assert all(os.stat(p).st_mtime_ns % 1_000_000_000 == 0 for p in paths)  # whole seconds: they may tie
        told = [r for r in caplog.records if "keeps coarse modification times" in r.getMessage()]
        assert [r.levelno for r in told] == [logging.WARNING]
        assert f"the file system of {paths[0]} keeps coarse modification times" in told[0].getMessage()
        assert "resume from fastckpt.latest(" in told[0].getMessage()
        assert [torch.load(p, weights_only=True)["step"] for p in paths] == [0, 1]
