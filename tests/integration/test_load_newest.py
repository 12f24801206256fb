"""A load returns the newest save of its path, and never replaces it with an older copy.

- A save of the path still in flight on the same Checkpointer (its upload held by a FaultyOps
  hook) is waited for: the load returns it, not the copy at the home from before.
- A burst-buffer copy of a save whose upload failed (or whose job was killed before it ended)
  is not a checkpoint: a load returns the home's, as ``fastckpt.load`` does. But it is the only
  copy of that save, and ``prefetch=True`` does not download the older home copy over it. A
  burst-buffer copy older than the home's (another node saved since) is replaced.
- Names fastckpt keeps for its own files, and URL keys that leave their bucket or ``local_dir``,
  are refused at ``save`` before anything is written.
- ``latest`` at a URL whose bucket does not exist raises, naming the bucket, instead of
  answering "nothing saved yet".
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import uuid

import pytest
import torch

import fastckpt
from fastckpt.errors import CheckpointWriteError, ConfigError, CorruptCheckpointError, ReplicationError
from fastckpt.load import fallback
from fastckpt.storage.types import BucketNotFoundError
from fastckpt.testing import Fault, FaultyOps


def _state(step: int, n: int = 1 << 16) -> dict:
    return {"w": torch.full((n,), step, dtype=torch.int32), "step": step}


def _step(obj: dict) -> int:
    assert bool((obj["w"] == obj["step"]).all())
    return obj["step"]


class HoldUpload:
    """FaultyOps ``on_call``: once armed, holds the first rename into ``home`` (the replica's
    publication; the local write renames inside local_dir) until ``release``."""

    def __init__(self, home: str) -> None:
        self.home, self.armed = home + os.sep, False
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, op: str, path: str) -> None:
        if self.armed and op == "replace" and path.startswith(self.home) and not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(60)


def test_load_waits_for_a_save_of_the_path_in_flight(tmp_path) -> None:
    home = str(tmp_path / "home")
    hold = HoldUpload(home)
    path = os.path.join(home, "last.ckpt")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), ops=FaultyOps(on_call=hold)) as ck:
        ck.save(_state(1), path).wait()
        hold.armed = True
        h2 = ck.save(_state(2), path)
        assert hold.entered.wait(60)  # step 2 is written locally; its copy at the home is held
        got: list = []
        loaded = threading.Event()
        t = threading.Thread(target=lambda: (got.append(ck.load(path)), loaded.set()))
        t.start()
        # The load cannot end while step 2's save is in flight: it waits for it (a check that
        # it has not ended, not a wait for something to happen; it never passes by chance).
        assert not loaded.wait(1.0)
        hold.release.set()
        t.join(60)
        assert _step(got[0]) == 2
        assert h2.wait().durable_s is not None


def test_a_load_that_waited_for_a_failed_save_raises_it_not_the_copy_before(tmp_path) -> None:
    """A load waits for this Checkpointer's save of the path in flight so that it reads what that
    save made; when the save failed (a full drive), the load returned the previous checkpoint as
    if it were the new one (an eval right after saving step 2 evaluated step 1). It raises that
    failure now, once: a second load reads the previous checkpoint, and the next save does not
    raise it again."""
    path = str(tmp_path / "last.pt")
    ops = FaultyOps()
    with fastckpt.Checkpointer(ops=ops) as ck:
        ck.save(_state(1), path).wait()
        ops.inject(Fault("pwrite", errno.ENOSPC))
        h2 = ck.save(_state(2), path)
        with pytest.raises(CheckpointWriteError, match=f"loading {path}: the save of it that this Checkpointer had "
                           "in flight failed, so there is no new checkpoint to load") as err:
            ck.load(path)
        assert "No space left on device" in str(err.value) and "then load it again" in str(err.value)
        assert err.value.errno == errno.ENOSPC
        assert _step(ck.load(path)) == 1  # the previous checkpoint, intact
        ck.save(_state(3), path).wait()  # raised once: not again at the next sync point
        with pytest.raises(CheckpointWriteError, match="No space left on device"):
            h2.wait()  # its own handle still says how it ended
    assert _step(fastckpt.load(path)) == 3


def test_a_load_that_waited_for_a_save_whose_copy_home_failed_raises_it_too(tmp_path) -> None:
    """Only the copy home failed (its first open): the loader reads the home, not a local copy newer than
    it, so returning would pass the previous checkpoint off as the new one: the load raises the failure,
    once; a second load reads the previous checkpoint at the home."""
    local, home = str(tmp_path / "nvme"), str(tmp_path / "home")
    path = os.path.join(home, "last.ckpt")
    with fastckpt.Checkpointer(local_dir=local) as ck:
        ck.save(_state(1), path).wait()
    ops = FaultyOps()
    ops.inject(Fault("open", errno.EIO, nth=1, path_startswith=home + os.sep))  # the upload's open: the load's works
    with fastckpt.Checkpointer(local_dir=local, ops=ops) as ck:
        h = ck.save(_state(2), path)
        with pytest.raises(CheckpointWriteError, match="there is no new checkpoint to load .ReplicationError"):
            ck.load(path)
        assert _step(ck.load(path)) == 1 and ck.stats().last_restore_from == "path"
        with pytest.raises(ReplicationError):
            h.wait()


def _failing_upload(home: str) -> FaultyOps:
    """Every open under ``home`` fails: the save is written to the burst buffer, never copied."""
    ops = FaultyOps()
    for nth in range(1, 20):
        ops.inject(Fault("open", errno.EIO, nth=nth, path_startswith=home + os.sep))
    return ops


def test_a_failed_save_is_not_loaded_after_a_restart_and_its_copy_stays(tmp_path) -> None:
    local, home = str(tmp_path / "nvme"), str(tmp_path / "home")
    path = os.path.join(home, "last.ckpt")
    with fastckpt.Checkpointer(local_dir=local) as ck:
        ck.save(_state(1), path).wait()
    with fastckpt.Checkpointer(local_dir=local, ops=_failing_upload(home)) as ck:
        with pytest.raises(ReplicationError):
            ck.save(_state(2), path).wait()
        kept = ck.local_path(path)
    with fastckpt.Checkpointer(local_dir=local) as ck:  # the restarted job
        assert _step(ck.load(path)) == 1 and ck.stats().last_restore_from == "path"
    assert _step(fastckpt.load(path)) == 1
    assert _step(torch.load(kept, weights_only=True)) == 2  # the failed save's only copy is still there


def test_an_older_local_copy_gives_way_to_the_home(tmp_path) -> None:
    """Another node (its own burst buffer) saved the path since: the home's save is newer."""
    home = str(tmp_path / "home")
    path = os.path.join(home, "last.ckpt")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nodeA")) as a:
        a.save(_state(1), path).wait()
        with fastckpt.Checkpointer(local_dir=str(tmp_path / "nodeB")) as b:
            b.save(_state(2), path).wait()
        assert _step(a.load(path)) == 2 and a.stats().last_restore_from == "path"


