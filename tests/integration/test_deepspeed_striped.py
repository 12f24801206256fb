"""DeepSpeed with an ``s3://`` ``save_dir`` and a burst buffer striped over two drives: a tag
whose files lie on both drives resumes on the node that saved it.

DeepSpeed globs and opens one directory, the first drive's mirror of the URL, so a model file
that striping put on the other drive was not found: ``load_checkpoint`` raised "... does not
exist (deleted since it was saved)" on every restart of that node, though the tag was
committed and every file was at the home and on the node. Real engine, real SeaweedFS, two
processes (save, then a restart that loads)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from tests.s3server import S3Server  # noqa: E402

from .test_deepspeed import REPO, ds_env  # noqa: E402

WORKER = str(Path(__file__).with_name("_deepspeed_striped_worker.py"))


def _run(phase: str, url: str, drives: list[str], opts: dict) -> dict:
    proc = subprocess.run([sys.executable, WORKER, phase, url, json.dumps(drives), json.dumps(opts)], env=ds_env(),
                          cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def test_a_tag_striped_over_two_drives_resumes_on_the_node_that_saved_it(tmp_path: Path, s3_server: S3Server) -> None:
    url = f"s3://{s3_server.make_bucket()}/run"
    drives = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    opts = s3_server.storage_options()
    _run("save", url, drives, opts)
    where = {d: _files(d, "global_step2") for d in drives}
    on = [d for d in drives if "mp_rank_00_model_states.pt" in where[d]]
    assert on == [drives[1]], where  # striping put the model file on drive 1 (its links are not counted)
    got = _run("load", url, drives, opts)
    assert got["global_steps"] == 2 and "global_step2" in got["path"], got
    for top, _, _ in os.walk(drives[1]):  # drive 1's copy goes (trimmed, a drive swapped): the link dangles
        if os.path.basename(top) == "global_step2":
            shutil.rmtree(top)
            break
    got = _run("load", url, drives, opts)  # the file is downloaded in its stead
    assert got["global_steps"] == 2 and "global_step2" in got["path"], got


def _files(drive: str, tag: str) -> list[str]:
    return [f for top, _, fs in os.walk(drive) if os.path.basename(top) == tag for f in fs
            if not os.path.islink(os.path.join(top, f))]
