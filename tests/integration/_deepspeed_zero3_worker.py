"""Run by test_deepspeed_zero3.py under torchrun (2 CPU processes, gloo, DS_ACCELERATOR=cpu).

ZeRO-3 with DeepSpeed's default ``stage3_param_persistence_threshold`` (the other DeepSpeed tests
set it to 0): the small parameters stay gathered ("persistent"), and DeepSpeed's load gathers
them again on every rank at its end (``checkpoint_event_epilogue``), a collective that a rank
whose load raised earlier never reached. Usage: _deepspeed_zero3_worker.py ROOT SCENARIO[,...];
each rank writes ROOT/results/rank{r}.json (the scenarios of one launch keep to directories of their own):
  onerank   rank 1's own model file, then its own optimizer file, has a byte flipped: the load
            raises CorruptCheckpointError on both ranks (before, both hung), and the fallback to
            the older tag loads on both; a re-save swapped in during rank 1's load (its pin says
            so) loads again on both ranks
  weightsonly  load_checkpoint(d, tag, load_optimizer_states=False) (DeepSpeed takes the weights
            from its own consolidation of every rank's files, outside the checkpoint engine):
            the weights are the tag's, not those of the tag ``latest`` names; a damaged file of
            the tag raises CorruptCheckpointError on both ranks
  bbweights  the same with a burst buffer (``local_dir``, one for both ranks: one node): a bit of
            rank 1's fp32 weights in its optimizer file at save_dir is flipped after the save was
            durable (the burst-buffer copy intact); the load gives the saved weights (read, verified,
            from the burst buffer), never the damaged file's (DeepSpeed's consolidation read it itself)
  resave    the same, while another engine saves that tag again (other weights, 4 steps) and its
            save is published between DeepSpeed's parse of the model files and of the optimizer files
            (its ``parse_optim_states`` wrapped): the load starts over and loads the new save whole, on
            both ranks (before: its weights, with the old save's step counters)
  moduleonly  load_checkpoint(d, tag, load_module_only=True) (load_optimizer_states left True): the
            tag's weights are loaded (DeepSpeed's own load loaded none, and raised nothing), the
            step counters are not, and the client state holds no "optimizer" key
  difftags  load_checkpoint with a different tag on each rank (a tag computed per rank), then with
            different load options (rank 1 without optimizer states: its DeepSpeed load would run
            other collectives): ConfigError on both ranks, naming each rank's value, before any
            load (before: three loads, then GroupChangedError blaming a re-save; the options hung);
            the same load on both ranks then loads
  dsconfig  a numpy scalar in the DeepSpeed config (DeepSpeed stores the config in every file),
            or a value of the user's own class (a str subclass): refused at initialize, naming its
            key (every checkpoint saved would have been unloadable with weights_only=True)
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed import comm as dist  # noqa: E402

from fastckpt.errors import CorruptCheckpointError, GroupChangedError  # noqa: E402
from fastckpt.integrations.deepspeed import initialize  # noqa: E402
from tests.integration._ds_common import ds_config, full_weights, make_model, same, train, two_tags  # noqa: E402
from tests.integration._exit import leave  # noqa: E402

RESULTS: dict[str, object] = {}


class Name(str):
    """A value of the user's own class (DeepSpeed's JSON printing of its config takes it: a str)."""


def engine(seed: int, section: dict | None = None, **extra: object):
    """ZeRO-3 with DeepSpeed's default persistence threshold (every parameter of the small model persistent)."""
    cfg = ds_config(3, {"commit_timeout_s": 60, **(section or {})}, **extra)
    cfg["zero_optimization"].pop("stage3_param_persistence_threshold")
    model = make_model(seed)
    eng, _, _, _ = initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), config=cfg)
    return eng