def test_s3_prefetch_never_replaces_a_newer_local_copy(s3_server, s3_bucket, tmp_path) -> None:
    local, opts = str(tmp_path / "nvme"), s3_server.storage_options()
    url = f"s3://{s3_bucket}/run/last.ckpt"
    with fastckpt.Checkpointer(local_dir=local, storage_options=opts) as ck:
        ck.save(_state(1), url).wait()
    ck = fastckpt.Checkpointer(local_dir=local, storage_options=opts, retry_deadline_s=2)
    s3_server.stop()
    try:
        with pytest.raises(ReplicationError):
            ck.save(_state(2), url).wait()  # written on the node, never uploaded
        ck.close()
    finally:
        s3_server.start()
    with fastckpt.Checkpointer(local_dir=local, storage_options=opts) as ck:  # the restarted job
        assert _step(ck.load(url, prefetch=True)) == 1 and ck.stats().last_restore_from == "remote"
        assert _step(torch.load(ck.local_path(url), weights_only=True)) == 2  # not replaced by step 1
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "fresh"), storage_options=opts) as other:
        assert _step(other.load(url, prefetch=True)) == 1
        assert other.stats().last_restore_from == "remote (prefetched)"
        assert _step(other.load(url)) == 1 and other.stats().last_restore_from == "local"


