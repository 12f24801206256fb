"""commit/discovery: a checkpoint ``latest`` cannot read is no reason to name an older one.

``latest`` (and ``ls``, ``verify --latest``) passed over a newer file it could not read (EACCES:
a job restarted under another account, a root-owned copy; EIO) and named the older checkpoint: a
resume silently went back in time. Only a file gone since the listing (a race with retention) is
passed over; any other error is raised, naming the path and the fix, as an unreadable group
manifest already was. A folder that cannot be listed is raised when it may hold a checkpoint (named like one, not
hidden, not inside a checkpoint: ``commit.discovery_unlisted``), else passed over (as ``os.walk``).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.commit import discovery
from fastckpt.storage.homes import Homes
from fastckpt.testing import Fault, FaultyOps


def _save(root: Path, *steps: int, group: bool = False) -> None:
    with fastckpt.Checkpointer() as ck:
        for step in steps:
            if group:
                g = str(root / f"step-{step}")
                ck.save({"w": torch.full((3,), float(step))}, f"{g}/m.pt", group=g)
                ck.commit(g, step=step).wait(60)
            else:
                ck.save({"w": torch.full((3,), float(step))}, str(root / f"step-{step}.pt")).wait()


def test_a_newest_file_that_cannot_be_read_is_raised_not_passed_over(tmp_path: Path) -> None:
    _save(tmp_path, 1, 2)
    ops = FaultyOps([Fault("open", errno.EACCES, path_contains="step-2.pt")])
    with pytest.raises(PermissionError) as err:
        discovery.latest(Homes(ops=ops), str(tmp_path))
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert f"{tmp_path}/step-2.pt cannot be read" in notes and "owner/mode" in notes
    assert discovery.latest(Homes(), str(tmp_path)) == str(tmp_path / "step-2.pt")


def _unlistable(monkeypatch, *dirs: Path) -> None:
    """``os.scandir`` is no ``FileOps`` call, so what mode 700 of another owner gives a non-root
    reader is injected at it for ``dirs``; every other directory is listed for real."""
    real = os.scandir

    def scandir(d: str = "."):  # noqa: ANN202 (os.scandir's iterator)
        if os.fspath(d) in {str(x) for x in dirs}:
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(d))
        return real(d)

    monkeypatch.setattr(os, "scandir", scandir)


def test_a_folder_that_cannot_be_listed_beside_the_checkpoints_is_passed_over(tmp_path: Path, monkeypatch) -> None:
    """A root-owned ``.Trash-0``, another user's folder beside the run, a folder inside a tag: a
    folder that cannot be listed is passed over, as ``os.walk`` does (raising there broke
    ``latest`` over a run folder holding a hidden folder, ``latest`` of a file beside another
    user's run folder, DeepSpeed's loads and the burst buffer's restart scan:
    ``d3_hidden_unreadable_dir_breaks_latest``, ``d3_latest_of_file_fails_on_unreadable_sibling_dir``,
    ``d3_keep_local_restart_scan_fails_on_unreadable_dir``)."""
    _save(tmp_path, 1, 2, group=True)
    (tmp_path / "latest").unlink()  # the scan, not the pointer, finds the newest
    for d in (".Trash-0", "bob-run", "step-2/tb_logs"):
        (tmp_path / d).mkdir()
    _unlistable(monkeypatch, tmp_path / ".Trash-0", tmp_path / "bob-run", tmp_path / "step-2" / "tb_logs")
    assert fastckpt.latest(str(tmp_path)) == str(tmp_path / "step-2")


def test_a_folder_named_like_a_checkpoint_that_cannot_be_listed_is_raised(tmp_path: Path) -> None:
    """A step folder, a Lightning ``*.ckpt`` folder or the scanned folder itself that cannot be
    listed may hold the newest checkpoint: raised, naming it and the fix (through the ``FileOps``
    seam: ``scandir``), not passed over for ``step-1``."""
    _save(tmp_path, 1, 2, group=True)
    (tmp_path / "latest").unlink()
    (tmp_path / "epoch=3-step=9.ckpt").mkdir()
    for where in ("step-2", "epoch=3-step=9.ckpt", ""):
        folder = tmp_path / where if where else tmp_path
        ops = FaultyOps([Fault("scandir", errno.EACCES, path_contains=str(folder))])
        with pytest.raises(PermissionError) as err:
            discovery.latest(Homes(ops=ops), str(tmp_path))
        ops.assert_all_reached()
        notes = "\n".join(err.value.__notes__)
        assert f"{folder} cannot be listed, and it may hold the newest checkpoint" in notes and "owner/mode" in notes
    assert discovery.latest(Homes(), str(tmp_path)) == str(tmp_path / "step-2")
    _save(tmp_path, 3)  # latest() of a file: only that file counts, not the step folder beside it
    ops = FaultyOps([Fault("scandir", errno.EACCES, path_contains=str(tmp_path / "step-2"))])
    assert discovery.latest(Homes(ops=ops), str(tmp_path / "step-3.pt")) == str(tmp_path / "step-3.pt")
    ops.assert_all_reached()


def test_a_folder_deleted_under_the_scan_on_nfs_is_gone_and_listed_again(tmp_path: Path) -> None:
    """NFS answers ESTALE for a folder deleted while it is listed (a job's retention removing the
    oldest group), as for a file: gone since the listing, so the scan lists again
    (``d3_scan_estale_dir_raises``), never raised with a chmod fix. A stale answer for the newest
    folder, listed again, still names it: no resume goes back in time."""
    _save(tmp_path, 1, 2, group=True)
    (tmp_path / "latest").unlink()  # the scan, not the pointer, finds the newest
    for where in ("step-1", "step-2"):
        ops = FaultyOps([Fault("scandir", errno.ESTALE, path_contains=str(tmp_path / where))])
        assert discovery.latest(Homes(ops=ops), str(tmp_path)) == str(tmp_path / "step-2")
        ops.assert_all_reached()


def test_a_folder_that_stays_stale_is_raised_on_the_last_listing(tmp_path: Path) -> None:
    """A stale NFS handle that persists (a server failover) answered ESTALE on every listing:
    counted as gone each time, the newest group was passed over and latest() named an older one
    (``d6_estale_folder_persistent_names_older``). On the scan's last listing it is judged as any
    folder that cannot be listed."""
    _save(tmp_path, 1, 2, group=True)
    (tmp_path / "latest").unlink()
    ops = FaultyOps([Fault("scandir", errno.ESTALE, nth=n, path_contains=str(tmp_path / "step-2"))
                     for n in range(1, discovery.RESCANS + 1)])
    with pytest.raises(OSError, match="Stale file handle") as ei:
        discovery.latest(Homes(ops=ops), str(tmp_path))
    assert any("step-2 cannot be listed, and it may hold the newest checkpoint" in n and "stale NFS file handle" in n
               and "chmod" not in n for n in ei.value.__notes__)  # (a stale handle's fix is no chmod)


def test_latest_of_a_file_whose_folder_cannot_be_listed_judges_the_file_itself(tmp_path: Path, monkeypatch) -> None:
    """A colleague's folder of mode 711 (the file opens, the folder does not list): latest(file)
    of a complete checkpoint there is the file, fastckpt's or torch.save's, as load() of it works;
    it said "no complete checkpoint" (``d3_latest_of_file_in_unlistable_dir_says_not_a_checkpoint``).
    A file that is no checkpoint, or one cut short, is still refused, by what it is."""
    from fastckpt.errors import ConfigError

    alice = tmp_path / "alice"
    alice.mkdir()
    _save(alice, 1)
    torch.save({"w": torch.ones(2), "step": 2}, alice / "plain.pt")
    (alice / "notes.txt").write_text("not a checkpoint")
    (alice / "cut.pt").write_bytes((alice / "plain.pt").read_bytes()[:-30])
    _unlistable(monkeypatch, alice)
    for name in ("step-1.pt", "plain.pt"):
        assert fastckpt.latest(str(alice / name)) == str(alice / name)
    with pytest.raises(ConfigError, match="notes.txt is a file, not a directory, and it is no complete checkpoint"):
        fastckpt.latest(str(alice / "notes.txt"))
    with pytest.raises(ConfigError, match="cut.pt is a file, not a directory, and it is damaged .*truncated"):
        fastckpt.latest(str(alice / "cut.pt"))


def test_latest_of_a_part_of_a_checkpoint_in_a_folder_that_cannot_be_listed_is_refused(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    """Judged alone, a file of a committed group and a DCP checkpoint's meta.pt (Lightning FSDP)
    were named complete checkpoints when their folder could not be listed, though refused when it
    could (``d6_latest_of_part_file_in_unlistable_checkpoint_dir``)."""
    from fastckpt.errors import ConfigError

    _save(tmp_path, 5, group=True)
    group, dcp = tmp_path / "step-5", tmp_path / "epoch=3-step=9.ckpt"
    torch.save({"w": torch.ones(2)}, group / "extra.pt")
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"x")
    torch.save({"global_step": 9}, dcp / "meta.pt")
    _unlistable(monkeypatch, group, dcp)
    for part in (group / "extra.pt", dcp / "meta.pt"):
        with pytest.raises(ConfigError, match="is a file, not a directory, and it is no complete checkpoint"):
            fastckpt.latest(str(part))


def test_the_restart_scan_passes_over_a_folder_it_cannot_list(tmp_path: Path) -> None:
    """Retention's restart scan is housekeeping: what it cannot see it keeps, so a step folder in
    the burst buffer that cannot be listed never fails a save (``d3_keep_local_restart_scan_*``)."""
    from fastckpt.urls import mirror_path

    nvme, dest = tmp_path / "nvme", tmp_path / "ckpt"
    with fastckpt.Checkpointer(local_dir=str(nvme), keep_local=1) as ck:
        ck.save({"w": torch.ones(3)}, str(dest / "c0.pt")).wait()
    mirror = Path(mirror_path(str(nvme), str(dest)))
    (mirror / "step-7").mkdir()
    ops = FaultyOps([Fault("scandir", errno.EACCES, path_contains=str(mirror / "step-7"))])
    with fastckpt.Checkpointer(local_dir=str(nvme), keep_local=1, ops=ops) as ck:
        ck.save({"w": torch.ones(3)}, str(dest / "c1.pt")).wait()
    ops.assert_all_reached()
    assert sorted(p.name for p in mirror.iterdir() if not p.name.startswith(".")) == ["c1.pt", "step-7"]


def test_an_unreadable_lightning_meta_or_deepspeed_latest_is_raised_not_passed_over(tmp_path: Path) -> None:
    """The other records a scan reads (``d3_unreadable_foreign_record_latest_goes_back``): a
    Lightning DCP directory's ``meta.pt`` and DeepSpeed's own ``latest`` file."""
    import torch.distributed.checkpoint as dcp

    _save(tmp_path, 1)
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "epoch=1-step=2.ckpt"))
    torch.save({"global_step": 2}, tmp_path / "epoch=1-step=2.ckpt" / "meta.pt")
    assert discovery.latest(Homes(), str(tmp_path)) == str(tmp_path / "epoch=1-step=2.ckpt")
    ops = FaultyOps([Fault("open", errno.EACCES, path_contains="meta.pt")])
    with pytest.raises(PermissionError) as err:
        discovery.latest(Homes(ops=ops), str(tmp_path))
    assert "meta.pt cannot be read" in "\n".join(err.value.__notes__)

    ds = tmp_path / "ds"
    (ds / "global_step3").mkdir(parents=True)
    torch.save({"w": torch.ones(1)}, ds / "global_step3" / "mp_rank_00_model_states.pt")
    (ds / "latest").write_text("global_step3")
    assert discovery.latest(Homes(), str(ds)) == str(ds / "global_step3")
    ops = FaultyOps([Fault("open", errno.EIO, nth=n, path_contains="ds/latest") for n in (1, 2, 3)])  # pointer, scan
    with pytest.raises(OSError) as err:
        discovery.latest(Homes(ops=ops), str(ds))
    assert "latest cannot be read" in "\n".join(err.value.__notes__)
