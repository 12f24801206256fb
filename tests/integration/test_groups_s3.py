"""Groups at an S3 URL (SeaweedFS), with simulated ranks sharing a TCPStore: a group commits
through the store and its burst-buffer copy serves loads; re-saving a published group is
refused (an object store cannot swap it in atomically) and leaves it whole, unless its commit
died before moving ``latest`` (a restarted job resumes from the older checkpoint and saves it again)."""

from __future__ import annotations

import datetime
import errno
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.errors import CheckpointWriteError, ConfigError


def _state(version: int, rank: int) -> dict:
    return {"w": torch.arange(64, dtype=torch.int64) * version + rank, "version": version}


def test_a_group_at_a_url_commits_and_a_published_one_is_not_resaved(s3_server, s3_bucket, tmp_path: Path) -> None:
    opts = s3_server.storage_options()
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    g = f"s3://{s3_bucket}/run/global_step1"
    cks = [fastckpt.Checkpointer(rank=r, world_size=2, store=store, storage_options=opts, overhead_budget=0.99,
                                 local_dir=str(tmp_path / "nvme"), commit_timeout_s=60) for r in (0, 1)]
    try:
        for ck in cks:
            ck.save(_state(1, ck.rank), f"{g}/rank{ck.rank}.pt", group=g)
        records = [h.wait(60) for h in [ck.commit(g, step=1) for ck in cks]]
        assert all(rec.store_ops > 0 for rec in records)
        assert cks[1].load(f"{g}/rank1.pt")["version"] == 1
        assert cks[1].stats().last_restore_from == "local"
        with pytest.raises(ConfigError, match="object store cannot replace a group atomically"):
            cks[0].save(_state(2, 0), f"{g}/rank0.pt", group=g)
    finally:
        for ck in cks:
            ck.close()
    assert fastckpt.latest(f"s3://{s3_bucket}/run", storage_options=opts) == g
    assert fastckpt.load(f"{g}/rank0.pt", storage_options=opts)["version"] == 1


def test_a_group_whose_commit_died_before_moving_latest_is_saved_again_in_place(s3_server, s3_bucket,
                                                                                  tmp_path: Path) -> None:
    from fastckpt.storage.homes import Homes

    opts = s3_server.storage_options()
    run = f"s3://{s3_bucket}/run"
    ck = fastckpt.Checkpointer(storage_options=opts, overhead_budget=0.99, local_dir=str(tmp_path / "nvme"))
    try:
        for v in (1, 2):
            g = f"{run}/step{v}"
            ck.save(_state(v, 0), f"{g}/rank0.pt", group=g)
            ck.commit(g, step=v).wait(60)
        # the job was killed between step2's manifest and its move of latest, then resumed from step1
        Homes(opts).resolve(run).place().put("latest", b"step1")
        assert fastckpt.latest(run, storage_options=opts) == f"{run}/step1"
        ck.save(_state(3, 0), f"{run}/step2/rank0.pt", group=f"{run}/step2")  # not refused
        ck.commit(f"{run}/step2", step=2).wait(60)
        assert fastckpt.latest(run, storage_options=opts) == f"{run}/step2"
        assert fastckpt.load(f"{run}/step2/rank0.pt", storage_options=opts)["version"] == 3
        with pytest.raises(ConfigError, match="object store cannot replace a group atomically"):
            ck.save(_state(4, 0), f"{run}/step2/rank0.pt", group=f"{run}/step2")  # now the latest: refused
    finally:
        ck.close()


def test_a_group_or_file_at_a_url_given_for_the_other_says_so(s3_server, s3_bucket, tmp_path: Path) -> None:
    """load(latest(url)) of a group raised CheckpointNotFoundError ("never saved there, or deleted
    since"), a FileNotFoundError a resume takes for "start fresh"; latest() of a checkpoint file
    answered None. Each now says what the name is, as on a file system."""
    opts = s3_server.storage_options()
    run = f"s3://{s3_bucket}/run"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=opts) as ck:
        ck.save(_state(1, 0), f"{run}/last.pt").wait()
        ck.save(_state(2, 0), f"{run}/step2/rank0.pt", group=f"{run}/step2").wait()
        ck.commit(f"{run}/step2", step=2).wait()
    assert fastckpt.latest(run, storage_options=opts) == f"{run}/step2"
    with pytest.raises(ConfigError, match=r"step2 is a directory, not a checkpoint file: load a file inside it"):
        fastckpt.load(f"{run}/step2", storage_options=opts)
    with pytest.raises(fastckpt.CheckpointNotFoundError, match="does not exist"):
        fastckpt.load(f"{run}/step3", storage_options=opts)
    assert fastckpt.latest(f"{run}/last.pt", storage_options=opts) == f"{run}/last.pt"
    assert fastckpt.load(fastckpt.latest(f"{run}/last.pt", storage_options=opts), storage_options=opts)["version"] == 1


def test_load_of_a_dcp_directory_at_a_url_says_what_loads_it(s3_server, s3_bucket, tmp_path: Path) -> None:
    """latest() names a torch.distributed.checkpoint directory (its .metadata written); load()
    of it said "... or fastckpt.latest(<it>)", which named it again. It now names it as DCP's."""
    import warnings

    import torch.distributed.checkpoint as dcp

    opts, run = s3_server.storage_options(), f"s3://{s3_bucket}/run3"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: dcp.save warns and saves as one rank
        dcp.save({"model": {"w": torch.ones(4)}, "step": 100}, checkpoint_id=str(tmp_path / "step-100"))
    for f in (tmp_path / "step-100").iterdir():
        s3_server.client().put_object(Bucket=s3_bucket, Key=f"run3/step-100/{f.name}", Body=f.read_bytes())
    named = fastckpt.latest(run, storage_options=opts)
    assert named == f"{run}/step-100"
    with pytest.raises(ConfigError, match=r"step-100 is a checkpoint written by torch.distributed.checkpoint \(a "
                       r"directory holding .metadata\), not a torch.save file: .*dcp_to_torch_save") as refused:
        fastckpt.load(named, storage_options=opts)
    assert "fastckpt.latest(" not in str(refused.value)