def test_s3_prefetch_replaces_an_older_local_copy(s3_server, s3_bucket, tmp_path, monkeypatch) -> None:
    opts, url = s3_server.storage_options(), f"s3://{s3_bucket}/run/last.ckpt"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nodeA"), storage_options=opts) as a:
        a.save(_state(1), url).wait()
        with fastckpt.Checkpointer(local_dir=str(tmp_path / "nodeB"), storage_options=opts) as b:
            b.save(_state(2), url).wait()
        sidecar_reads = []
        real = fallback.read_sidecar
        monkeypatch.setattr(fallback, "read_sidecar", lambda *a, **k: sidecar_reads.append(1) or real(*a, **k))
        assert _step(a.load(url, prefetch=True)) == 2
        assert len(sidecar_reads) == 1  # one read of each manifest decides which copy is newer, and checks the download
        assert a.stats().last_restore_from == "remote (prefetched)"
        assert _step(torch.load(a.local_path(url), weights_only=True)) == 2


@pytest.mark.parametrize("name", ["latest", "a.pt.fastckpt.json", "fastckpt-manifest.json", ".fastckpt/x.pt",
                                  ".fastckpt-tmp-x"])
def test_names_fastckpt_keeps_are_refused(tmp_path, name: str) -> None:
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        with pytest.raises(ConfigError, match="Choose another name"):
            ck.save(_state(1), str(tmp_path / "run" / name))
    assert not (tmp_path / "run").exists() and not any(files for _, _, files in os.walk(tmp_path / "nvme"))


def test_a_hidden_folder_of_the_users_higher_up_is_fine(tmp_path) -> None:
    path = str(tmp_path / ".fastckpt-runs" / "run1" / "step-1.pt")
    with fastckpt.Checkpointer() as ck:
        ck.save(_state(1), path).wait()
        assert _step(ck.load(path)) == 1


@pytest.mark.parametrize("key", ["run/../../../escaped/x.pt", "run//x.pt", "run/./x.pt"])
def test_url_keys_that_leave_their_place_are_refused_before_writing(tmp_path, key: str) -> None:
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"),
                               storage_options={"endpoint_url": "http://127.0.0.1:9"}) as ck:
        with pytest.raises(ConfigError, match="cannot name a checkpoint"):
            ck.save(_state(1), f"s3://bucket/{key}")
        with pytest.raises(ConfigError, match="cannot name a checkpoint"):
            ck.load(f"s3://bucket/{key}")
    assert not any(files for _, _, files in os.walk(tmp_path))


def test_s3_latest_in_a_missing_bucket_raises(s3_server, tmp_path) -> None:
    with pytest.raises(BucketNotFoundError, match="no-such-bucket-fastckpt"):
        fastckpt.latest("s3://no-such-bucket-fastckpt/run", storage_options=s3_server.storage_options())


def test_s3_a_pointer_that_is_not_text_is_replaced(s3_server, s3_bucket, tmp_path) -> None:
    s3_server.client().put_object(Bucket=s3_bucket, Key="run/latest", Body=b"\xff\xfe\x00garbage")
    url = f"s3://{s3_bucket}/run/step-5.pt"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=s3_server.storage_options()) as ck:
        ck.save(_state(5), url).wait()
        assert ck.latest(f"s3://{s3_bucket}/run") == url


def test_a_plain_torch_file_that_replaced_ours_at_the_home_is_loaded(tmp_path) -> None:
    """Plain torch.save (or DeepSpeed without fastckpt) re-saved the path after our save: the
    home's file has no manifest, so it is another save than the burst-buffer copy."""
    path = str(tmp_path / "home" / "mp_rank_00_model_states.pt")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        ck.save(_state(1), path).wait()
        torch.save(_state(2), path)
        assert _step(ck.load(path)) == 2 and ck.stats().last_restore_from == "path"


