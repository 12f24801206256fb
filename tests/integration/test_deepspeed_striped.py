"""DeepSpeed with an ``s3://`` ``save_dir`` and a burst buffer striped over two drives: a tag
whose files lie on both drives resumes on the node that saved it.

DeepSpeed globs and opens one directory, the first drive's mirror of the URL, so a model file
that striping put on the other drive was not found: ``load_checkpoint`` raised "... does not
exist (deleted since it was saved)" on every restart of that node, though the tag was
committed and every file was at the home and on the node. Real engine, real SeaweedFS, three
processes (save, then a restart that loads, then one more after drive 1's copy is deleted),
forked by ``_fork_launcher.py`` from one that imported torch and DeepSpeed once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from tests.s3server import S3Server  # noqa: E402

from ._fork_launcher import launch  # noqa: E402
from .test_deepspeed import REPO, ds_env  # noqa: E402


def _lines(out: str, prefix: str) -> list[dict]:
    return [json.loads(ln[len(prefix):]) for ln in out.splitlines() if ln.startswith(prefix)]


def test_a_tag_striped_over_two_drives_resumes_on_the_node_that_saved_it(tmp_path: Path, s3_server: S3Server) -> None:
    url = f"s3://{s3_server.make_bucket()}/run"
    drives = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    opts = s3_server.storage_options()
    # 0: save; 1: a restart loads; 2: drive 1's copy goes (trimmed, a drive swapped), the link on drive 0
    # dangles, and the file is downloaded in its stead
    run = launch("tests.integration._deepspeed_striped_worker", 1, 3, [url, json.dumps(drives), json.dumps(opts)],
                 ds_env(), str(REPO), timeout_s=600)
    assert [g["exitcodes"] for g in run.generations] == [[0], [0], [0]], run.output[-8000:]
    (where,) = _lines(run.output, "WHERE ")
    on = [d for d in drives if "mp_rank_00_model_states.pt" in where[d]]
    assert on == [drives[1]], where  # striping put the model file on drive 1 (its links are not counted)
    saved, *loads = _lines(run.output, "RESULT ")
    assert saved == {} and len(loads) == 2, run.output[-8000:]
    for got in loads:
        assert got["global_steps"] == 2 and "global_step2" in got["path"], got