def test_a_group_under_folder_markers_is_deleted_by_remove_and_keep_persistent(s3_server, s3_bucket,
                                                                                tmp_path: Path) -> None:
    """Zero-byte "folder" objects ending in '/' (the AWS console's "Create folder", rclone, Hadoop
    S3A) are listed with a group's objects. ``delete_tree`` refused such a key (``check_key``: an
    empty component) after deleting the manifest: ``remove`` raised a ConfigError naming a key the
    user never gave and left the group half-deleted; ``keep_persistent`` leaked its data files."""
    opts, c = s3_server.storage_options(), s3_server.client()
    for k in ("run/", "run/step-1/", "run/step-2/", "run/step-2/notes\\draft.txt"):
        c.put_object(Bucket=s3_bucket, Key=k, Body=b"")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=opts, keep_persistent=1) as ck:
        for s in (1, 2):
            g = f"s3://{s3_bucket}/run/step-{s}"
            ck.save(_state(s, 0), f"{g}/r0.pt", group=g)
            ck.commit(g, step=s).wait(60)
        ck.wait()
        ck.remove(f"s3://{s3_bucket}/run/step-2")
    keys = sorted(o["Key"] for o in c.list_objects_v2(Bucket=s3_bucket).get("Contents", []))
    assert not [k for k in keys if k.startswith(("run/step-1/", "run/step-2/"))], keys


def test_a_group_taken_back_after_its_pointer_put_failed_says_so(s3_server, s3_bucket, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The first group commit at a URL whose ``latest`` PUT fails (EIO) is taken back, and a note on
    the error says so; on S3 the error became a CheckpointWriteError without the note, so the user
    read "the previous checkpoint is untouched" and nothing of the take-back. Its message says it."""
    from fastckpt.storage.fsspec import FsspecTarget

    real = FsspecTarget.put_bytes

    def put_bytes(self: FsspecTarget, key: str, data: bytes) -> None:
        if key.endswith("/latest"):
            raise OSError(errno.EIO, "injected EIO on the latest PUT", key)
        real(self, key, data)

    monkeypatch.setattr(FsspecTarget, "put_bytes", put_bytes)
    opts, run = s3_server.storage_options(), f"s3://{s3_bucket}/run"
    g = f"{run}/step1"
    with fastckpt.Checkpointer(storage_options=opts, local_dir=str(tmp_path / "nvme"), retry_deadline_s=2,
                               rank=0, world_size=1) as ck:
        ck.save(_state(1, 0), f"{g}/rank0.pt", group=g)
        with pytest.raises(CheckpointWriteError, match="injected EIO") as raised:
            ck.commit(g, step=1).wait()
    assert f"{g} was taken back, so that latest() does not find it" in str(raised.value)
    monkeypatch.undo()
    assert fastckpt.latest(run, storage_options=opts) is None


def test_a_group_whose_keys_the_store_refuses_is_refused_at_save(s3_server, s3_bucket, tmp_path: Path) -> None:
    """Only a single file's sidecar key was checked at save: a group at a path of 1002 bytes after
    the bucket uploaded its files, then its commit failed (its manifest's key, 1025 bytes, over
    the 1024 S3 takes), and a group folder of 256 bytes (over the 255 SeaweedFS and MinIO take in
    one part of a key) failed writing its burst-buffer copy, after the snapshot. Both are refused
    at save now, before a byte is written; 986 bytes (its claims' keys reach 1024) commit."""
    opts = s3_server.storage_options()
    nvme = tmp_path / "nvme"
    deep = "/".join(["d" * 200] * 4)  # 803 bytes after the bucket
    with fastckpt.Checkpointer(local_dir=str(nvme), storage_options=opts, overhead_budget=0.99) as ck:
        g = f"s3://{s3_bucket}/{deep}/{'s' * 198}"
        with pytest.raises(ConfigError, match=rf"its commit writes its manifest at key {deep}/s{{198}}/fastckpt-"
                                              r"manifest\.json \(1025 bytes\) and markers under .*\(keys of up to "
                                              r"1040 bytes\), over the 1024 bytes S3 and Google Cloud Storage take "
                                              r"in a key, so the group would fail only at its commit, after every "
                                              r"upload\. Choose a shorter group path after the bucket, of at most 986 "
                                              r"bytes \(it has 1002\)"):
            ck.save(_state(1, 0), f"{g}/rank0.pt", group=g)
        g = f"s3://{s3_bucket}/run/{'f' * 256}"
        with pytest.raises(ConfigError, match=r"its part 'f{40}'\.\.\. is 256 bytes long, over the 255 bytes"):
            ck.save(_state(1, 0), f"{g}/rank0.pt", group=g)
        assert s3_server.client().list_objects_v2(Bucket=s3_bucket).get("KeyCount") == 0
        assert [p for p in nvme.rglob("*") if p.is_file()] == []
        g = f"s3://{s3_bucket}/{deep}/{'s' * 182}"  # 986 bytes
        ck.save(_state(2, 0), f"{g}/rank0.pt", group=g)
        ck.commit(g, step=2).wait(60)
    assert fastckpt.latest(f"s3://{s3_bucket}/{deep}", storage_options=opts) == g
    assert fastckpt.load(f"{g}/rank0.pt", storage_options=opts)["version"] == 2