def test_s3_a_group_file_saved_again_by_another_node_is_loaded_from_the_home(s3_server, s3_bucket, tmp_path) -> None:
    """Node A's burst buffer holds its copy of the published group; node B removed the group at
    the URL and saved it again. Group files have no sidecar: the group's manifest at the URL
    says which save each file is of."""
    opts, group = s3_server.storage_options(), f"s3://{s3_bucket}/ds/global_step5"
    file = f"{group}/rank0.pt"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nodeA"), storage_options=opts, rank=0, world_size=1) as a:
        a.save(_state(1), file, group=group)
        a.commit(group).wait()
        with fastckpt.Checkpointer(local_dir=str(tmp_path / "nodeB"), storage_options=opts, rank=0,
                                   world_size=1) as b:
            b.remove(group)
            b.save(_state(2), file, group=group)
            b.commit(group).wait()
        assert _step(a.load(file)) == 2 and a.stats().last_restore_from == "remote"


def test_a_cut_short_burst_buffer_copy_falls_back_without_calling_it_unverified(tmp_path, caplog) -> None:
    """A burst-buffer copy that lost its tail (a crash while it was written, a bad drive) has no
    manifest: the load falls back to the path. The log says the copy was unusable, not that a file
    without a manifest is being loaded unverified (it never was)."""
    path = str(tmp_path / "run" / "last.pt")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        ck.save(_state(3), path).wait()
        local = ck.local_path(path)
        os.truncate(local, os.path.getsize(local) // 2)
        with caplog.at_level("WARNING", logger="fastckpt"):
            assert _step(ck.load(path)) == 3 and ck.stats().last_restore_from == "path"
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "unusable" in said and local in said
    assert "unverified" not in said


def _memory_url(name: str) -> str:
    return f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run/{name}"


def _put_plain(url: str, obj: object) -> None:
    """``obj`` as a plain torch.save file at the memory:// ``url`` (a migrated run's checkpoint)."""
    import io

    import fsspec

    buf = io.BytesIO()
    torch.save(obj, buf)
    fsspec.filesystem("memory").pipe_file(url.removeprefix("memory://"), buf.getvalue())


def test_a_plain_file_prefetched_before_gives_way_to_a_fastckpt_save_at_the_url(tmp_path) -> None:
    """The burst buffer holds a download of a plain torch.save file (no manifest); another node
    then saved the URL with fastckpt. A local copy without a manifest is no copy of that save
    (before: "same save" whenever either side lacked a manifest, and the stale file loaded)."""
    url = _memory_url("last.ckpt")
    _put_plain(url, _state(1))
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nodeA")) as a:
        assert _step(a.load(url, prefetch=True)) == 1 and a.stats().last_restore_from == "remote (prefetched)"
        with fastckpt.Checkpointer(local_dir=str(tmp_path / "nodeB")) as b:
            b.save(_state(2), url).wait()
        assert _step(a.load(url)) == 2 and a.stats().last_restore_from == "remote"
        assert _step(a.load(url, prefetch=True)) == 2  # and a prefetch replaces the stale download
        assert _step(a.load(url)) == 2 and a.stats().last_restore_from == "local"


def test_a_prefetched_plain_file_is_used_until_the_url_holds_another(tmp_path) -> None:
    """Two files without a manifest: the download is used while the URL's file has its size and
    was written before it; a plain file saved there since (another size) is loaded instead."""
    url = _memory_url("plain.ckpt")
    _put_plain(url, _state(1))
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme")) as ck:
        assert _step(ck.load(url, prefetch=True)) == 1
        assert _step(ck.load(url)) == 1 and ck.stats().last_restore_from == "local"
        _put_plain(url, _state(2, n=1 << 15))
        assert _step(ck.load(url)) == 2 and ck.stats().last_restore_from == "remote"


class ReplaceOnOpen:
    """FaultyOps ``on_call``: once armed, renames ``staged`` over ``path`` at the first open of
    ``path`` (another node's save landing while this one reads it)."""

    def __init__(self, path: str, staged: str) -> None:
        self.path, self.staged, self.armed, self.fired = path, staged, False, False

    def __call__(self, op: str, path: str) -> None:
        if self.armed and not self.fired and op == "open" and path == self.path:
            self.fired = True
            os.replace(self.staged, self.path)


def test_a_save_landing_during_the_same_save_check_never_loads_the_stale_copy(tmp_path) -> None:
    """Node A's burst buffer holds step 1; the home holds step 2, and step 3 (another size) is
    renamed over it just as A's check reads the home's manifest. The size and the tail are read
    through one descriptor, so the check sees one whole file (before: step 2's size with step 3's
    tail did not parse, and the check fell back to A's stale step 1)."""
    home = str(tmp_path / "home")
    path, staged = os.path.join(home, "x.pt"), str(tmp_path / "staged" / "x.pt")
    hook = ReplaceOnOpen(path, staged)
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nodeA"), ops=FaultyOps(on_call=hook)) as a:
        a.save(_state(1), path).wait()
        with fastckpt.Checkpointer() as other:
            other.save(_state(2, n=(1 << 16) + 3000), path).wait()
            other.save(_state(3, n=(1 << 16) + 1000), staged).wait()
        hook.armed = True
        assert _step(a.load(path)) == 3 and a.stats().last_restore_from == "path"
        assert hook.fired


def test_a_home_whose_manifest_will_not_read_is_loaded_before_the_local_copy(tmp_path, caplog) -> None:
    """Reading the home's manifest fails twice (EIO) although the file is there: the home is read
    first (it verifies itself), not skipped for the burst-buffer copy, here of an older save."""
    home = str(tmp_path / "home")
    path = os.path.join(home, "x.pt")
    ops = FaultyOps()
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nodeA"), ops=ops) as a:
        a.save(_state(1), path).wait()
        with fastckpt.Checkpointer() as other:
            other.save(_state(2), path).wait()
        ops.inject(Fault("preadv", errno.EIO, nth=1, path_startswith=path),
                   Fault("preadv", errno.EIO, nth=2, path_startswith=path))
        with caplog.at_level("WARNING", logger="fastckpt"):
            assert _step(a.load(path)) == 2 and a.stats().last_restore_from == "path"
    assert any("cannot read which save" in r.getMessage() and path in r.getMessage() for r in caplog.records)


def test_prefetch_of_a_url_that_holds_nothing_is_not_found(tmp_path) -> None:
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), retry_deadline_s=1) as ck:
        for prefetch in (False, True):
            with pytest.raises(fastckpt.CheckpointNotFoundError, match="does not exist"):
                ck.load(_memory_url("gone.pt"), prefetch=prefetch)


