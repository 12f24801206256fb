"""``Checkpointer.reading(group)``: a reader that loads a group's files one at a time while the
same tag is saved again and swapped in gets ``GroupChangedError``, never files of two saves
(docs/groups.md#reading-a-group-while-it-is-saved-again). Simulated ranks in one process, no store."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.errors import GroupChangedError, IncompleteCheckpointError


def _state(version: int, rank: int) -> dict:
    return {"w": torch.arange(64, dtype=torch.int64) * version + rank, "version": version}


def _save(g: Path, version: int) -> None:
    """Both ranks save their file of ``version`` into ``g`` and commit (a re-save swaps it in)."""
    cks = [fastckpt.Checkpointer(rank=r, world_size=2, commit_timeout_s=60) for r in (0, 1)]
    try:
        for ck in cks:
            ck.save(_state(version, ck.rank), str(g / f"rank{ck.rank}.pt"), group=str(g))
        for h in [ck.commit(str(g), step=version) for ck in cks]:
            h.wait(60)
    finally:
        for ck in cks:
            ck.close()


def test_a_resave_between_two_loads_of_one_reading_raises_instead_of_mixing(tmp_path: Path) -> None:
    g = tmp_path / "step-1"
    _save(g, 1)
    with fastckpt.Checkpointer(rank=0, world_size=1) as reader:
        with reader.reading(str(g)) as manifest:
            assert sorted(manifest["files"]) == ["rank0.pt", "rank1.pt"] and manifest["step"] == 1
            assert reader.load(str(g / "rank0.pt"))["version"] == 1
            _save(g, 2)  # another job saves the same tag again: swapped in between the two loads
            with pytest.raises(GroupChangedError, match=r"rank1\.pt is not the file group .*step-1 held") as info:
                reader.load(str(g / "rank1.pt"))
            assert "load the group again" in str(info.value)
        with reader.reading(str(g)):  # a new reading: the new save, whole
            assert [reader.load(str(g / f"rank{r}.pt"))["version"] for r in (0, 1)] == [2, 2]


def test_within_a_reading_a_file_of_the_new_save_is_refused_even_as_the_first_load(tmp_path: Path) -> None:
    g = tmp_path / "step-1"
    _save(g, 1)
    with fastckpt.Checkpointer(rank=0, world_size=1) as reader:
        with reader.reading(str(g)):
            _save(g, 2)
            for r in (0, 1):
                with pytest.raises(GroupChangedError):
                    reader.load(str(g / f"rank{r}.pt"))
        assert reader.load(str(g / "rank1.pt"))["version"] == 2  # outside a reading: each file on its own


def test_a_reading_pins_only_its_group_and_its_thread(tmp_path: Path) -> None:
    import threading

    g, other = tmp_path / "step-1", tmp_path / "step-2"
    _save(g, 1)
    _save(other, 1)
    with fastckpt.Checkpointer(rank=0, world_size=1) as reader:
        with reader.reading(str(g)) as outer, reader.reading(str(g) + "/") as inner:
            assert inner is outer  # nested: the outer pin holds
            _save(other, 2)  # another group: not pinned
            assert reader.load(str(other / "rank0.pt"))["version"] == 2
            _save(g, 2)
            seen: list[int] = []  # another thread's loads are not pinned by this one's reading
            t = threading.Thread(target=lambda: seen.append(reader.load(str(g / "rank0.pt"))["version"]))
            t.start()
            t.join()
            assert seen == [2]
            with pytest.raises(GroupChangedError):
                reader.load(str(g / "rank0.pt"))


def test_reading_a_group_that_is_not_published_raises(tmp_path: Path) -> None:
    with fastckpt.Checkpointer(rank=0, world_size=2, commit_timeout_s=60) as ck:
        g = tmp_path / "step-1"
        ck.save(_state(1, 0), str(g / "rank0.pt"), group=str(g)).wait(60)  # rank 1 never saves nor commits
        with pytest.raises(IncompleteCheckpointError, match="step-1"):
            with ck.reading(str(g)):
                pass
        with pytest.raises(IncompleteCheckpointError):
            with ck.reading(str(tmp_path / "never")):
                pass



def test_a_reading_at_a_url_checks_every_file_even_from_the_burst_buffer(tmp_path: Path) -> None:
    """At a URL, loads read the burst-buffer copies of the same save (same checksums): they pass;
    a file whose checksum is not the pinned one is refused (here: the pinned entry altered)."""
    import uuid

    g = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run/step-1"
    with fastckpt.Checkpointer(rank=0, world_size=1, local_dir=str(tmp_path / "nvme")) as ck:
        for r in (0, 1):
            ck.save(_state(1, r), f"{g}/rank{r}.pt", group=g)
        ck.commit(g).wait(60)
        with ck.reading(g) as manifest:
            assert ck.load(f"{g}/rank0.pt")["version"] == 1
            assert ck.stats().last_restore_from == "local"
            manifest["files"]["rank1.pt"]["checksum"] = "0" * 16  # as if another save were published since
            manifest["attempt"] = "an earlier attempt"
            with pytest.raises(GroupChangedError, match=r"rank1\.pt is not the file group memory://"):
                ck.load(f"{g}/rank1.pt")


@pytest.mark.parametrize("within", ["within a reading", "outside a reading"])
def test_a_file_read_while_its_group_is_swapped_is_never_called_another_attempts(
        tmp_path: Path, monkeypatch, within: str) -> None:
    """The file's bytes are read, then the tag's re-save is swapped in before its group manifest
    is read: the file (of the save published when the read began) was reported "left by another
    attempt" (helper review D4). Within a reading it is the pinned save's file, and loads; outside
    one the load reads the file again and gets the new save's."""
    from fastckpt.storage.posix import PosixTarget

    g = tmp_path / "step-1"
    _save(g, 1)
    real, swapped = PosixTarget.read_object, threading.Event()

    def racing(self: PosixTarget, key: str, **kw: object) -> object:
        res = real(self, key, **kw)
        if key.endswith("rank0.pt") and not swapped.is_set():  # after the file's bytes, before its group's manifest
            swapped.set()
            _save(g, 2)
        return res

    monkeypatch.setattr(PosixTarget, "read_object", racing)
    with fastckpt.Checkpointer(rank=0, world_size=1) as reader:
        if within == "within a reading":
            with reader.reading(str(g)):
                assert reader.load(str(g / "rank0.pt"))["version"] == 1  # the pinned save's file, whole
                with pytest.raises(GroupChangedError):
                    reader.load(str(g / "rank1.pt"))
        else:
            assert reader.load(str(g / "rank0.pt"))["version"] == 2
    assert swapped.is_set()


