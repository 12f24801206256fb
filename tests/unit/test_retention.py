"""Retention's lists against real files: a name being saved again is never trimmed."""

from __future__ import annotations

from pathlib import Path

from fastckpt.save.retention import Retention
from fastckpt.storage.homes import Homes


def _copies(local: Path):  # noqa: ANN202
    def copies(name: str) -> list[str]:
        p = local / Path(name).name
        return [str(p)] if p.exists() else []
    return copies


def test_a_name_being_saved_again_is_not_trimmed_until_that_save_is_durable(tmp_path: Path) -> None:
    home, local = tmp_path / "home", tmp_path / "nvme"
    home.mkdir(), local.mkdir()
    names = [str(home / f"g{i}") for i in range(2)]
    for n in names:
        Path(n).mkdir()
        (local / Path(n).name).mkdir()
    r = Retention(1, None, Homes(), _copies(local))
    r.durable(names[0], has_local=True, owns_persistent=True)
    r.replacing(names[0])  # a new attempt at g0 writes into its burst-buffer directory
    r.durable(names[1], has_local=True, owns_persistent=True)
    assert (local / "g0").exists()  # before: trimmed here, under the save writing into it
    r.durable(names[0], has_local=True, owns_persistent=True)  # that save is durable: g0 is the newest
    assert (local / "g0").exists() and not (local / "g1").exists()