def test_prefetch_of_a_damaged_object_names_it_and_removes_the_download(tmp_path) -> None:
    import fsspec

    url = _memory_url("x.pt")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nodeA")) as a:
        a.save(_state(1), url).wait()
    fs, key = fsspec.filesystem("memory"), url.removeprefix("memory://")
    data = bytearray(fs.cat_file(key))
    data[100_000] ^= 1
    fs.pipe_file(key, bytes(data))
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "fresh")) as fresh:
        with pytest.raises(CorruptCheckpointError) as err:
            fresh.load(url, prefetch=True)
        assert str(err.value).startswith("memory://") and "is corrupt" in str(err.value)
        assert not os.path.exists(fresh.local_path(url))


@pytest.mark.parametrize("prefetch", [False, True])
def test_s3_load_from_a_missing_bucket_names_the_bucket(s3_server, tmp_path, prefetch: bool) -> None:
    """A typo in the bucket is a wrong URL, never "nothing saved there yet, start fresh"."""
    url = "s3://no-such-bucket-fastckpt/run/step-1.pt"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=s3_server.storage_options()) as ck:
        with pytest.raises(BucketNotFoundError, match="bucket 'no-such-bucket-fastckpt' does not exist") as ei:
            ck.load(url, prefetch=prefetch)
    assert not isinstance(ei.value, fastckpt.CheckpointNotFoundError)


