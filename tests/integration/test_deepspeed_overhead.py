"""One DeepSpeed ``save_checkpoint`` is one save for the overhead monitor, whatever its files.

A ZeRO checkpoint is a model file and an optimizer file per rank: each was a save for the
Monitor, so every checkpoint counted twice, the first one already "measured an interval" (the gap
between its two files) and the alarm's advice sized that gap. A real DeepSpeed engine (ZeRO 1,
CPU, gloo, one process), eager and lazy snapshots."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from tests.integration._fork_launcher import run_session  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import glob, json, os, sys
from tests.integration._ds_common import engine, train

root, out = sys.argv[1], {}
for lazy in (False, True):
    eng = engine(1, {"lazy_snapshot": lazy})
    ck = eng.checkpoint_engine.checkpointer
    d = os.path.join(root, f"lazy{lazy}")
    seen = []
    for step, tag in ((1, "a"), (2, "b")):
        train(eng, step, step)  # (lazy: this step's optimizer step fences the save before it)
        eng.save_checkpoint(d, tag=tag)
        ck.wait()
        st = ck.stats()
        seen.append({"saves": st.saves, "alarms": st.alarms, "bytes": st.bytes,
                     "files": len(glob.glob(os.path.join(d, tag, "*.pt")))})
    out[str(lazy)] = seen
    eng.destroy()
print("RESULT " + json.dumps(out), flush=True)
"""


def test_a_save_checkpoint_of_a_model_and_an_optimizer_file_is_one_save(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".venv" / "torch_extensions")))
    with socket.socket() as sock:  # one rank, as torchrun starts it
        sock.bind(("127.0.0.1", 0))
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(sock.getsockname()[1]))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    proc = run_session([sys.executable, str(script), str(tmp_path)], env, 300, str(REPO))
    assert proc.returncode == 0, proc.stdout[-8000:]
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    for lazy, (first, second) in out.items():
        assert first["files"] >= 2 and second["files"] == first["files"], out  # model and optimizer files
        # was: one save per file (2, then 4)
        assert (first["saves"], second["saves"]) == (1, 2), (lazy, out)
        assert first["alarms"] == 0, (lazy, out)  # was: an alarm at the first checkpoint (two files, 1 "interval")
        assert second["bytes"] == 2 * first["bytes"] > 0, (lazy, out)
