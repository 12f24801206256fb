"""Retention's lists against real files: a name being saved again is never trimmed."""

from __future__ import annotations

import os
from pathlib import Path

from fastckpt.save.retention import Retention
from fastckpt.save.stripes import Stripes
from fastckpt.storage.homes import Homes
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
