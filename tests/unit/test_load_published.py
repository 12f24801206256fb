"""A single file read from its URL must be the save its sidecar published (``load.published``).

The stores here are fsspec's ``memory://`` (the same Target code as a bucket, no server):
``tests/integration`` runs the S3 paths against a real store."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import fsspec
import pytest
import torch

import fastckpt
from fastckpt.commit.names import SIDECAR
from fastckpt.load import fallback


def _state(step: int) -> dict:
    return {"step": step, "w": torch.full((64,), float(step))}


@pytest.fixture()
def root() -> str:
    url = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run"
    yield url
    fsspec.filesystem("memory").rm(url[len("memory://"):], recursive=True)


def _key(url: str) -> str:
    return url[len("memory://"):]


def _save(root: str, bb: Path, *steps: int, name: str | None = None) -> None:
    with fastckpt.Checkpointer(local_dir=str(bb), overhead_budget=0.99) as ck:
        for i in steps:
            ck.save(_state(i), f"{root}/{name or f'ckpt-{i}.pt'}").wait()


@pytest.mark.parametrize("how", ["fastckpt.load", "prefetch"])
def test_an_object_overwritten_with_an_older_save_is_reported(root: str, tmp_path: Path, how: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """ckpt-2.pt's object replaced by ckpt-1.pt's bytes (a sync tool, an operator's copy), its
    sidecar as published: before, it loaded ckpt-1's state silently under the name latest() gives.
    It loads (a whole save: two racing writers leave the same state), with a WARNING naming both."""
    _save(root, tmp_path / "bb", 1, 2)
    fs = fsspec.filesystem("memory")
    fs.pipe(_key(f"{root}/ckpt-2.pt"), fs.cat(_key(f"{root}/ckpt-1.pt")))
    newest = fastckpt.latest(root)
    assert newest == f"{root}/ckpt-2.pt"
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        if how == "prefetch":
            with fastckpt.Checkpointer(local_dir=str(tmp_path / "fresh")) as ck:
                assert ck.load(newest, prefetch=True)["step"] == 1
        else:
            assert fastckpt.load(newest)["step"] == 1
    said = [r.getMessage() for r in caplog.records if "is not the save its sidecar" in r.getMessage()]
    assert len(said) == 1 and f"{newest} is not the save its sidecar {newest}{SIDECAR} published" in said[0]
    assert "older save" in said[0]
    # a burst-buffer copy of the published save is not what the URL holds: the object loads, with the
    # same WARNING (before: the local copy, step 2, as the sidecar named its save; load.verdict)
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bb")) as ck, caplog.at_level(logging.WARNING, "fastckpt"):
        caplog.clear()
        assert ck.load(newest)["step"] == 1 and ck.stats().last_restore_from == "remote"
    assert any("is not the save its sidecar" in r.getMessage() for r in caplog.records)


def test_a_newer_object_under_the_previous_saves_sidecar_still_loads(root: str, tmp_path: Path) -> None:
    """The documented same-key window: a save of last.pt whose object landed and whose sidecar
    write failed leaves the new object under the previous save's sidecar; the load returns it."""
    _save(root, tmp_path / "bb", 1, name="last.pt")
    fs = fsspec.filesystem("memory")
    first = fs.cat(_key(f"{root}/last.pt{SIDECAR}"))
    _save(root, tmp_path / "bb", 2, name="last.pt")
    fs.pipe(_key(f"{root}/last.pt{SIDECAR}"), first)
    assert fastckpt.load(f"{root}/last.pt")["step"] == 2


@pytest.mark.parametrize("damage", ["garbage", "cut short"])
def test_a_damaged_sidecar_leaves_the_newer_object_to_decide(root: str, tmp_path: Path, damage: str) -> None:
    """Node A's burst buffer holds step 1 of last.pt; node B saved step 2 there since, and the
    sidecar was damaged. A damaged sidecar says nothing, so the object's own manifest decides, as
    without a sidecar: before, node A took it as "the home cannot say" and resumed its older copy."""
    _save(root, tmp_path / "a", 1, name="last.pt")
    _save(root, tmp_path / "b", 2, name="last.pt")
    fs, side = fsspec.filesystem("memory"), _key(f"{root}/last.pt{SIDECAR}")
    fs.pipe(side, b"{ not json" if damage == "garbage" else fs.cat(side)[:20])
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "a")) as ck:
        assert ck.load(f"{root}/last.pt")["step"] == 2 and ck.stats().last_restore_from == "remote"


def test_a_save_of_the_same_key_during_the_load_is_no_false_alarm(root: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a burst-buffer copy the sidecar is read after the object: a save of the same key
    that lands between the two makes the object read older than the sidecar read. The object is
    then read again (its manifest): replaced, so what was read was a published save."""
    _save(root, tmp_path / "bb", 1, name="last.pt")
    real = fallback.read_sidecar
    landed = []

    def save_first(loc, deadline_s=None):  # noqa: ANN001, ANN202 (read_sidecar's signature)
        if not landed:
            _save(root, tmp_path / "bb2", 2, name="last.pt")
            landed.append(True)
        return real(loc, deadline_s=deadline_s)

    monkeypatch.setattr(fallback, "read_sidecar", save_first)
    assert fastckpt.load(f"{root}/last.pt")["step"] == 1 and landed == [True]
    assert fastckpt.load(f"{root}/last.pt")["step"] == 2


def test_the_sidecar_is_read_once_per_load(root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One small GET per load of a single file at a URL: shared by the judgement of a burst-buffer
    copy and the check of the object read (none at all before a load without a local copy)."""
    _save(root, tmp_path / "bb", 1)
    reads = []
    real = fallback.read_sidecar
    monkeypatch.setattr(fallback, "read_sidecar", lambda loc, deadline_s=None: reads.append(loc.url) or real(
        loc, deadline_s=deadline_s))
    assert fastckpt.load(f"{root}/ckpt-1.pt")["step"] == 1
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bb")) as ck:
        assert ck.load(f"{root}/ckpt-1.pt")["step"] == 1 and ck.stats().last_restore_from == "local"
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "other")) as ck:
        assert ck.load(f"{root}/ckpt-1.pt")["step"] == 1 and ck.stats().last_restore_from == "remote"
    assert reads == [f"{root}/ckpt-1.pt"] * 3


