"""commit.removable: ``Checkpointer.remove`` deletes one checkpoint, never the directory (or URL
prefix) that holds checkpoints, nor a file that is none. Before, anything that was not a file
went to a tree deletion: ``remove(run_dir)`` took every checkpoint, ``latest`` and the user's
files with it."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import fsspec
import pytest
import torch

import fastckpt
from fastckpt.commit.protocol import GROUP_MANIFEST
from fastckpt.errors import ConfigError


def _state(step: int) -> dict:
    return {"w": torch.ones(4) * step, "step": step}


def _run(tmp_path: Path, ck: fastckpt.Checkpointer) -> Path:
    """A run directory: a single file, a published group (which moves ``latest``), the user's notes."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("not a checkpoint")
    ck.save(_state(1), str(run / "step-1.pt"))
    ck.save(_state(2), str(run / "step-2" / "rank0.pt"), group=str(run / "step-2"))
    ck.commit(str(run / "step-2"), step=2).wait(60)
    return run


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_remove_refuses_a_directory_holding_checkpoints_and_a_file_that_is_none(tmp_path: Path) -> None:
    with fastckpt.Checkpointer() as ck:
        run = _run(tmp_path, ck)
        before = _tree(run)
        assert "latest" in before
        with pytest.raises(ConfigError, match=r"it is not a checkpoint but a directory holding 2 checkpoints "
                                              r"\(.*step-1\.pt, .*step-2\).*Pass the checkpoint to delete"):
            ck.remove(str(run))
        with pytest.raises(ConfigError, match="it is not a checkpoint: a file with no fastckpt manifest"):
            ck.remove(str(run / "notes.txt"))
        with pytest.raises(ConfigError, match="holding no checkpoint fastckpt recognises"):
            os.makedirs(tmp_path / "data")
            (tmp_path / "data" / "x.bin").write_bytes(b"data")
            ck.remove(str(tmp_path / "data"))
        assert _tree(run) == before
        assert (tmp_path / "data" / "x.bin").exists()
        ck.remove(str(run / "step-2"))  # what was meant: one checkpoint
        ck.remove(str(run / "step-1.pt"))
        ck.remove(str(run / "gone"))  # nothing there: a no-op, as before
    assert _tree(run) == ["latest", "notes.txt"]


def test_remove_refuses_a_checkpoint_directory_holding_another_or_a_pointer(tmp_path: Path) -> None:
    """A recognised checkpoint directory (here DCP's) that also holds a group or a ``latest``: no tree deletion."""
    dcp = tmp_path / "outer"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"dcp")
    (dcp / "__0_0.distcp").write_bytes(b"shard")
    with fastckpt.Checkpointer() as ck:
        ck.save(_state(1), str(dcp / "inner" / "a.pt"), group=str(dcp / "inner"))
        ck.commit(str(dcp / "inner"), step=1).wait(60)
        with pytest.raises(ConfigError, match=r"it is a torch.distributed.checkpoint holding 1 checkpoint \(.*inner\)"):
            ck.remove(str(dcp))
    assert (dcp / "inner" / "fastckpt-manifest.json").exists()


def test_remove_still_deletes_every_kind_of_checkpoint(tmp_path: Path) -> None:
    """What callers remove (retention, Lightning's ModelCheckpoint, DeepSpeed's incomplete tags):
    fastckpt files and groups (also unpublished ones), torch.save files, DCP directories (FSDP),
    DeepSpeed tags and Megatron iterations written without fastckpt, an empty directory."""
    paths = {
        "torch.save": tmp_path / "old.ckpt",
        "dcp": tmp_path / "epoch=1.ckpt",
        "deepspeed": tmp_path / "global_step10",
        "megatron": tmp_path / "iter_0000010",
        "empty": tmp_path / "empty",
        "unpublished": tmp_path / "step-3",
    }
    torch.save(_state(1), paths["torch.save"])
    paths["dcp"].mkdir()
    (paths["dcp"] / ".metadata").write_bytes(b"dcp")
    (paths["dcp"] / "meta.pt").write_bytes(b"meta")
    paths["deepspeed"].mkdir()
    torch.save(_state(1), paths["deepspeed"] / "mp_rank_00_model_states.pt")
    (paths["megatron"] / "mp_rank_00").mkdir(parents=True)
    torch.save(_state(1), paths["megatron"] / "mp_rank_00" / "model_optim_rng.pt")
    paths["empty"].mkdir()
    with fastckpt.Checkpointer() as ck:
        ck.save(_state(3), str(paths["unpublished"] / "a.pt"), group=str(paths["unpublished"])).wait(60)
        for p in paths.values():
            ck.remove(str(p))
            assert not p.exists()


