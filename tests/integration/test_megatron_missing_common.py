"""A committed fastckpt Megatron checkpoint whose ``common.pt`` was deleted.

The common loader handed a missing ``common.pt`` to megatron-core's own loader, whose error path
calls ``checkpoint_dir.iterdir()`` on the str directory ``dist_checkpointing.load`` passes: the
user saw ``AttributeError: 'str' object has no attribute 'iterdir'``, naming neither the file nor
the fix. The committed bytes are kept in the group's index, so the load now reads them (and says
the file is missing); only an index that cannot give them back is an error, naming the file.
Real megatron-core, gloo, one process (a child: it owns the process group)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from fastckpt.errors import CheckpointNotFoundError  # noqa: E402
from tests.integration._megatron_one_rank import PREAMBLE  # noqa: E402

CHILD = PREAMBLE + r"""
w = torch.arange(64.0).reshape(8, 8)
dc.save({"w": ShardedTensor.from_rank_offsets("w", w.clone()), "iteration": 5}, ck_dir, ("fastckpt", 1))
os.remove(os.path.join(ck_dir, "common.pt"))
try:
    got = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 8))}, ck_dir)
    print("LOADED", got["iteration"], torch.equal(got["w"], w), flush=True)
except Exception as exc:
    print("LOADED", type(exc).__name__, str(exc)[:300], flush=True)
ck.close()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def deleted(tmp_path_factory, megatron_python) -> tuple[Path, subprocess.CompletedProcess]:
    ck_dir = tmp_path_factory.mktemp("missing-common") / "iter_0000005"
    ck_dir.mkdir()
    res = megatron_python.run_code(CHILD, [str(ck_dir)], 300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return ck_dir, res


def test_a_deleted_common_pt_loads_the_committed_bytes_from_the_index(deleted) -> None:
    ck_dir, res = deleted
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("LOADED")), res.stderr[-3000:])
    assert line == "LOADED 5 True", line  # was: LOADED AttributeError 'str' object has no attribute 'iterdir'
    assert f"{ck_dir / 'common.pt'} is missing" in res.stderr, res.stderr[-3000:]
    assert "repair_checkpoint" in res.stderr, res.stderr[-3000:]


def test_a_deleted_common_pt_the_index_cannot_give_back_is_named(deleted) -> None:
    import fastckpt.integrations.megatron as fm

    ck_dir, _ = deleted
    os.remove(ck_dir / "fastckpt-index.pt")
    with pytest.raises(CheckpointNotFoundError, match=r"common\.pt is missing, and .*fastckpt-index\.pt") as info:
        fm.FastCkptCommonLoadStrategy().load_common(str(ck_dir))  # a str, as dist_checkpointing.load passes it
    assert "load an earlier checkpoint" in str(info.value)