def _save_group(g: str, local_dir: str, names: tuple[str, ...]) -> None:
    """Two ranks save ``names`` (alternately) into group ``g`` with a burst buffer, and commit."""
    cks = [fastckpt.Checkpointer(rank=r, world_size=2, local_dir=local_dir, commit_timeout_s=60) for r in (0, 1)]
    try:
        for i, name in enumerate(names):
            cks[i % 2].save({**_state(10 + i), "name": name}, f"{g}/{name}", group=g)
        for h in [ck.commit(g, step=10) for ck in cks]:
            h.wait(60)
    finally:
        for ck in cks:
            ck.close()


def test_a_prefetch_of_a_group_file_on_a_fresh_node_is_judged_by_its_home_group(tmp_path, caplog) -> None:
    """A node whose burst buffer never held the group loads one of its files with prefetch=True:
    the download was judged by the group in the burst buffer, which has no manifest there, and
    refused as incomplete (helper review H6); later loads fell back to the remote with a warning.
    A burst-buffer copy in a directory without a published group is judged by its home's group."""
    g = _memory_url("step-10")
    _save_group(g, str(tmp_path / "saver"), ("model.pt", "zero/opt.pt"))
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "fresh")) as fresh, caplog.at_level("WARNING", "fastckpt"):
        assert fresh.load(f"{g}/zero/opt.pt", prefetch=True)["name"] == "zero/opt.pt"
        assert fresh.stats().last_restore_from == "remote (prefetched)"
        assert fresh.load(f"{g}/zero/opt.pt")["name"] == "zero/opt.pt"
        assert fresh.stats().last_restore_from == "local"
    assert not [r for r in caplog.records if "unusable" in r.getMessage()]


def test_a_home_file_overwritten_by_another_of_its_group_loads_the_intact_local_copy(tmp_path) -> None:
    """opt.pt copied over model.pt at a mounted home: the burst-buffer copy of model.pt is the
    file the published manifest names there, but the home file's own manifest (opt.pt's, written
    no later) made it "an older save" and only the home was tried (helper review H5)."""
    g = str(tmp_path / "home" / "step-20")
    local = str(tmp_path / "nvme")
    _save_group(g, local, ("model.pt", "opt.pt"))
    (tmp_path / "home" / "step-20" / "model.pt").write_bytes((tmp_path / "home" / "step-20" / "opt.pt").read_bytes())
    with fastckpt.Checkpointer(local_dir=local) as ck:
        assert ck.load(f"{g}/model.pt")["name"] == "model.pt" and ck.stats().last_restore_from == "local"
    with pytest.raises(CorruptCheckpointError, match="moved or copied here"):
        fastckpt.load(f"{g}/model.pt")  # without the burst buffer: the home's file is damage


def test_s3_object_overwritten_with_an_older_save_is_reported(s3_server, s3_bucket, tmp_path, caplog) -> None:
    """The object ckpt-2.pt replaced by ckpt-1.pt's bytes, its sidecar as published: before, a
    load of latest() returned ckpt-1's state silently; now with a WARNING (load.published)."""
    opts, root = s3_server.storage_options(), f"s3://{s3_bucket}/run"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "nvme"), storage_options=opts) as ck:
        for i in (1, 2):
            ck.save(_state(i), f"{root}/ckpt-{i}.pt").wait()
    client = s3_server.client()
    old = client.get_object(Bucket=s3_bucket, Key="run/ckpt-1.pt")["Body"].read()
    client.put_object(Bucket=s3_bucket, Key="run/ckpt-2.pt", Body=old)
    newest = fastckpt.latest(root, storage_options=opts)
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        assert fastckpt.load(newest, storage_options=opts)["step"] == 1
    assert any("is not the save its sidecar" in r.getMessage() for r in caplog.records)