def test_the_objects_own_check_gives_up_as_soon_as_the_sidecars(root: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether the object still holds the burst-buffer copy's save is read from its tail (a HEAD
    and a ranged GET): those retried for the store's whole retry_deadline_s (300 s by default),
    while the sidecar's read before them gives up after SAME_SAVE_CHECK_S, so a store that stopped
    answering between the two held a restore from the burst buffer for minutes. The check's
    requests are capped as the sidecar's (``storage.retry.capped``: one attempt at a cap of 0)."""
    from fastckpt.load import verdict
    from fastckpt.storage import retry

    _save(root, tmp_path / "bb", 3, name="last.pt")
    caps: list[float | None] = []
    read = verdict._file_manifest
    monkeypatch.setattr(verdict, "_file_manifest", lambda home: caps.append(retry._CAP.get()) or read(home))
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bb")) as ck:
        assert ck.load(f"{root}/last.pt")["step"] == 3
        assert ck.stats().last_restore_from == "local"
    assert caps == [fallback.SAME_SAVE_CHECK_S]  # was: [None], the target's retry_deadline_s
    attempts: list[int] = []

    def down() -> None:
        attempts.append(1)
        raise TimeoutError("the store does not answer")

    with retry.capped(0.0), pytest.raises(retry.TargetUnavailableError) as gave_up:
        retry.retry_call(down, what="HEAD of s3://b/k", url="s3://b", deadline_s=300, is_transient=lambda e: True,
                         permanent=lambda e, what: None)
    assert attempts == [1]
    # the cap, not the user's setting: "raise retry_deadline_s (now 0 s)" named a value no option holds
    assert "this check waits 0 s at most, whatever retry_deadline_s says" in str(gave_up.value), gave_up.value


def test_an_emptied_object_under_its_sidecar_loads_the_published_local_copy(root: str, tmp_path: Path) -> None:
    """The object emptied (0 bytes) while its sidecar still names this node's burst-buffer save:
    since the object's own tail is read, the home was read first, failed, and the fallback found no
    group to vouch for the copy, compared 0 bytes and refused it (CorruptCheckpointError), although
    the sidecar publishes exactly that save (docs/burst-buffer.md: a remote object corrupted after
    upload loads the verified local copy). The sidecar vouches for it, as a group's manifest does."""
    _save(root, tmp_path / "bb", 5, name="last.pt")
    fsspec.filesystem("memory").pipe(_key(f"{root}/last.pt"), b"")
    with fastckpt.Checkpointer(local_dir=str(tmp_path / "bb")) as ck:
        assert ck.load(f"{root}/last.pt")["step"] == 5
        assert ck.stats().last_restore_from == "local"


def test_a_damaged_sidecar_cannot_say_whether_the_burst_buffer_copy_stands_in(root: str, tmp_path: Path) -> None:
    """Whether the burst-buffer copy may stand in for the damaged object at its URL
    (``fallback.local_where``) reads the sidecar as ``load.verdict`` and ``load.published`` do,
    through the one ``fallback.home_sidecar``. It had its own copy of that read and took a
    damaged sidecar as a verdict against the copy (another save: refused), where the other two
    take it as saying nothing; then the bytes decide, as without a sidecar: what the object cut
    short still holds is the copy's, so the copy stands in. Within a load ``verdict.compare``
    reads the sidecar first and, when it is damaged, reads the copy first: the same rule."""
    from fastckpt.storage.homes import Homes

    _save(root, tmp_path / "bb", 1)
    fs, url = fsspec.filesystem("memory"), f"{root}/ckpt-1.pt"
    fs.pipe(_key(url), fs.cat(_key(url))[:1000])  # cut short: this save's, damaged
    [copy] = (tmp_path / "bb").rglob("ckpt-1.pt")
    homes = Homes()
    home, local = homes.resolve(url), homes.resolve(str(copy))
    for sidecar in (b"{ not json", None):
        if sidecar is None:
            fs.rm(_key(url + SIDECAR))
        else:
            fs.pipe(_key(url + SIDECAR), sidecar)
        with fallback.one_load():
            assert fallback.local_where(local, home, lambda home, ours: None) == "local"  # was: "local (another save)"
    fs.pipe(_key(url), bytes(1000))  # zeroed: it proves nothing, with or without a sidecar
    fs.pipe(_key(url + SIDECAR), b"{ not json")
    with fallback.one_load():
        assert fallback.local_where(local, home, lambda home, ours: None) == "local (another save)"
    homes.close()
