"""Retention's lists against real files: a name being saved again is never trimmed, and a group
that replication dropped counts once a later step beside it is durable."""

from __future__ import annotations

import errno
import logging
import os
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.commit.names import BURST_BUFFER_MARK
from fastckpt.errors import CheckpointWriteError
from fastckpt.save.failed import TRIM_TRIES
from fastckpt.save.restarts import delete_own_group_files
from fastckpt.save.retention import Retention
from fastckpt.save.stripes import Stripes
from fastckpt.storage.homes import Homes
from fastckpt.testing import Fault, FaultyOps
from fastckpt.urls import mirror_path


def test_a_name_being_saved_again_is_not_trimmed_until_that_save_is_durable(tmp_path: Path) -> None:
    home, nvme = tmp_path / "home", str(tmp_path / "nvme")
    names = [str(home / f"g{i}") for i in range(2)]
    for n in names:
        os.makedirs(n)
        os.makedirs(mirror_path(nvme, n))
    local = [Path(mirror_path(nvme, n)) for n in names]
    r = Retention(1, None, Homes(), Stripes((nvme,)).copies)
    r.durable(names[0], has_local=True, owns_persistent=True)
    r.replacing(names[0])  # a new attempt at g0 writes into its burst-buffer directory
    r.durable(names[1], has_local=True, owns_persistent=True)
    assert local[0].exists()  # before: trimmed here, under the save writing into it
    r.durable(names[0], has_local=True, owns_persistent=True)  # that save is durable: g0 is the newest
    assert local[0].exists() and not local[1].exists()



def _copies(tmp_path: Path, names: list[str], keep_local: int = 1) -> tuple[list[str], list[Path], Retention]:
    """Burst-buffer copies of ``names`` (files or group directories under home/), and their
    Retention."""
    home, nvme = tmp_path / "home", str(tmp_path / "nvme")
    paths = [str(home / n) for n in names]
    local = [Path(mirror_path(nvme, p)) for p in paths]
    with fastckpt.Checkpointer() as ck:  # rank 0's group file, with its manifest (a dropped group loses only those)
        for p in local:
            ck.save({"w": torch.zeros(4)}, str(p / "rank0.pt"), group=str(p)).wait()
    return paths, local, Retention(keep_local, None, Homes(), Stripes((nvme,)).copies)


def test_a_dropped_group_counts_once_a_later_step_beside_it_is_durable(tmp_path: Path) -> None:
    tags, local, r = _copies(tmp_path, ["run/global_step100", "run/global_step200", "run/global_step300"])
    tokens = [r.replacing(t) for t in tags]
    r.ended(tags[1], True, True, True, tokens[1], step=200)  # coalesced away by step 300
    r.ended(tags[0], False, True, True, tokens[0], step=100)
    assert local[1].exists()  # step 100 is older: step 200 is still the newest state on this node
    r.ended(tags[2], False, True, True, tokens[2], step=300)
    assert [p.exists() for p in local] == [False, False, True]


def test_a_dropped_group_counts_in_save_order(tmp_path: Path) -> None:
    tags, local, r = _copies(tmp_path, ["run/iter_1", "run/iter_2", "run/iter_3"], keep_local=2)
    tokens = [r.replacing(t) for t in tags]
    r.ended(tags[0], False, True, True, tokens[0], step=1)
    r.ended(tags[1], True, True, True, tokens[1], step=2)
    r.ended(tags[2], False, True, True, tokens[2], step=3)
    assert [p.exists() for p in local] == [False, True, True]  # the two newest saves stay


def test_the_lists_are_in_save_order_when_saves_become_durable_out_of_order(tmp_path: Path) -> None:
    """Two uploads at once: the older, larger save is verified last. It is the one trimmed, at
    home too: the newest save, which ``latest`` names, stays."""
    tags, local, _ = _copies(tmp_path, ["run/global_step1", "run/global_step2"])
    homes = [Path(t) for t in tags]
    for h in homes:
        h.mkdir(parents=True)
    r = Retention(1, 1, Homes(), Stripes((str(tmp_path / "nvme"),)).copies)
    tokens = [r.replacing(t) for t in tags]
    r.ended(tags[1], False, True, True, tokens[1], step=2)
    r.ended(tags[0], False, True, True, tokens[0], step=1)
    assert [p.exists() for p in local] == [False, True] and [h.exists() for h in homes] == [False, True]


