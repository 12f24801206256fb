"""A file of a published group replaced by a plain ``torch.save`` file (no fastckpt manifest) is
damage, never a file to load unverified: the group's manifest records what it must be
(``load.named``). With a burst buffer whose copy is the one the group records, that copy loads."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import uuid
from contextlib import redirect_stdout
from pathlib import Path

import fsspec
import pytest
import torch

import fastckpt
from fastckpt import CorruptCheckpointError
from fastckpt.cli.drill_job import restore
from tests.helpers import flip_byte


def _group(g: Path | str, local_dir: Path | None = None) -> None:
    """Group ``g`` of a.pt (full of 1) and sub/b.pt (full of 2), committed; the burst-buffer copies
    stay in ``local_dir`` when one is given."""
    with fastckpt.Checkpointer(local_dir=str(local_dir) if local_dir else None) as ck:
        ck.save({"w": torch.full((4096,), 1.0)}, f"{g}/a.pt", group=str(g))
        ck.save({"w": torch.full((4096,), 2.0)}, f"{g}/sub/b.pt", group=str(g))
        ck.commit(str(g), step=5).wait()


def _replace(path: Path) -> None:
    torch.save({"w": torch.full((4096,), -1.0)}, path)  # another state, as a plain torch.save writes it


def _says(exc: pytest.ExceptionInfo, path: Path, group: Path) -> None:
    msg = str(exc.value)
    assert type(exc.value) is CorruptCheckpointError  # damage, not "unverifiable" (verify=True said that)
    assert f"{path} has no fastckpt manifest" in msg
    assert f"checkpoint group {group} published" in msg
    assert "Restore" in msg and "load an earlier checkpoint" in msg


@pytest.mark.parametrize("verify", [False, True], ids=["default", "verify"])
def test_plain_file_over_a_group_file_is_damage(tmp_path, verify: bool) -> None:
    """It loaded unverified with a WARNING (verify=False), or was refused as a plain file one
    may accept with verify=False (verify=True): either way the damage went unnamed."""
    g = tmp_path / "step-5"
    _group(g)
    for rel in ("a.pt", "sub/b.pt"):
        _replace(g / rel)
        with pytest.raises(CorruptCheckpointError) as exc:
            fastckpt.load(str(g / rel), verify=verify)
        _says(exc, g / rel, g)


def test_into_is_left_alone(tmp_path) -> None:
    """The check comes before the bytes are read into the caller's tensors."""
    g = tmp_path / "step-5"
    _group(g)
    _replace(g / "a.pt")
    mine = torch.zeros(4096)
    with pytest.raises(CorruptCheckpointError):
        fastckpt.load(str(g / "a.pt"), into={"w": mine})
    assert torch.equal(mine, torch.zeros(4096))


def test_within_reading(tmp_path) -> None:
    """``Pins.check`` returned at once for a file without a manifest of its own."""
    g = tmp_path / "step-5"
    _group(g)
    _replace(g / "a.pt")
    with fastckpt.Checkpointer() as ck, ck.reading(str(g)):
        assert ck.load(str(g / "sub/b.pt"))["w"][0].item() == 2.0
        with pytest.raises(CorruptCheckpointError) as exc:
            ck.load(str(g / "a.pt"))
    _says(exc, g / "a.pt", g)


def test_a_users_own_file_in_the_group_loads_unverified(tmp_path, caplog) -> None:
    """A plain file the group's manifest does not name is the user's: it loads as before."""
    g = tmp_path / "step-5"
    _group(g)
    torch.save({"note": 7}, g / "sub" / "extra.pt")
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        assert fastckpt.load(str(g / "sub" / "extra.pt")) == {"note": 7}
    assert "has no fastckpt manifest" in caplog.text


@pytest.mark.parametrize("reading", [False, True], ids=["load", "reading"])
def test_burst_buffer_copy_loads_instead(tmp_path, reading: bool) -> None:
    """The burst-buffer copy the group records is loaded, verified; the plain home file was
    preferred to it (a plain zip there was taken for another save of the path)."""
    g, bb = tmp_path / "home" / "step-5", tmp_path / "bb"
    _group(g, bb)
    _replace(g / "a.pt")
    with fastckpt.Checkpointer(local_dir=str(bb)) as ck:
        if reading:
            with ck.reading(str(g)):
                got = ck.load(str(g / "a.pt"))
        else:
            got = ck.load(str(g / "a.pt"))
        assert torch.equal(got["w"], torch.full((4096,), 1.0))
        assert ck.stats().last_restore_from == "local"


def test_damaged_burst_buffer_copy_and_plain_home_file(tmp_path) -> None:
    """No copy is the group's file: damage, naming the home file and its group."""
    g, bb = tmp_path / "home" / "step-5", tmp_path / "bb"
    _group(g, bb)
    _replace(g / "a.pt")
    (local,) = [p for p in bb.rglob("a.pt")]
    flip_byte(str(local), 100)
    with fastckpt.Checkpointer(local_dir=str(bb)) as ck, pytest.raises(CorruptCheckpointError) as exc:
        ck.load(str(g / "a.pt"))
    _says(exc, g / "a.pt", g)