def flip(path: str) -> None:
    """One byte in the middle of ``path`` flipped (its checksum no longer matches)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))


def one_rank(root: str) -> None:
    rank = dist.get_rank()
    d = os.path.join(root, "onerank")
    w = engine(0)
    t0_w = two_tags(w, d)
    raised = {}
    for name in ("zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        if rank == 0:
            flip(os.path.join(d, "t1", name))
        dist.barrier()
        r = engine(1)
        try:
            r.load_checkpoint(d, "t1")
            raised[name] = None
        except CorruptCheckpointError as exc:
            raised[name] = type(exc).__name__
            r.load_checkpoint(d, "t0")  # the fallback: collective, so it returns only if every rank came here
            same(full_weights(r), t0_w, "weights after the fallback to t0")
        r.destroy()
        if rank == 0:  # undo it: the next file is damaged alone
            flip(os.path.join(d, "t1", name))
        dist.barrier()
    r = engine(1)
    ck, tries = r.checkpoint_engine.checkpointer, []
    reading = ck.reading

    def swapped_once(group: str):  # rank 1's pin finds a re-save swapped in, once (as Checkpointer.reading says)
        tries.append(os.path.basename(group))
        if rank == 1 and len(tries) == 1:
            raise GroupChangedError(f"{group} was saved again and swapped in since the load began")
        return reading(group)

    ck.reading = swapped_once
    path, _ = r.load_checkpoint(d, "t1")
    assert path is not None and len(tries) == 2, (path, tries)  # loaded again, on both ranks
    r.destroy()
    RESULTS["onerank"] = {"raised": raised, "tries": tries}


def weights_only(root: str) -> None:
    rank = dist.get_rank()
    d = os.path.join(root, "weightsonly")
    w = engine(0)
    train(w, 1, 2)
    w.save_checkpoint(d, "t1")
    t1_w = full_weights(w)
    train(w, 3, 4)
    w.save_checkpoint(d, "t2")  # latest names t2
    w.destroy()
    r = engine(1)
    r.load_checkpoint(d, "t1", load_optimizer_states=False)
    same(full_weights(r), t1_w, "weights of t1 loaded without optimizer states")
    assert r.global_steps == 2, r.global_steps
    r.destroy()
    dist.barrier()
    if rank == 0:
        flip(os.path.join(d, "t1", "zero_pp_rank_1_mp_rank_00_optim_states.pt"))  # rank 1's fp32 partition
    dist.barrier()
    r, raised = engine(1), None
    try:
        r.load_checkpoint(d, "t1", load_optimizer_states=False)
    except CorruptCheckpointError as exc:
        raised = type(exc).__name__
    r.destroy()
    RESULTS["weightsonly"] = {"raised": raised}


def module_only(root: str) -> None:
    d = os.path.join(root, "moduleonly")
    w = engine(0)
    train(w, 1, 2)
    w.save_checkpoint(d, "t1", client_state={"run": 7})
    t1_w = full_weights(w)
    w.destroy()
    dist.barrier()
    r = engine(1)
    fresh = full_weights(r)
    path, client = r.load_checkpoint(d, "t1", load_module_only=True)
    loaded = full_weights(r)
    RESULTS["moduleonly"] = {"loaded": path is not None,
                             "differing": sorted(k for k in t1_w if not torch.equal(loaded[k], t1_w[k])),
                             "fresh": sorted(k for k in fresh if torch.equal(loaded[k], fresh[k])),
                             "global_steps": r.global_steps, "run": (client or {}).get("run"),
                             "optimizer_key": "optimizer" in (client or {})}
    r.destroy()


def different_tags(root: str) -> None:
    from fastckpt.errors import ConfigError

    rank = dist.get_rank()
    d = os.path.join(root, "difftags")
    two_tags(engine(0), d)
    r, refused = engine(1), []
    for asked in ({"tag": f"t{rank}"}, {"tag": "t1", "load_optimizer_states": rank == 0}):
        try:
            r.load_checkpoint(d, **asked)
            refused.append(None)
        except ConfigError as exc:
            refused.append(str(exc))
    path, _ = r.load_checkpoint(d, "t1")
    RESULTS["difftags"] = {"refused": refused, "then": os.path.basename(os.path.dirname(path)),
                           "global_steps": r.global_steps}
    r.destroy()


def burst_buffer_weights(root: str) -> None:
    rank = dist.get_rank()
    d, section = os.path.join(root, "bbweights"), {"local_dir": os.path.join(root, "nvme")}  # one node's drive
    w = engine(0, section)
    train(w, 1, 2)
    w.save_checkpoint(d, "t1")
    t1_w = full_weights(w)
    w.destroy()  # durable at save_dir, and kept in the burst buffer
    dist.barrier()
    if rank == 0:  # one bit of rank 1's fp32 weights at save_dir: the file stays readable, the weights change
        path = os.path.join(d, "t1", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
        groups = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]["fp32_flat_groups"]
        with open(path, "rb") as f:
            data = bytearray(f.read())
        at = data.find(groups[0].detach().numpy().tobytes())
        assert at > 0, "rank 1's fp32 partition is not stored whole in its file"
        data[at + 1] ^= 0x01
        with open(path, "wb") as f:
            f.write(data)
    dist.barrier()
    r = engine(1, section)
    r.load_checkpoint(d, "t1", load_optimizer_states=False)
    loaded = full_weights(r)
    r.destroy()
    RESULTS["bbweights"] = {"differing": sorted(k for k in t1_w if not torch.equal(loaded[k], t1_w[k]))}


def resave_during_consolidation(root: str) -> None:
    import deepspeed.utils.zero_to_fp32 as ds_fp32

    d, section = os.path.join(root, "resave"), {"local_dir": os.path.join(root, "nvme-resave")}
    w = engine(0, section)
    train(w, 1, 2)
    w.save_checkpoint(d, "t1")
    w.destroy()
    b = engine(2, section)  # the job that saves t1 again, with other weights and step counters
    train(b, 1, 4)
    b_w = full_weights(b)
    parse, resaves = ds_fp32.parse_optim_states, []

    def parse_optim_states(*args: object) -> object:  # DeepSpeed's own, after a re-save of t1 swapped in (once)
        if not resaves:
            resaves.append("t1")
            b.save_checkpoint(d, "t1")
            b.destroy()  # durable: the new save of t1 is published
        return parse(*args)

    r = engine(1, section)
    ds_fp32.parse_optim_states = parse_optim_states
    try:
        r.load_checkpoint(d, "t1", load_optimizer_states=False)
    finally:
        ds_fp32.parse_optim_states = parse
    loaded = full_weights(r)
    RESULTS["resave"] = {"resaves": resaves, "global_steps": r.global_steps,
                         "differing": sorted(k for k in b_w if not torch.equal(loaded[k], b_w[k]))}
    r.destroy()


def ds_config_values(root: str) -> None:
    import numpy as np

    from fastckpt.errors import ConfigError

    refused = []
    for extra in ({"gradient_clipping": np.float64(1.0)}, {"my_name": Name("run1")}):
        try:
            engine(0, **extra).destroy()
            refused.append(None)
        except ConfigError as exc:
            refused.append(str(exc))
    RESULTS["dsconfig"] = {"refused": refused}


SCENARIOS = {"onerank": one_rank, "weightsonly": weights_only, "bbweights": burst_buffer_weights,
             "moduleonly": module_only, "difftags": different_tags,
             "resave": resave_during_consolidation, "dsconfig": ds_config_values}


def main(root: str, names: list[str]) -> None:
    import logging

    logging.getLogger("fastckpt").setLevel(logging.ERROR)  # the overhead alarm fires in tiny runs
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo")
    for name in names:
        SCENARIOS[name](root)
    os.makedirs(os.path.join(root, "results"), exist_ok=True)
    with open(os.path.join(root, "results", f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(RESULTS, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
    leave()