def test_dropped_copies_that_no_later_series_replaces_stay(tmp_path: Path) -> None:
    """A dropped single file may be a checkpoint the user still names (a Lightning top-k file);
    a dropped group that does not move latest, or another directory's, or one of a later step
    than what became durable, is not replaced by it."""
    names = ["best.ckpt", "run/global_step200", "other/global_step100", "run/global_step400",
             "run/global_step300"]
    paths, local, r = _copies(tmp_path, names)
    tokens = [r.replacing(p) for p in paths]
    r.ended(paths[0], True, True, True, tokens[0])
    r.ended(paths[1], True, True, True, tokens[1])  # does not move latest: no step
    r.ended(paths[2], True, True, True, tokens[2], step=100)
    r.ended(paths[3], True, True, True, tokens[3], step=400)
    r.ended(paths[4], False, True, True, tokens[4], step=300)
    assert [p.exists() for p in local] == [True, True, True, True, True]


def test_an_older_save_of_a_name_that_ends_late_changes_nothing(tmp_path: Path) -> None:
    paths, local, r = _copies(tmp_path, ["g0", "g1"])
    old, g1 = r.replacing(paths[0]), r.replacing(paths[1])
    new = r.replacing(paths[0])  # a newer attempt at g0 writes into its burst-buffer copy
    r.ended(paths[0], False, True, True, old)
    r.ended(paths[1], False, True, True, g1)
    assert local[0].exists()  # before the tokens: listed by the older save and trimmed here
    r.ended(paths[0], False, True, True, new)
    assert local[0].exists() and not local[1].exists()


def test_a_save_of_the_name_that_begins_while_its_older_save_scans_the_burst_buffer_is_not_trimmed(
        tmp_path: Path) -> None:
    """The first durable save in a directory scans the burst buffer for what earlier runs left
    (a listing, and a manifest read per file at an S3 home: slow). A new save of the same name
    that began during that scan was not protected: the older save was listed after the scan and
    trimmed, with the copy the new save writes into."""
    paths, local, _ = _copies(tmp_path, ["a.pt", "b.pt"])
    for p in paths:
        Path(p).parent.mkdir(parents=True, exist_ok=True)
        Path(p).write_bytes(b"home copy")
    copies = Stripes((str(tmp_path / "nvme"),)).copies
    scanning, go = threading.Event(), threading.Event()

    def slow_copies(path: str) -> list[str]:
        if path == os.path.dirname(paths[0]) and not scanning.is_set():  # the scan of the directory
            scanning.set()
            assert go.wait(30)
        return copies(path)

    r = Retention(1, 1, Homes(), slow_copies)
    old, b = r.replacing(paths[0]), r.replacing(paths[1])
    ended = threading.Thread(target=r.ended, args=(paths[0], False, True, True, old))
    ended.start()
    assert scanning.wait(30)
    new = r.replacing(paths[0])  # the newest save of all begins: a.pt's, into local[0]
    r.ended(paths[1], False, True, True, b)
    go.set()
    ended.join(30)
    assert local[0].exists() and Path(paths[0]).exists()  # before: both deleted here
    r.ended(paths[0], False, True, True, new)  # the newest save of all: b.pt goes
    assert local[0].exists() and Path(paths[0]).exists() and not local[1].exists() and not Path(paths[1]).exists()


def test_a_commit_without_a_save_token_leaves_a_save_that_began_during_its_scan_protected(tmp_path: Path) -> None:
    """``durable(path, token=None)`` (a group commit of a rank with no save of it in flight) ends
    whatever save of path was in flight when it began, not one that began during its scan."""
    home = str(tmp_path / "home" / "last")
    os.makedirs(home)
    copies = Stripes((str(tmp_path / "nvme"),)).copies
    scanning, go = threading.Event(), threading.Event()

    def slow_copies(path: str) -> list[str]:
        if not scanning.is_set():
            scanning.set()
            assert go.wait(30)
        return copies(path)

    r = Retention(1, 1, Homes(), slow_copies)
    ended = threading.Thread(target=r.durable, args=(home, True, True, None, None))
    ended.start()
    assert scanning.wait(30)
    new = r.replacing(home)  # a new save of 'last' begins during the scan
    go.set()
    ended.join(30)
    assert r.saving(home) == new  # still protected from trims until it is durable