def test_framework_file_rewritten_is_damage(tmp_path) -> None:
    """A framework's plain file of the group (megatron's common.pt) loads while its bytes are the
    ones committed, and is damage once they are not."""
    from fastckpt.format.checksum import checksum_bytes

    g = tmp_path / "iter_5"
    buf = io.BytesIO()
    torch.save({"iteration": 5}, buf)
    with fastckpt.Checkpointer() as ck:
        ck.save({"w": torch.ones(4)}, f"{g}/a.pt", group=str(g))
        (g / "common.pt").write_bytes(buf.getvalue())
        ck.commit(str(g), step=5, framework_files={"common.pt": checksum_bytes(buf.getvalue())}).wait()
    assert fastckpt.load(str(g / "common.pt")) == {"iteration": 5}
    torch.save({"iteration": 6}, g / "common.pt")
    with pytest.raises(CorruptCheckpointError, match=f"not the file checkpoint group {g} committed as 'common.pt'"):
        fastckpt.load(str(g / "common.pt"))


def test_verify_cli_names_the_replaced_file(tmp_path) -> None:
    g = tmp_path / "step-5"
    _group(g)
    _replace(g / "a.pt")
    r = subprocess.run([sys.executable, "-m", "fastckpt", "verify", str(g), "--json"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert [b["path"] for b in json.loads(r.stdout)["bad"]] == [str(g / "a.pt")]


def test_drill_probe_reports_the_replaced_file_corrupt(tmp_path) -> None:
    """The drill's restore probe counted such a group as restored and verified."""
    home = tmp_path / "home"
    _group(home / "step-00000005")
    _replace(home / "step-00000005" / "a.pt")
    out = io.StringIO()
    with fastckpt.Checkpointer() as ck, redirect_stdout(out):
        step, _ = restore(ck, str(home), None, None)
    restored = [e for e in map(json.loads, out.getvalue().splitlines()) if e["ev"] == "restored"]
    assert step == -1
    assert restored[0]["corrupt"] is True and restored[0]["verified"] is False
    assert "CorruptCheckpointError" in restored[0]["error"]


@pytest.fixture()
def url() -> str:
    root = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run"
    yield root
    fsspec.filesystem("memory").rm(root[len("memory://"):], recursive=True)


@pytest.mark.parametrize("how", ["load", "prefetch", "burst buffer"])
def test_at_a_url(url: str, tmp_path: Path, how: str) -> None:
    """An object store (fsspec's memory://, the same Target code as a bucket): the object of a
    group's file replaced by a plain torch.save file is damage, also when a prefetch downloads
    it; the burst-buffer copy the group records loads instead."""
    g, bb = f"{url}/step-5", tmp_path / "bb"
    _group(g, bb)
    buf = io.BytesIO()
    torch.save({"w": torch.full((4096,), -1.0)}, buf)
    fsspec.filesystem("memory").pipe_file(f"{g}/a.pt"[len("memory://"):], buf.getvalue())
    with fastckpt.Checkpointer(local_dir=str(tmp_path / ("bb" if how == "burst buffer" else "fresh"))) as ck:
        if how == "burst buffer":
            assert torch.equal(ck.load(f"{g}/a.pt")["w"], torch.full((4096,), 1.0))
            return
        with pytest.raises(CorruptCheckpointError) as exc:
            ck.load(f"{g}/a.pt", prefetch=how == "prefetch")
    msg = str(exc.value)
    assert f"{g}/a.pt has no fastckpt manifest" in msg and f"checkpoint group {g} published 'a.pt'" in msg


def test_a_folder_above_the_user_may_not_read_leaves_a_plain_file_plain(tmp_path, monkeypatch) -> None:
    """The search for the group naming a plain file reads the manifests of the folders above it; one
    the user may not read (at a URL, a folder outside a prefix-scoped key: AccessDenied) failed the
    load of the user's own plain file. The search stops there. A damaged manifest still raises: it
    may be the file's own group's, and a replaced file must not load because its group's manifest
    is damaged too (tests run as root here, so the refusal is injected where the manifest is read)."""
    from fastckpt.load import named
    from fastckpt.storage.types import TargetPermissionError

    plain = tmp_path / "runs" / "mine" / "plain.pt"
    plain.parent.mkdir(parents=True)
    torch.save({"w": torch.ones(3)}, plain)
    read = named.home_group

    def scoped(place):  # noqa: ANN001, ANN202
        if not place.url().startswith(str(plain.parent)):
            raise TargetPermissionError(f"read of {place.url('fastckpt-manifest.json')}: AccessDenied")
        return read(place)

    monkeypatch.setattr(named, "home_group", scoped)
    assert torch.equal(fastckpt.load(str(plain))["w"], torch.ones(3))  # unverified, as before
    monkeypatch.setattr(named, "home_group", read)
    group = tmp_path / "step-5"
    with fastckpt.Checkpointer(rank=0, world_size=1) as ck:
        ck.save({"w": torch.zeros(3)}, str(group / "a.pt"), group=str(group))
        ck.commit(str(group), step=5).wait()
    torch.save({"w": -torch.ones(3)}, group / "a.pt")  # replaced, and the group's manifest damaged too
    (group / "fastckpt-manifest.json").write_text("{ not json")
    with pytest.raises(CorruptCheckpointError):
        fastckpt.load(str(group / "a.pt"))