def test_remove_deletes_what_ls_lists_damaged_and_still_refuses_what_is_no_checkpoint(tmp_path: Path) -> None:
    """A checkpoint file emptied to 0 bytes is listed damaged by ``fastckpt ls`` (as ``load`` calls
    it truncated), yet ``remove()`` refused it as "not a checkpoint": the operator could not delete
    what fastckpt itself reported. Whatever ls lists damaged goes now (emptied, or cut short past
    its manifest), and what ls does not list stays refused: a plain text file, an empty log."""
    from fastckpt.cli._listing import list_checkpoints

    run = tmp_path / "run"
    with fastckpt.Checkpointer() as ck:
        for step in (1, 2, 3):
            ck.save(_state(step), str(run / f"step-{step}.pt")).wait(60)
    os.truncate(run / "step-1.pt", 0)
    os.truncate(run / "step-2.pt", os.path.getsize(run / "step-2.pt") // 2)
    (run / "notes.txt").write_text("not a checkpoint")
    (run / "train.log").touch()
    (run / "blank.txt").touch()
    listed = {Path(e.path).name: e.status for e in list_checkpoints(str(run))}
    assert listed == {"step-1.pt": "damaged", "step-2.pt": "damaged", "step-3.pt": "complete"}
    with fastckpt.Checkpointer() as ck:
        for name in ("notes.txt", "train.log", "blank.txt"):
            with pytest.raises(ConfigError, match="it is not a checkpoint: a file with no fastckpt manifest"):
                ck.remove(str(run / name))
        ck.remove(str(run / "step-1.pt"))  # before: ConfigError, "it is not a checkpoint"
        ck.remove(str(run / "step-2.pt"))
    assert _tree(run) == ["blank.txt", "notes.txt", "step-3.pt", "train.log"]


def test_remove_refuses_a_url_prefix_holding_checkpoints(tmp_path: Path) -> None:
    root = f"memory://fastckpt-{uuid.uuid4().hex[:8]}"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        ck.save(_state(1), f"{root}/datasets/run/a.pt").wait(60)
        with pytest.raises(ConfigError, match="holding 1 checkpoint"):
            ck.remove(f"{root}/datasets")
        assert (ck.latest(f"{root}/datasets/run") or "").endswith("/datasets/run/a.pt")
        ck.remove(f"{root}/datasets/run/a.pt")
    left = fsspec.filesystem("memory").find(root.removeprefix("memory://"))
    assert left == []  # the file, its sidecar and the folder's latest naming it went


@pytest.mark.parametrize("empty", ["", "  ", "file://", "FILE:// "])
def test_an_empty_path_is_refused_not_taken_for_the_working_directory(tmp_path: Path, monkeypatch, empty) -> None:
    """``normalize("")`` is the working directory: ``remove("")`` deleted it when it was one checkpoint
    (a group directory the job runs in), and ``latest("")`` scanned it. So did a bare ``file://``
    (``f"file://{dirpath}"`` with ``dirpath`` unset), with ``whole=True`` (Lightning's call) whatever it held."""
    with fastckpt.Checkpointer() as ck:
        group = tmp_path / "step-3"
        ck.save(_state(3), str(group / "rank0.pt"), group=str(group))
        ck.commit(str(group), step=3).wait(60)
        monkeypatch.chdir(group)
        for call in (lambda: ck.remove(empty), lambda: ck.remove(empty, whole=True), lambda: ck.latest(empty),
                     lambda: fastckpt.latest(empty)):
            with pytest.raises(ConfigError, match="the path is empty"):
                call()
        assert fastckpt.latest(str(tmp_path)) == str(group)
        assert torch.equal(fastckpt.load(str(group / "rank0.pt"))["w"], _state(3)["w"])


def test_a_group_at_an_fsspec_home_is_deleted_by_remove_and_by_keep_persistent(tmp_path: Path) -> None:
    """fsspec's memory, gs, az and hdfs filesystems give a prefix holding objects an ``info`` of its
    own (a directory): ``FsspecTarget.exists`` said a file was there, so ``remove`` and
    ``keep_persistent`` took a group for a single file, deleted nothing, and said nothing."""
    root = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run"
    fs = fsspec.filesystem("memory")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), keep_persistent=2, rank=0, world_size=1) as ck:
        for step in (1, 2, 3):
            ck.save(_state(step), f"{root}/global_step{step}/r0.pt", group=f"{root}/global_step{step}")
            ck.commit(f"{root}/global_step{step}", step=step).wait(60)
        ck.wait()
        assert not fs.exists(f"{root.removeprefix('memory://')}/global_step1")  # keep_persistent's trim
        ck.remove(f"{root}/global_step3")
    left = sorted(p.rsplit("/run/", 1)[1] for p in fs.find(root.removeprefix("memory://")))
    assert not any(p.startswith(("global_step1/", "global_step3/")) for p in left), left
    assert any(p.startswith("global_step2/") for p in left), left