def test_a_trim_still_deleting_a_name_delays_a_new_save_of_it_and_never_deletes_that(tmp_path: Path,
                                                                                        monkeypatch) -> None:
    """keep_persistent=1, a.pt and b.pt saved in turn through a burst buffer. b's durability
    trims the old a.pt, and that deletion is slow (an object-store request retried). A new save
    of a.pt that began meanwhile became durable first, and the stale deletion then removed it:
    b.pt was trimmed for it, and the home held nothing. Now the new save waits for the deletion."""
    from fastckpt.save import retention

    entered, release, first = threading.Event(), threading.Event(), []
    trim = retention.Retention._trim_persistent

    def slow_trim(self, path: str) -> None:
        if not first:
            first.append(path)
            entered.set()
            assert release.wait(60)  # the new save of a.pt is durable (old code) or waits for this (new)
        trim(self, path)

    monkeypatch.setattr(retention.Retention, "_trim_persistent", slow_trim)
    home = tmp_path / "home"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), keep_persistent=1, overhead_budget=0.99) as ck:

        class Waits(threading.Condition):  # replacing() waiting for the deletion lets it go on
            def wait(self, timeout: float | None = None) -> bool:
                release.set()
                return super().wait(timeout)

        ck._retention._deleted = Waits(ck._retention._lock)  # noqa: SLF001
        ck.save({"w": torch.full((8,), 1.0)}, str(home / "a.pt")).wait()
        b = ck.save({"w": torch.full((8,), 2.0)}, str(home / "b.pt"))  # its durability trims a.pt: slowly
        assert entered.wait(60)
        ck.save({"w": torch.full((8,), 3.0)}, str(home / "a.pt")).wait()
        release.set()
        b.wait()
        ck.wait()
    assert first == [str(home / "a.pt")]
    assert sorted(os.listdir(home)) == ["a.pt"]  # before: [] (the new a.pt deleted by the stale trim)
    assert fastckpt.load(str(home / "a.pt"))["w"][0] == 3.0


def test_latest_lists_again_when_retention_deletes_the_checkpoint_it_listed(tmp_path: Path, monkeypatch) -> None:
    """Keep one: the scan lists a.pt only; before it reads a.pt, b.pt is saved and a.pt trimmed.
    The scan lists again instead of finding nothing (helper review D3)."""
    from fastckpt.storage.posix import PosixTarget
    from fastckpt.storage.types import Listing

    def save(name: str, v: int) -> None:
        with fastckpt.Checkpointer(rank=0, world_size=1) as ck:
            ck.save({"v": v}, str(tmp_path / name)).wait()

    save("a.pt", 1)
    (tmp_path / "latest").unlink(missing_ok=True)  # no pointer: the scan decides
    real, raced = PosixTarget.listing, threading.Event()  # the scan's listing (with the folders it passed over)

    def racing(self: PosixTarget, prefix: str = "", *, max_depth: int | None = None) -> Listing:
        keys = real(self, prefix, max_depth=max_depth)
        if not raced.is_set():  # between the listing and the reads: the next save, then the trim
            raced.set()
            save("b.pt", 2)
            (tmp_path / "latest").unlink(missing_ok=True)
            (tmp_path / "a.pt").unlink()
        return keys

    monkeypatch.setattr(PosixTarget, "listing", racing)
    assert fastckpt.latest(str(tmp_path)) == str(tmp_path / "b.pt")
    assert raced.is_set()


def test_an_export_is_never_counted_or_deleted_by_keep_persistent(tmp_path: Path) -> None:
    """A model export saved through the Checkpointer (DeepSpeed's save_16bit_model) counted as one
    of the keep_persistent checkpoints: it was deleted once enough later checkpoints were saved.
    Saved again as a checkpoint, the same path counts again."""
    home = tmp_path / "home"
    with fastckpt.Checkpointer(keep_persistent=1, overhead_budget=0.99) as ck:
        ck.save({"w": torch.ones(4)}, str(tmp_path / "export" / "model.bin"), export=True).wait()
        for step in (1, 2, 3):
            ck.save({"w": torch.full((4,), float(step))}, str(home / f"step{step}.pt")).wait()
        ck.wait()
        assert (tmp_path / "export" / "model.bin").is_file()
        assert sorted(os.listdir(home)) == ["step3.pt"]
        ck.save({"w": torch.ones(4)}, str(tmp_path / "export" / "model.bin")).wait()  # a checkpoint now
        ck.save({"w": torch.ones(4)}, str(home / "step4.pt")).wait()
        ck.wait()
    assert not (tmp_path / "export" / "model.bin").exists() and sorted(os.listdir(home)) == ["step4.pt"]


