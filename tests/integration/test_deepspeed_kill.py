"""Crash-safe resume: a 2-process ZeRO-2 run is SIGKILLed at random moments and resumes with
``engine.load_checkpoint(save_dir)`` each time (``_deepspeed_kill_worker.py``).

One launch per generation: a rank SIGKILLs itself at a random moment, the launcher stops the
other (SIGTERM, as torchrun does), and the next generation resumes. The ranks are forked by
``_fork_launcher.py`` from one process that imported torch, DeepSpeed and torch._dynamo once:
under torchrun each generation spent about 11 of its 14 s on those imports (the two modes took
almost 5 minutes of the suite); after the fork each rank runs as a torchrun rank does (its
environment, gloo over loopback, the real engine and signals). Every resume must load the
newest complete tag: never an incomplete one (an error or mixed weights), never one older than
a checkpoint already reported committed, and always the one DeepSpeed's ``latest`` and
``fastckpt.latest`` name. Twice: with ``save_dir`` a directory, and an ``s3://`` URL on a real
SeaweedFS server through the burst buffer, where a kill also lands in uploads and their
verification. With a directory, every other generation saves with the lazy snapshot: a resume
from one of its checkpoints checks the weights against the hash taken at the save, before the
next step changed them beside the copy.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

import fastckpt  # noqa: E402
from fastckpt.commit.protocol import GROUP_MANIFEST  # noqa: E402
from fastckpt.storage.s3_options import store_tag  # noqa: E402
from fastckpt.urls import mirror_path  # noqa: E402

from ._fork_launcher import launch  # noqa: E402
from .test_deepspeed import REPO, ds_env  # noqa: E402

MODES = ("posix", "s3")

KILLS = 10


def _last_phase(events: Path) -> str:
    """The phase the kill interrupted: the last event the victim logged whole (the kill may tear
    the line it was writing: what follows the last newline is no event)."""
    lines = events.read_text().split("\n")[:-1] if events.exists() else []
    return json.loads(lines[-1])["name"] if lines else "none"


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_sigkill_at_random_moments_always_resumes_from_a_complete_tag(tmp_path: Path, mode: str,
                                                                       request: pytest.FixtureRequest) -> None:
    save_dir, opts, env = str(tmp_path / "ckpt"), None, {}
    if mode == "s3":
        server = request.getfixturevalue("s3_server")
        bucket, opts = server.make_bucket(), server.storage_options()
        save_dir = f"s3://{bucket}/run"
        env["FASTCKPT_TEST_S3"] = json.dumps({"bucket": bucket, "storage_options": opts})
    run = launch("tests.integration._deepspeed_kill_worker", 2, KILLS + 1, [str(tmp_path), str(KILLS)],
                 ds_env(**env), str(REPO))
    for g in run.generations[:KILLS]:  # the victim, rank gen % 2, died of its own SIGKILL
        assert g["exitcodes"][g["gen"] % 2] == -9 and not g["hung"], (g, run.output[-8000:])
    assert run.generations[KILLS]["exitcodes"] == [0, 0], run.output[-8000:]
    records = {(g, r): json.loads((tmp_path / "gen" / f"g{g}-r{r}.json").read_text())
               for g in range(KILLS + 1) for r in (0, 1)}
    assert not [rec for rec in records.values() if "error" in rec]
    assert records[(0, 0)]["fresh"] and records[(0, 1)]["fresh"]
    resumed = [rec for (g, _), rec in sorted(records.items()) if g > 0 and rec["tag"] is not None]
    for rec in resumed:
        assert rec["weights_match"], rec
        assert rec["tag"] == rec["latest_file"] == rec["fastckpt_latest"] == f"global_step{rec['step']}", rec
        assert rec["step"] == rec["client_step"] >= rec["floor"], rec
    for g in range(1, KILLS + 1):
        assert records[(g, 0)]["tag"] == records[(g, 1)]["tag"]
    # resumes from a tag the generation before saved (its steps start after its own resume), lazily or not
    started = [records[(g, 0)].get("step", 0) for g in range(KILLS + 1)]
    saved_by_last = [g for g in range(1, KILLS + 1) if records[(g, 0)].get("step", 0) > started[g - 1]]
    lazy_resumes = [g for g in saved_by_last if records[(g - 1, 0)]["lazy"]]
    assert bool(lazy_resumes) == (mode == "posix"), (saved_by_last, lazy_resumes)
    final = [json.loads((tmp_path / "gen" / f"final-r{r}.json").read_text()) for r in (0, 1)]
    assert final[0] == final[1]
    assert fastckpt.latest(save_dir, storage_options=opts) == f"{save_dir}/global_step{final[0]['step']}"
    store = store_tag(save_dir, opts) if opts else ""
    local = Path(mirror_path(str(tmp_path / "nvme"), save_dir, store))  # keep_local=2, over every restart
    assert len([t for t in local.iterdir() if (t / GROUP_MANIFEST).exists()]) <= 2, sorted(os.listdir(local))
    phases = collections.Counter(_last_phase(tmp_path / "events" / f"g{g}-r{g % 2}.jsonl") for g in range(KILLS))
    print(f"kills interrupted (last event the victim logged): {dict(phases)}; resumed tags: "
          f"{[records[(g, 0)]['tag'] for g in range(1, KILLS + 1)]}")
    assert len(resumed) >= KILLS - 2  # a kill before the first commit leaves nothing to resume