def _outcome(ck: fastckpt.Checkpointer, path: Path) -> str:
    try:
        return f"version {ck.load(str(path))['version']}"
    except Exception as exc:  # noqa: BLE001 (the outcome compared is the error's type)
        return type(exc).__name__


@pytest.mark.parametrize("case", ["verified copy", "standalone file", "file moved over another",
                                  "left by another attempt"])
def test_a_reading_judges_the_group_files_as_a_load_outside_one_does(tmp_path: Path, case: str) -> None:
    """Within a reading every file in the group's directory was refused as "saved again and
    swapped in since", though the group never changed (helper review H3): a verified copy at a
    path the group names nothing at, a standalone file, a file moved over another (damage), one
    left by another attempt. Judged by the pinned manifest, each ends as it does outside one."""
    g = tmp_path / "step-1"
    _save(g, 1)
    if case == "verified copy":
        (g / "backup").mkdir()
        (g / "backup" / "rank1.pt").write_bytes((g / "rank1.pt").read_bytes())
        path, want = g / "backup" / "rank1.pt", "version 1"
    elif case == "standalone file":
        with fastckpt.Checkpointer() as ck:
            ck.save(_state(7, 0), str(g / "extra.pt")).wait()
        path, want = g / "extra.pt", "version 7"
    elif case == "file moved over another":
        (g / "rank1.pt").write_bytes((g / "rank0.pt").read_bytes())
        path, want = g / "rank1.pt", "CorruptCheckpointError"
    else:  # a save of the same tag elsewhere, its file put here: this group's published manifest names another
        _save(tmp_path / "other" / "step-1", 2)
        (g / "rank1.pt").write_bytes((tmp_path / "other" / "step-1" / "rank1.pt").read_bytes())
        path, want = g / "rank1.pt", "NotPublishedError"
    with fastckpt.Checkpointer() as ck:
        assert _outcome(ck, path) == want
        with ck.reading(str(g)):
            assert _outcome(ck, path) == want
            assert _outcome(ck, g / "rank0.pt") == "version 1"