def test_an_export_stays_one_when_a_later_save_of_its_path_fails_at_once(tmp_path: Path) -> None:
    """The export mark was per path: a later save of the same path that raised before it began
    cleared it while the export was still replicating, and keep_persistent deleted the export."""
    home = tmp_path / "home"
    with fastckpt.Checkpointer(keep_persistent=1, local_dir=str(tmp_path / "nvme"), overhead_budget=0.99) as ck:
        export = ck.save({"w": torch.ones(1 << 16)}, str(home / "model.pt"), export=True)
        try:
            ck.save({"w": lambda: 0}, str(home / "model.pt"))  # not picklable: refused at the call
        except fastckpt.UnsupportedObjectError:
            pass
        export.wait()
        for step in (1, 2):
            ck.save({"w": torch.ones(4)}, str(home / f"step{step}.pt")).wait()
        ck.wait()
    assert sorted(os.listdir(home)) == ["model.pt", "step2.pt"]


def test_an_unpublished_group_copy_loses_only_the_files_saved_as_that_groups(tmp_path: Path) -> None:
    """A single file saved into a numbered directory (``step3/model.pt``) may be the only copy of
    its save: removing this rank's files of the group ``step3`` leaves it."""
    nvme, group = str(tmp_path / "nvme"), str(tmp_path / "home" / "step3")
    local = Path(mirror_path(nvme, group))
    with fastckpt.Checkpointer() as ck:
        for rel in ("r0.pt", "sub/r0.pt"):
            ck.save({"w": torch.zeros(4)}, str(local / rel), group=str(local)).wait()
        ck.save({"w": torch.zeros(4)}, str(local / "model.pt")).wait()
    delete_own_group_files(Homes(), Stripes((nvme,)).copies, group, rank=0)
    assert sorted(os.listdir(local)) == ["model.pt"]


@pytest.mark.parametrize("fails", [1, TRIM_TRIES])
def test_a_keep_persistent_deletion_that_fails_is_tried_again_at_the_next_trims(tmp_path: Path, caplog,
                                                                                 fails: int) -> None:
    """The name left the persistent list before it was deleted: one EIO (an object store down past
    retry_deadline_s) and no later trim tried again, so the home kept s1.pt for good. Now it is
    listed again, the oldest, each failure a WARNING, up to TRIM_TRIES tries."""
    home = tmp_path / "home"
    ops = FaultyOps([Fault("unlink", errno.EIO, nth=n, path_contains=str(home / "s1.pt")) for n in range(1, fails + 1)])
    with caplog.at_level(logging.WARNING, logger="fastckpt"), \
            fastckpt.Checkpointer(keep_persistent=1, ops=ops, rank=0, world_size=1, overhead_budget=0.99) as ck:
        for s in range(1, 7):
            ck.save({"w": torch.full((8,), float(s))}, str(home / f"s{s}.pt")).wait()
    ops.assert_all_reached()
    said = [r.getMessage() for r in caplog.records if "could not remove the persistent copy" in r.getMessage()]
    assert len(said) == fails and all(str(home / "s1.pt") in m for m in said)
    if fails < TRIM_TRIES:
        assert sorted(os.listdir(home)) == ["s6.pt"]  # was: s1.pt too
        assert "the next trim tries again (1 of 3)" in said[0]
    else:  # bounded: left to the user, and said so
        assert "gave up after 3 tries" in said[-1] and sorted(os.listdir(home)) == ["s1.pt", "s6.pt"]


def _hold_first_upload(local: str) -> tuple[FaultyOps, threading.Event, threading.Event, threading.Event]:
    """FaultyOps that hold the first upload of the burst-buffer file ``local`` as it opens it, until
    ``release``; ``entered`` says it is held, ``unlinked`` that ``local`` was deleted."""
    release, entered, unlinked = threading.Event(), threading.Event(), threading.Event()

    def on_call(op: str, path: str) -> None:
        if op == "open" and path == local and threading.current_thread().name.startswith("fastckpt-replicate") \
                and not entered.is_set():
            entered.set()
            assert release.wait(60), "the test never released the upload"
        if op == "unlink" and path == local:
            unlinked.set()

    return FaultyOps(on_call=on_call), release, entered, unlinked


