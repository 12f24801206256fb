"""A committed group damaged after its commit in ways a load and ``fastckpt verify`` can tell
apart: its ``fastckpt-manifest.json``, a file's own manifest (in the file's last bytes), a file of
another save copied over one of its own. Each error says what happened and the way forward, as
a missing or damaged data byte does (``test_load_missing.py``). Before, the first two said only
"does not parse" / "the manifest's bytes do not match its sum: damaged", and verify reported the
third as "N bytes, but M were committed" (a file cut short or grown)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import fastckpt
from fastckpt.cli import cli
from fastckpt.commit.protocol import GROUP_MANIFEST
from fastckpt.errors import CorruptCheckpointError


def _two_groups(root: Path, n: int = 1000) -> tuple[str, str]:
    groups = (str(root / "step-1"), str(root / "step-2"))
    with fastckpt.Checkpointer(rank=0, world_size=1, overhead_budget=0.99) as ck:
        for step, g in enumerate(groups, 1):
            for i, name in enumerate(("a.pt", "b.pt")):
                ck.save({"w": torch.full((n * step,), float(10 * step + i))}, f"{g}/{name}", group=g)
            ck.commit(g, step=step).wait()
    return groups


def _verify(root: Path) -> tuple[int, dict[str, str]]:
    res = CliRunner().invoke(cli, ["verify", "--json", str(root)])
    return res.exit_code, {b["path"]: b["problem"] for b in json.loads(res.stdout)["bad"]}


@pytest.mark.parametrize("how", ["emptied", "one byte changed"])
def test_a_damaged_group_manifest_names_the_way_forward(tmp_path: Path, how: str) -> None:
    root = tmp_path / "run"
    g1, g2 = _two_groups(root)
    manifest = Path(g2) / GROUP_MANIFEST
    data = manifest.read_bytes()
    manifest.write_bytes(b"" if how == "emptied" else data.replace(b'"step":2', b'"step":3'))
    with pytest.raises(CorruptCheckpointError) as ei:
        fastckpt.load(f"{g2}/b.pt")
    said = str(ei.value)
    assert str(manifest) in said and "cannot be loaded" in said, said
    assert "restore the manifest from another copy of the group" in said, said
    assert f"resume from the checkpoint before it, which `fastckpt latest {root}` prints" in said, said
    res = CliRunner().invoke(cli, ["latest", str(root)])  # the advice holds: it names the group before
    assert res.exit_code == 0 and res.stdout.strip() == g1 == fastckpt.latest(str(root))


def test_a_files_damaged_own_manifest_names_its_group_and_the_way_forward(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _, g2 = _two_groups(root)
    path = Path(g2) / "b.pt"
    data = bytearray(path.read_bytes())
    data[data.rfind(b'"rank":') + len(b'"rank":')] ^= 1  # rank 0 -> 1 inside the file's own manifest
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError) as ei:
        fastckpt.load(str(path))
    said = str(ei.value)
    assert f"{path} has a damaged manifest of its own (in its last bytes: the manifest's bytes do not match" in said
    assert f"committed group {g2} recorded: it changed after its commit" in said, said
    assert "Restore the file from another copy" in said and "resume from the checkpoint before it" in said, said
    code, bad = _verify(root)
    assert code == 1 and list(bad) == [str(path)], bad
    assert bad[str(path)].startswith("its own manifest (in its last bytes) is damaged: the manifest's bytes"), bad
    assert f"its checkpoint {g2} committed it whole" in bad[str(path)], bad
    assert "copy it again from a good copy" in bad[str(path)], bad


def test_verify_names_a_file_of_another_save_copied_over_a_groups_own(tmp_path: Path) -> None:
    root = tmp_path / "run"
    g1, g2 = _two_groups(root, n=100000)
    shutil.copyfile(f"{g1}/b.pt", f"{g2}/b.pt")  # another size: before, "N bytes, but M were committed"
    shutil.copyfile(f"{g1}/b.pt", f"{g1}/a.pt")  # its group's other file, same size: before, a checksum mismatch
    with pytest.raises(CorruptCheckpointError) as ei:
        fastckpt.load(f"{g2}/b.pt")
    code, bad = _verify(root)
    assert code == 1 and sorted(bad) == [f"{g1}/a.pt", f"{g2}/b.pt"], bad
    assert str(ei.value) == f"{g2}/b.pt {bad[f'{g2}/b.pt']}"  # what load says, as load says it
    for path, written_as in ((f"{g2}/b.pt", "'b.pt' of group 'step-1'"), (f"{g1}/a.pt", "'b.pt' of group 'step-1'")):
        assert f"it was written as {written_as} and moved or copied here, over the group's own file" in bad[path]
        assert "Restore that file from another copy" in bad[path], bad
