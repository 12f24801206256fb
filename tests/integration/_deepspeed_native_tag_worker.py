"""Run by test_deepspeed_native_tag.py, one CPU process (gloo) per phase:
``_deepspeed_native_tag_worker.py PHASE SAVE_DIR`` (the test forks each from its fork server).

- ``native``: DeepSpeed's own engine saves tag ``last`` (ZeRO-2), recording its weights' hash.
- ``kill``: a fastckpt engine saves ``last`` again and SIGKILLs itself as the second of the tag's
  files is renamed into its final name, wherever the save writes it (the tag directory itself,
  or its re-save directory ``.last.fastckpt-next-*``).
- ``resave``: a fastckpt engine saves ``last`` again, to the end.
- ``load``: a fastckpt engine and then DeepSpeed's own engine load ``save_dir``; prints one line
  ``OUT {json}``: for each, the client state's version and whether the weights hash to what the
  save recorded (or the error).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt.integrations.deepspeed import attach  # noqa: E402
from fastckpt.testing import FaultyOps  # noqa: E402
from tests.integration._ds_common import ds_config, make_model, train  # noqa: E402


def build(seed: int):  # noqa: ANN201
    model = make_model(seed)
    return deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                                config=ds_config(2))[0]


def weights(eng) -> str:  # noqa: ANN001
    h = hashlib.sha256()
    for name, p in sorted(eng.module.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().float().numpy().tobytes())
    return h.hexdigest()


def save(eng, save_dir: str, version: str) -> None:  # noqa: ANN001
    eng.save_checkpoint(save_dir, tag="last", client_state={"version": version, "weights": weights(eng)})


def die_at_second_rename(op: str, path: str) -> None:
    where = os.path.basename(os.path.dirname(path))
    if op == "replace" and ".fastckpt-tmp" in path and (where == "last" or where.startswith(".last.fastckpt-next")):
        die_at_second_rename.seen += 1
        if die_at_second_rename.seen == 2:
            os.kill(os.getpid(), signal.SIGKILL)


die_at_second_rename.seen = 0


def loaded(eng, save_dir: str) -> dict:  # noqa: ANN001
    try:
        _, client = eng.load_checkpoint(save_dir)
    except Exception as exc:  # noqa: BLE001 (reported to the test)
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"version": (client or {}).get("version"), "whole": (client or {}).get("weights") == weights(eng)}


def main() -> None:
    phase, save_dir = sys.argv[1], sys.argv[2]
    eng = build(seed={"native": 0, "kill": 1, "resave": 2, "load": 3}[phase])
    if phase == "load":
        attach(eng, {})
        out = {"fastckpt": loaded(eng, save_dir)}
        eng.destroy()
        eng = build(seed=4)
        out["deepspeed"] = loaded(eng, save_dir)
        print("OUT " + json.dumps(out), flush=True)
    else:
        train(eng, 1, 2)
        if phase == "kill":
            attach(eng, {}, checkpointer=fastckpt.Checkpointer(ops=FaultyOps(on_call=die_at_second_rename)))
        elif phase == "resave":
            attach(eng, {})
        save(eng, save_dir, phase)
        if phase != "native":
            eng.checkpoint_engine.wait()
    eng.destroy()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