def test_a_group_holding_a_key_no_checkpoint_could_have_is_still_deleted_whole(tmp_path: Path) -> None:
    """A key under a group's prefix that ``check_key`` refuses (a ``notes\\draft.txt`` copied from
    Windows; on S3 a folder marker ``run/step-2/``, tests/integration/test_groups_s3.py) is listed by
    the store. ``delete_tree`` deleted the manifest, then raised a ConfigError naming that key,
    leaving the group's data files: ``remove`` failed halfway, ``keep_persistent`` leaked them."""
    root = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run"
    fs = fsspec.filesystem("memory")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), keep_persistent=1) as ck:
        for step in (1, 2):
            g = f"{root}/step-{step}"
            fs.pipe_file(f"{g.removeprefix('memory://')}/notes\\draft.txt", b"the user's")
            ck.save(_state(step), f"{g}/r0.pt", group=g)
            ck.commit(g, step=step).wait(60)
        ck.wait()
        ck.remove(f"{root}/step-2")
    left = sorted(p.rsplit("/run/", 1)[1] for p in fs.find(root.removeprefix("memory://")))
    assert not any(p.startswith(("step-1/", "step-2/")) for p in left), left


def test_a_root_is_refused_before_anything_is_listed_or_deleted(tmp_path: Path, monkeypatch) -> None:
    """``remove("/")`` listed the whole file system (every directory, to any depth) only to refuse
    it; a bucket's root was listed too. A target's root is never one checkpoint: it is refused
    first, with ``whole=True`` too (Lightning's call, which deletes whatever a checkpoint holds).
    A spy on ``os.scandir`` fails the test at the first directory read under ``/``."""
    real = os.scandir
    listed: list[str] = []

    def scandir(d: str = "."):  # noqa: ANN202 (os.scandir's iterator)
        if os.path.dirname(os.path.abspath(os.fspath(d))) == "/" or os.fspath(d) == "/":
            listed.append(os.fspath(d))
            raise AssertionError(f"remove('/') listed {d}")
        return real(d)

    bucket = f"memory://fastckpt-{uuid.uuid4().hex[:8]}"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        ck.save(_state(1), f"{bucket}/run/x.pt").wait()
        monkeypatch.setattr(os, "scandir", scandir)
        for root, what in (("/", "the root of the file system"), ("file:///", "the root of the file system"),
                           (bucket, r"the root of a bucket \(or host\)"),
                           (bucket.replace("://", ":///"), r"the root of a bucket \(or host\)")):
            for whole in (False, True):
                with pytest.raises(ConfigError, match=f"it is {what}, never one checkpoint"):
                    ck.remove(root, whole=whole)
        monkeypatch.undo()
    assert listed == []
    assert fastckpt.latest(f"{bucket}/run") == f"{bucket}/run/x.pt"


def test_remove_refuses_one_file_of_a_checkpoint_made_of_several(tmp_path: Path) -> None:
    """remove() of one rank's file of a published group deleted it and left the group that latest
    names damaged; so for a file of an unpublished group, the group's manifest (it was called "not a
    checkpoint ... delete this file yourself", which unpublishes the group), a DeepSpeed tag or a
    Megatron iteration (each goes whole, by its folder). A single file in a numbered folder is one
    checkpoint."""
    run = tmp_path / "run"
    with fastckpt.Checkpointer() as ck:
        for name in ("a.pt", "b.pt"):
            ck.save(_state(1), str(run / "g-1" / name), group=str(run / "g-1"))
        ck.commit(str(run / "g-1"), step=1).wait(60)
        ck.save(_state(2), str(run / "step-2" / "state.pt")).wait(60)
    tag, it = run / "global_step3", run / "iter_0000004" / "mp_rank_00"
    for f in (tag / "mp_rank_00_model_states.pt", it / "model_optim_rng.pt"):
        f.parent.mkdir(parents=True)
        torch.save(_state(3), f)
    with fastckpt.Checkpointer() as ck:
        for path, whole in ((run / "g-1" / "a.pt", f"the fastckpt group, {run}/g-1"),
                            (run / "g-1" / GROUP_MANIFEST, f"the fastckpt group, {run}/g-1"),  # it publishes it
                            (tag / "mp_rank_00_model_states.pt", f"the DeepSpeed tag, {tag}"),
                            (it / "model_optim_rng.pt", f"the Megatron iteration, {run}/iter_0000004")):
            with pytest.raises(ConfigError, match=f"it is one file of {whole}: deleting it alone"):
                ck.remove(str(path))
            assert path.exists()
        ck.remove(str(run / "step-2" / "state.pt"))
        ck.remove(str(run / "g-1" / "gone.pt"))  # nothing there: a no-op, as anywhere
    with fastckpt.Checkpointer() as ck:  # of its own, though beside a group or named like DeepSpeed's files
        ck.save(_state(5), str(run / "g-1" / "ema.pt")).wait(60)
        ck.save(_state(6), str(run / "step-6-model_states.pt")).wait(60)
        ck.save(_state(7), str(tmp_path / "own" / "step-7-model_states.pt")).wait(60)
    assert fastckpt.latest(str(tmp_path / "own")) == str(tmp_path / "own" / "step-7-model_states.pt")  # was None
    with fastckpt.Checkpointer() as ck:
        ck.remove(str(run / "g-1" / "ema.pt"))
        ck.remove(str(run / "step-6-model_states.pt"))
        ck.remove(str(run / "g-1"))
    assert fastckpt.latest(str(run)) is not None and not (run / "g-1").exists()