def _fail_attempt(ck: fastckpt.Checkpointer, ops: FaultyOps, g: str, step: int, how: str) -> None:
    """This rank's attempt at group ``g`` fails ``how``, while its model.pt's upload may still run:
    "at_once" (commit() raises the background ENOSPC of optim.pt's write), "in_commit" (that failure,
    seen already, fails the commit's future) or "unsaved" (optim.pt was never saved: commit() refuses)."""
    if how == "in_commit":  # optim.pt first: the commit raises it before it waits for model.pt
        ops.inject(Fault("pwrite", errno.ENOSPC, path_contains=f"global_step{step}/optim.pt"))
        with pytest.raises(CheckpointWriteError):
            ck.save({"o": torch.full((8,), float(step))}, f"{g}/optim.pt", group=g).wait()
    ck.save({"w": torch.full((8,), float(step))}, f"{g}/model.pt", group=g)
    if how == "at_once":
        ops.inject(Fault("pwrite", errno.ENOSPC, path_contains=f"global_step{step}/optim.pt"))
        with pytest.raises(CheckpointWriteError):  # result(): waited for, still unseen
            ck.save({"o": torch.full((8,), float(step))}, f"{g}/optim.pt", group=g).result()
    elif how == "unsaved":
        ck.unsaved(f"{g}/optim.pt", g, OSError(errno.EIO, "the framework could not copy it"))
    with pytest.raises(CheckpointWriteError):
        ck.commit(g, step=step).wait(30)


@pytest.mark.parametrize("how", ["at_once", "in_commit", "unsaved"])
def test_a_failed_groups_files_go_once_its_last_upload_ends(tmp_path: Path, how: str) -> None:
    """Step 2's attempt fails while the upload of its model.pt is held. Step 3 beside it is durable:
    model.pt stays while its upload reads it (3f8e59a deleted it then: the upload failed, and sank
    a later commit); once that upload ends, it goes (before: it stayed until the job restarted)."""
    home, nvme = tmp_path / "home", str(tmp_path / "nvme")
    g2 = str(home / "global_step2")
    ops, release, entered, unlinked = _hold_first_upload(mirror_path(nvme, f"{g2}/model.pt"))
    with fastckpt.Checkpointer(local_dir=nvme, keep_local=2, ops=ops, rank=0, world_size=1,
                               overhead_budget=0.99) as ck:
        for step in (1, 2, 3, 4):
            g = str(home / f"global_step{step}")
            if step == 2:
                _fail_attempt(ck, ops, g, step, how)
                assert entered.wait(30), "the upload of step 2's model.pt was not held"
                continue
            ck.save({"w": torch.full((8,), float(step))}, f"{g}/model.pt", group=g)
            ck.save({"o": torch.full((8,), float(step))}, f"{g}/optim.pt", group=g)
            ck.commit(g, step=step).wait(30)
            if step == 3:  # durable beside it, but step 2's upload still reads its model.pt
                assert Path(mirror_path(nvme, f"{g2}/model.pt")).is_file()
                assert not unlinked.is_set()
                release.set()
                assert unlinked.wait(30), "step 2's model.pt never left the burst buffer"
        ck.wait()
        assert ck.stats().replication_failures == 0
    assert fastckpt.latest(str(home)) == str(home / "global_step4")
    bb = Path(mirror_path(nvme, str(home)))
    assert sorted(str(p.relative_to(bb)) for p in bb.rglob("*.pt")) == \
        [f"global_step{s}/{f}" for s in (3, 4) for f in ("model.pt", "optim.pt")]


