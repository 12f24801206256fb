"""ZeRO-3 with DeepSpeed's default persistence threshold, 2 CPU processes under torchrun (see
``_deepspeed_zero3_worker.py`` for what each scenario asserts inside the processes).

One launch runs every scenario, each in its own directory, as test_deepspeed.py's launches do:
a launch per test spent most of its time starting torchrun and importing torch and DeepSpeed in
every rank, five times over."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from tests.integration.test_deepspeed import ds_env, torchrun  # noqa: E402

WORKER = str(Path(__file__).resolve().parent / "_deepspeed_zero3_worker.py")
LIMIT_S = 300  # a hang is killed (with its whole session) and fails the test


SCENARIOS = "onerank,weightsonly,bbweights,moduleonly,difftags,resave,dsconfig"


@pytest.fixture(scope="module")
def got(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """Each rank's results of one launch of every scenario."""
    root = tmp_path_factory.mktemp("zero3")
    proc = torchrun(["--nproc-per-node=2", WORKER, str(root), SCENARIOS], ds_env(), LIMIT_S, root)
    assert proc.returncode == 0, proc.stdout[-8000:]
    return {r: json.loads((root / "results" / f"rank{r}.json").read_text()) for r in (0, 1)}


def test_a_load_failing_on_one_rank_raises_on_both_and_never_hangs(got: dict[int, dict]) -> None:
    """Rank 1's own model file, then its optimizer file, damaged: both ranks raise
    CorruptCheckpointError (they hung in DeepSpeed's gather of the persistent parameters, and
    fastckpt's agreement, before) and fall back to the older tag together; a re-save swapped in
    during rank 1's load only loads again on both ranks."""
    for r in (0, 1):
        assert got[r]["onerank"]["raised"] == {"zero_pp_rank_1_mp_rank_00_model_states.pt": "CorruptCheckpointError",
                                               "zero_pp_rank_1_mp_rank_00_optim_states.pt": "CorruptCheckpointError"}
        assert got[r]["onerank"]["tries"] == ["t1", "t1"]


def test_a_weights_only_load_reads_its_own_tag_verified(got: dict[int, dict]) -> None:
    """load_checkpoint(d, "t1", load_optimizer_states=False): DeepSpeed's consolidation of the
    weights read the tag ``latest`` named (t2), unverified; now t1's (asserted in the worker),
    and a damaged file of t1 raises CorruptCheckpointError on both ranks."""
    assert [got[r]["weightsonly"]["raised"] for r in (0, 1)] == ["CorruptCheckpointError"] * 2


def test_a_weights_only_load_with_a_burst_buffer_reads_the_verified_bytes(got: dict[int, dict]) -> None:
    """The same with a ``local_dir``: fastckpt verified the burst-buffer copies while DeepSpeed's
    consolidation read save_dir's files itself, so a bit flipped in a save_dir file since the save
    was loaded into the weights unnoticed; now the consolidation reads through fastckpt's verified
    load (the intact burst-buffer copy), and the saved weights load on both ranks."""
    for r in (0, 1):
        assert got[r]["bbweights"] == {"differing": []}  # was: ["0.weight"], the flipped bit's

def test_load_module_only_loads_the_weights(got: dict[int, dict]) -> None:
    """load_checkpoint(d, "t1", load_module_only=True), optimizer states left at their default:
    DeepSpeed's own load under ZeRO-3 loaded no weight (its model files hold empty partitions)
    and raised nothing; now the weights come from the consolidation of the tag, as with
    load_optimizer_states=False, and only the weights (no step counters, no "optimizer" key)."""
    for r in (0, 1):
        assert got[r]["moduleonly"] == {"loaded": True, "differing": [], "fresh": [], "global_steps": 0,
                                        "run": 7, "optimizer_key": False}


def test_ranks_given_different_tags_or_load_options_are_refused_before_loading(got: dict[int, dict]) -> None:
    """Rank 0 asked for t0, rank 1 for t1: each loaded its tag, three times, then both raised
    GroupChangedError blaming a re-save; different load options hung in DeepSpeed's load. Now
    both ranks raise ConfigError naming every rank's value, before any load, and the same call
    on both then loads."""
    for r in (0, 1):
        tags, options = got[r]["difftags"]["refused"]
        assert "different tag on the ranks (tag='t0' on rank 0; tag='t1' on rank 1)" in tags, tags
        assert "load_optimizer_states=True on rank 0; load_optimizer_states=False on rank 1" in options, options
        assert f"this is rank {r}" in options and "Nothing was loaded" in options
        assert got[r]["difftags"]["then"] == "t1" and got[r]["difftags"]["global_steps"] == 2


def test_a_weights_only_load_notices_a_resave_during_the_consolidation(got: dict[int, dict]) -> None:
    """A re-save of the tag published while DeepSpeed's consolidation reads its files: the new
    save's weights were loaded beside the old save's step counters (2); now the consolidation's
    reads are of the pinned save, the change is noticed, and the new save loads whole on both ranks."""
    for r in (0, 1):
        assert got[r]["resave"] == {"resaves": ["t1"], "global_steps": 4, "differing": []}


def test_a_deepspeed_config_value_a_safe_load_refuses_is_named_at_initialize(got: dict[int, dict]) -> None:
    """DeepSpeed stores its config in every file: a numpy scalar there made every checkpoint
    unloadable with weights_only=True, found at the resume; now initialize refuses it, naming its
    key and the fix."""
    for r in (0, 1):
        numpy_value, own_class = got[r]["dsconfig"]["refused"]
        assert "['gradient_clipping'] is a numpy.float64" in numpy_value and "float(gradient_clipping)" in numpy_value
        assert "['my_name']" in own_class and ".Name" in own_class
