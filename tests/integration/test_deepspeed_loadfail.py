"""A load that raises inside DeepSpeed's own ``load_checkpoint`` body on one rank only (after
fastckpt's pre-read and agreement): ZeRO-3, 2 real processes, gloo (see
``_deepspeed_loadfail_worker.py`` for the scenarios). Before, the other rank waited for ever in
DeepSpeed's gather of the persistent parameters; now both ranks raise, naming the rank and the
file, and exit 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from tests.integration._fork_launcher import free_port  # noqa: E402
from tests.integration.test_deepspeed import ds_env  # noqa: E402

WORKER = str(Path(__file__).resolve().parent / "_deepspeed_loadfail_worker.py")
# both ranks must have exited by then: a hang is killed and fails the test
LIMIT_S = float(os.environ.get("FASTCKPT_TEST_LOADFAIL_LIMIT_S", "240"))


def run_two_ranks(root: Path, scenario: str) -> list[tuple[int | None, str]]:
    """Both ranks' exit codes (None: still running at LIMIT_S, killed) and outputs."""
    port, procs = free_port(), []
    for rank in (0, 1):
        env = ds_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = open(root / f"rank{rank}.log", "w+")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen([sys.executable, WORKER, str(root), scenario], env=env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True, cwd=root), log))
    out, deadline = [], time.monotonic() + LIMIT_S
    for proc, log in procs:
        try:
            code: int | None = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
            for p, _ in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        log.seek(0)
        out.append((code, log.read()))
        log.close()
    return out


@pytest.mark.parametrize(("scenario", "failed_file", "error"), [
    ("customfn", "zero_pp_rank_1_mp_rank_00_model_states.pt", "custom_load_fn refused the module state on rank 1"),
    ("fp32route", "zero_pp_rank_1_mp_rank_00_model_states.pt", "custom_load_fn refused the module state on rank 1"),
    ("optimfile", "zero_pp_rank_1_mp_rank_00_optim_states.pt", "fp32_flat_groups"),
])
def test_a_load_raising_inside_deepspeed_on_one_rank_raises_on_both(tmp_path: Path, scenario: str, failed_file: str,
                                                                      error: str) -> None:
    ranks = run_two_ranks(tmp_path, scenario)
    for rank, (code, output) in enumerate(ranks):
        assert code is not None, f"rank {rank} still ran after {LIMIT_S} s (hung):\n{output[-6000:]}"
        assert code == 1, f"rank {rank} exited {code}:\n{output[-6000:]}"
        assert f"[rank={rank}] LOADED t0" in output, output[-6000:]  # the fallback ran on both, in step
        assert "rank 1" in output and failed_file in output and error in output, output[-6000:]
