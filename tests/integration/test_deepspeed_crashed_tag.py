"""A tag a killed run had started, saved again by a restart on fewer ranks, with a store
(torch.distributed's, as under torchrun: no rank markers): the dead run's files must not stay in
the tag the restart publishes (``_deepspeed_crashed_tag_worker.py``: real DeepSpeed engines,
forked ranks on gloo, SIGKILL)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

import fastckpt  # noqa: E402
from fastckpt.commit.protocol import GROUP_MANIFEST, MARKER_DIR  # noqa: E402

from ._fork_launcher import launch  # noqa: E402
from .test_deepspeed import REPO, ds_env  # noqa: E402

WORKER = "tests.integration._deepspeed_crashed_tag_worker"
STALE = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


@pytest.mark.slow
def test_a_killed_attempt_at_a_tag_is_cleared_before_a_smaller_restart_saves_it(tmp_path: Path) -> None:
    """Before, rank 0 cleared a tag only when it held rank markers or a manifest: a store's ranks
    write no markers, so the killed run's zero_pp_rank_1 file stayed in the tag the restart
    committed, and DeepSpeed's zero_to_fp32 refused it ("found 2 files")."""
    crash = launch(WORKER, 2, 1, [str(tmp_path), "crash"], ds_env(), str(REPO))
    assert sorted(crash.generations[0]["exitcodes"])[0] == -9, crash.output[-8000:]
    save_dir, tag = tmp_path / "ckpt", tmp_path / "ckpt" / "global_step2"
    assert (tag / STALE).exists() and not (tag / GROUP_MANIFEST).exists(), sorted(os.listdir(tag))
    assert not (tag / MARKER_DIR).exists() or not os.listdir(tag / MARKER_DIR)  # a store's ranks write none

    resume = launch(WORKER, 1, 1, [str(tmp_path), "resume"], ds_env(), str(REPO))
    assert resume.generations[0]["exitcodes"] == [0], resume.output[-8000:]
    assert fastckpt.latest(str(save_dir)) == str(tag)
    assert not (tag / STALE).exists(), sorted(os.listdir(tag))
    assert json.loads((tmp_path / "resume.json").read_text())["loaded"].startswith(f"{save_dir}/global_step1/")
    published = json.loads((tag / GROUP_MANIFEST).read_text())
    on_disk = {str(p.relative_to(tag)) for p in tag.rglob("*") if p.is_file()
               and not p.name.startswith(".") and MARKER_DIR not in p.parts and p.name != GROUP_MANIFEST}
    assert on_disk == set(published["files"]), (on_disk, sorted(published["files"]))
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    assert get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag="global_step2")  # before: "found 2 files"