def test_a_failed_group_saved_again_keeps_the_new_saves_files(tmp_path: Path) -> None:
    """Step 2 fails, and is saved again under the same name while step 3 becomes durable: the
    files of that new save are never the failed attempt's to delete, however it ends."""
    home, nvme = tmp_path / "home", str(tmp_path / "nvme")
    ops = FaultyOps()
    with fastckpt.Checkpointer(local_dir=nvme, keep_local=3, ops=ops, rank=0, world_size=1,
                               overhead_budget=0.99) as ck:
        g2, g3 = str(home / "global_step2"), str(home / "global_step3")
        _fail_attempt(ck, ops, g2, 2, "at_once")
        ck.wait()  # every upload of the failed attempt ended: only a later durable step is awaited
        for f in ("model.pt", "optim.pt"):  # the new attempt, committed after step 3
            ck.save({f: torch.full((8,), 20.0)}, f"{g2}/{f}", group=g2)
        for f in ("model.pt", "optim.pt"):
            ck.save({f: torch.full((8,), 3.0)}, f"{g3}/{f}", group=g3)
        ck.commit(g3, step=3).wait(30)
        assert sorted(p.name for p in Path(mirror_path(nvme, g2)).glob("*.pt")) == ["model.pt", "optim.pt"]
        ck.commit(g2, step=2).wait(30)
        ck.save({"w": torch.full((8,), 4.0)}, str(home / "global_step4" / "model.pt"), group=str(home / "global_step4"))
        ck.commit(str(home / "global_step4"), step=4).wait(30)
        assert ck.load(f"{g2}/model.pt")["model.pt"][0].item() == 20.0
        assert ck.local_path(f"{g2}/model.pt") is not None and Path(ck.local_path(f"{g2}/model.pt")).is_file()


def test_a_failed_group_waits_for_its_queued_upload(tmp_path: Path) -> None:
    """Retention alone: the failed group's file has an upload still queued (a Future not done): a
    later durable step beside it deletes nothing; the upload's end does."""
    tags, local, _ = _copies(tmp_path, ["run/global_step1", "run/global_step2"], keep_local=2)
    queued: Future = Future()
    r = Retention(2, None, Homes(), Stripes((str(tmp_path / "nvme"),)).copies,
                  in_flight=lambda g: [queued] if g == tags[0] else [])
    r.replacing(tags[0])
    with pytest.raises(CheckpointWriteError), r.failing(tags[0], 1):
        raise CheckpointWriteError(f"{tags[0]}: a file of it was not saved")
    r.ended(tags[1], False, True, True, r.committing(tags[1]), step=2)
    assert local[0].exists()  # its upload has not even started
    queued.set_result(None)
    assert not local[0].exists() and local[1].exists()


@pytest.mark.parametrize("fails", [1, TRIM_TRIES])
def test_a_keep_local_deletion_that_fails_is_tried_again_at_the_next_trims(tmp_path: Path, caplog, fails: int) -> None:
    """A burst-buffer copy whose deletion failed once (EPERM: an immutable file, a drive remounted
    read-only for a moment) stayed on the NVMe for the rest of the run beside the keep_local newest.
    Now it is listed again, the oldest, each failure a WARNING saying so, up to TRIM_TRIES tries."""
    home, nvme = tmp_path / "home", str(tmp_path / "nvme")
    ops = FaultyOps()
    with caplog.at_level(logging.WARNING, logger="fastckpt"), \
            fastckpt.Checkpointer(local_dir=nvme, keep_local=1, ops=ops, overhead_budget=0.99) as ck:
        first = ck.local_path(str(home / "s1.pt"))
        ops.inject(*[Fault("unlink", errno.EPERM, nth=n, path_contains=first) for n in range(1, fails + 1)])
        for s in range(1, 7):
            ck.save({"w": torch.full((8,), float(s))}, str(home / f"s{s}.pt")).wait()
    ops.assert_all_reached()
    said = [r.getMessage() for r in caplog.records if "could not remove the burst-buffer copy" in r.getMessage()]
    assert len(said) == fails and all(str(home / "s1.pt") in m for m in said)
    assert "immutable" in said[0]  # EPERM: not only "fix the directory's owner/mode"
    left = sorted(os.path.relpath(os.path.join(d, f), nvme) for d, _, fs in os.walk(nvme) for f in fs
                  if f != BURST_BUFFER_MARK)
    if fails < TRIM_TRIES:
        assert "the next trim tries again (1 of 3)" in said[0] and not os.path.exists(first)
        assert [os.path.basename(f) for f in left] == ["s6.pt"]  # was: s1.pt too, for the rest of the run
    else:  # bounded: left to the user, and said so
        assert "gave up after 3 tries: it stays in the burst buffer" in said[-1] and os.path.exists(first)
        assert sorted(os.path.basename(f) for f in left) == ["s1.pt", "s6.pt"]
    assert sorted(os.listdir(home)) == [f"s{s}.pt" for s in range(1, 7)]  # the home keeps every one
