"""Run by test_deepspeed.py under torchrun (1 or 2 processes, gloo, DS_ACCELERATOR=cpu).

Usage: _deepspeed_worker.py ROOT SCENARIO[,SCENARIO...]. The scenarios run one after another in
one process, so DeepSpeed's start-up is paid once; each asserts what it can see itself, and each
rank writes ROOT/results/rank{r}.json with what the test checks from outside:
  roundtrip  ZeRO 0-3: train, save, train on, load into a fresh engine: weights, optimizer
             state, lr scheduler and client_state equal the saved ones, and training from there
             matches the uninterrupted run
  convert    DeepSpeed's zero_to_fp32 reads the ZeRO-2 and ZeRO-3 checkpoints (after roundtrip)
  interop    DeepSpeed's own engine loads a fastckpt checkpoint and the other way round; a load
             right after a save waits for it
  report     attach() on an engine from deepspeed.initialize; DeepSpeed's logger and its CSV
             monitor get each checkpoint's numbers
  unsafe     a crafted checkpoint that would run code is refused; "weights_only": false opts in
  switch     no section, or "enabled": false, leaves DeepSpeed's own engine
  s3         save to s3:// (FASTCKPT_TEST_S3 names the server), load there, and on a fresh node
  lazy       ZeRO 0-3 with "lazy_snapshot": the copy is held until the optimizer step's fence
             (after the next forward, which changes BatchNorm's buffers, and backward): the
             loaded checkpoint equals the state at save time
  universal  DeepSpeed's ds_to_universal converts a fastckpt checkpoint (it copies the mp_rank_*
             files out of the tag) and load_universal loads the result
  export     save_16bit_model returns with its file written, as DeepSpeed's own engine does (the
             file's rename is held until the save is waited for)
  nolatest   a directory holding only a tag saved with save_latest=False: load_checkpoint(dir)
             loads nothing and writes no latest file, as DeepSpeed's own engine
  install    install() (FastCkptIO's path under Lightning's DeepSpeedStrategy) honours the
             config's section: weights_only (default false there), enabled, and refuses
             Checkpointer options it cannot apply
  destroy    destroy() returns with the checkpoint durable
  engines    two engines in one job (an actor and a critic), each with its own Checkpointer on
             the job's one store: both commit every save, and each loads its own state back
  onerank    a save fails on rank 1 only (at the call, then in the background): save_checkpoint
             raises on both ranks at the same call, never on one only; the next tag commits
  mismatch   each rank calls save_checkpoint with its own tag (tag_validation "Warn" and "Fail"):
             every rank raises ConfigError naming the tags, nothing is created, the next tag commits
  rank0fails  rank 0 fails inside DeepSpeed's own save_checkpoint (copying zero_to_fp32.py into
             a full save_dir; making a save_dir under a file): both ranks raise, neither hangs
  loadrace   the newest tag moves between two ranks' resolutions of it: every rank loads the
             same tag, whole; a load failing on one rank raises the same error on every rank
  exit       the last save is still in flight when main returns: interpreter exit flushes it
  skip       "when_busy": "skip" drops a tag on rank 0 only (its previous write held by a gate):
             save_checkpoint returns on every rank, the tag is not committed, training goes on
  badtag     a tag with '/', an empty save_dir and a tag too long to be saved again are refused
             (ConfigError naming them); the longest tag allowed is saved again
  otherengine  a DeepSpeed config that also picks another checkpoint engine or layout (a
             FastPersist "writer", "use_node_local_storage", "datastates_ckpt") is refused, by
             initialize before DeepSpeed starts and by attach, naming the option
  drives     "local_dir" as a list (one directory per drive)
  notag      load_checkpoint(url, tag=) of a tag never saved: CheckpointNotFoundError
  wholeconfig  attach(engine, a whole DeepSpeed config without a "fastckpt" section): the defaults
  keepbest   a tag saved with save_latest=False ("best") is never trimmed by keep_persistent or
             keep_local
  coalescebest  replicate_policy "coalesce" drops queued tags for a newer one, never one saved
             with save_latest=False (the upload of the first tag is held, so the others queue)
  missing    a committed tag missing a file, or its directory: CheckpointNotFoundError naming it
             (and, when latest names the deleted tag, saying to rewrite latest); without its
             optimizer file, a load of the weights only (load_module_only) loads it
  resaved    a tag saved again by another engine during a load of it: the load starts over, every
             file from the new save
  fulltag    both files' copies of a tag to save_dir fail (ENOSPC): the next save_checkpoint
             raises the tag's failure once, and the one after that commits
  redaction  credentials redacted in a copy (the user's dict is untouched), and with
             "enabled": false too (none in DeepSpeed's own checkpoint files)
  globtag    tags holding glob characters ("[1]" beside "1", "a*" beside "ab") in a save_dir
             holding some ("exp[lr=0.1]"): each load reads its own tag's files
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed import comm as dist  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt.integrations.deepspeed import FastCkptEngine, attach, initialize  # noqa: E402
from tests.integration._ds_common import ds_config, engine, frozen, full_weights, make_model, same, train  # noqa: E402
from tests.integration._exit import leave  # noqa: E402

RESULTS: dict[str, object] = {}


class Note:
    """A user's object in client_state: not on weights_only's allow-list."""

    def __init__(self, v: int) -> None:
        self.v = v


class Evil:
    """Unpickling this runs a shell command."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.path}",))


def roundtrip(root: str, stage: int) -> None:
    d = os.path.join(root, f"zero{stage}")
    fck = {"local_dir": os.path.join(root, "nvme")}
    a = engine(stage, fck, seed=0)
    assert type(a.checkpoint_engine).__name__ == "FastCkptEngine"
    train(a, 1, 3)
    ref_w, ref_opt = full_weights(a), frozen(a.optimizer.state_dict())
    ref_sched = frozen(a.lr_scheduler.state_dict())
    t = torch.arange(6.0)
    a.save_checkpoint(d, "t3", client_state={"note": "hello", "t": t, "step": 3})
    train(a, 4, 5)  # keep training: mutates everything the snapshot copied
    w5 = full_weights(a)
    a.destroy()
    assert fastckpt.latest(d) == os.path.join(d, "t3")

    b = engine(stage, fck, seed=1)
    path, client = b.load_checkpoint(d)
    assert path is not None and os.path.basename(os.path.dirname(path)) == "t3", path
    same(full_weights(b), ref_w, f"zero{stage} weights")
    same(b.optimizer.state_dict(), ref_opt, f"zero{stage} optimizer")
    same(b.lr_scheduler.state_dict(), ref_sched, f"zero{stage} lr scheduler")
    assert client["note"] == "hello" and client["step"] == 3 and torch.equal(client["t"], t)
    assert b.checkpoint_engine.checkpointer.stats().last_restore_from == "local"
    train(b, 4, 5)
    same(full_weights(b), w5, f"zero{stage} training after the load")
    b.destroy()
    RESULTS.setdefault("roundtrip", {})[stage] = {k: v.tolist() for k, v in ref_w.items()}


def convert(root: str) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    dist.barrier()
    if dist.get_rank() == 0:
        for stage in (2, 3):
            sd = get_fp32_state_dict_from_zero_checkpoint(os.path.join(root, f"zero{stage}"), tag="t3")
            want = RESULTS["roundtrip"][stage]  # type: ignore[index]
            assert sorted(sd) == sorted(want), sorted(sd)
            for k, v in sd.items():
                assert torch.equal(v, torch.tensor(want[k])), (stage, k)
        RESULTS["convert"] = [2, 3]
    dist.barrier()


def interop(root: str) -> None:
    plain_dir, fast_dir = os.path.join(root, "by-deepspeed"), os.path.join(root, "by-fastckpt")
    d = engine(2, None, seed=0)
    assert type(d.checkpoint_engine).__name__ == "TorchCheckpointEngine"
    train(d, 1, 3)
    want = full_weights(d)
    d.save_checkpoint(plain_dir, "ds3")
    d.destroy()

    f = engine(2, {}, seed=1)
    path, _ = f.load_checkpoint(plain_dir)  # DeepSpeed's files and its own latest
    assert path is not None and "ds3" in path, path
    same(full_weights(f), want, "fastckpt engine loading DeepSpeed's checkpoint")
    train(f, 4, 4)
    want = full_weights(f)
    f.save_checkpoint(fast_dir, "fc4")
    path, _ = f.load_checkpoint(fast_dir)  # right after the save: waits for it
    assert path is not None and "fc4" in path, path
    f.destroy()

    d2 = engine(2, None, seed=2)
    path, _ = d2.load_checkpoint(fast_dir)
    assert path is not None and "fc4" in path, path
    same(full_weights(d2), want, "DeepSpeed's engine loading fastckpt's checkpoint")
    d2.destroy()


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def report(root: str) -> None:
    from deepspeed.utils import logger as ds_logger

    from tests.integration._ds_common import ds_config, make_model

    records = Records()
    ds_logger.addHandler(records)
    ds_logger.setLevel(logging.INFO)  # DeepSpeed's default is WARNING: its own save messages are INFO too
    csv = {"enabled": True, "output_path": os.path.join(root, "csv"), "job_name": "run"}
    model = make_model(0)
    eng, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                                        config=ds_config(2, {"local_dir": os.path.join(root, "nvme")},
                                                         csv_monitor=csv))
    assert type(eng.checkpoint_engine).__name__ == "TorchCheckpointEngine"  # DeepSpeed ignores the section
    fe = attach(eng)
    assert eng.checkpoint_engine is fe and fe.checkpointer.config.local_dir == os.path.join(root, "nvme")
    for step in (1, 2):
        train(eng, step, step)
        eng.save_checkpoint(os.path.join(root, "reported"))
    eng.destroy()
    ds_logger.removeHandler(records)
    ds_logger.setLevel(logging.WARNING)
    RESULTS["report_log"] = [m for m in records.messages if m.startswith("fastckpt: checkpoint")]


def unsafe(root: str) -> None:
    evil_dir, pwned = os.path.join(root, "evil"), os.path.join(root, "pwned")
    if dist.get_rank() == 0:
        os.makedirs(os.path.join(evil_dir, "e1"))
        torch.save({"module": Evil(pwned)}, os.path.join(evil_dir, "e1", "mp_rank_00_model_states.pt"))
    dist.barrier()
    eng = engine(2, {}, seed=0)
    try:
        eng.load_checkpoint(evil_dir, "e1")
        raise AssertionError("a checkpoint that runs code was loaded")
    except pickle.UnpicklingError as exc:
        notes = "\n".join(getattr(exc, "__notes__", []))
        assert '"weights_only": false' in notes, notes
    assert not os.path.exists(pwned)
    eng.destroy()

    note_dir = os.path.join(root, "note")
    trusting = engine(2, {"weights_only": False}, seed=0)
    train(trusting, 1, 1)
    trusting.save_checkpoint(note_dir, "n1", client_state={"obj": Note(5)})
    _, client = trusting.load_checkpoint(note_dir)
    assert isinstance(client["obj"], Note) and client["obj"].v == 5
    trusting.destroy()
    careful = engine(2, {}, seed=0)
    try:
        careful.load_checkpoint(note_dir)
        raise AssertionError("a client_state object off the allow-list was unpickled with weights_only=True")
    except pickle.UnpicklingError as exc:
        assert "Note" in str(exc), str(exc)
    careful.destroy()
    RESULTS["unsafe"] = {"pwned": os.path.exists(pwned)}


def switch(root: str) -> None:
    for section in (None, {"enabled": False}):
        eng = engine(1, section, seed=0)
        assert type(eng.checkpoint_engine).__name__ == "TorchCheckpointEngine", section
        eng.destroy()


def s3(root: str) -> None:
    spec = json.loads(os.environ["FASTCKPT_TEST_S3"])
    url, opts = f"s3://{spec['bucket']}/run", spec["storage_options"]
    a = engine(2, {"local_dir": os.path.join(root, "nvme-s3"), "storage_options": opts}, seed=0)
    train(a, 1, 2)
    want = full_weights(a)
    a.save_checkpoint(url, "s2")
    assert "storage_options" not in json.dumps(a.config["fastckpt"]) or \
        set(a.config["fastckpt"]["storage_options"].values()) == {"<redacted by fastckpt>"}
    path, _ = a.load_checkpoint(url)
    assert path is not None and "s2" in path, path
    same(full_weights(a), want, "load from s3 on the same node")
    assert a.checkpoint_engine.checkpointer.stats().last_restore_from == "local"
    a.destroy()
    fresh = engine(2, {"local_dir": os.path.join(root, "nvme-fresh"), "storage_options": opts}, seed=3)
    path, _ = fresh.load_checkpoint(url)
    assert path is not None and "s2" in path, path
    same(full_weights(fresh), want, "load from s3 on a fresh node")
    dist.barrier()  # every rank has loaded s2: the fresh node saves it again, as the refusal of a
    fresh.checkpoint_engine.checkpointer.remove(f"{url}/s2")  # re-save at a URL tells: remove it first,
    dist.barrier()  # on every rank
    train(fresh, 3, 4)
    newer = full_weights(fresh)
    fresh.save_checkpoint(url, "s2")
    fresh.destroy()
    back = engine(2, {"local_dir": os.path.join(root, "nvme-s3"), "storage_options": opts}, seed=5)
    path, _ = back.load_checkpoint(url, tag="s2")  # the first node's burst buffer holds the older s2
    same(full_weights(back), newer, "load of a tag another node saved again, over an older local copy")
    back.destroy()
    RESULTS["s3"] = url


def lazy(root: str, stage: int) -> None:
    import threading

    import fastckpt.save.saver as core
    from tests.integration._ds_common import ds_config

    def bn_model(seed: int) -> torch.nn.Module:  # BatchNorm: buffers that forward changes
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                   torch.nn.Linear(32, 4))

    def make(seed: int):
        model = bn_model(seed)
        cfg = ds_config(stage, {"local_dir": os.path.join(root, "nvme"), "lazy_snapshot": True})
        return initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), config=cfg)[0]

    d = os.path.join(root, f"lazy{stage}")
    a = make(0)
    train(a, 1, 3)
    ref_w, ref_opt = full_weights(a), frozen(a.optimizer.state_dict())
    ref_buf = {n: b.detach().clone() for n, b in a.module.named_buffers()}
    for buf in ref_buf.values() if stage < 3 else ():  # ranks' BatchNorm statistics differ, and below
        dist.broadcast(buf, 0)  # ZeRO-3 every rank loads the model file rank 0 wrote (ZeRO-3: its own)
    ck = a.checkpoint_engine.checkpointer
    release, fenced = threading.Event(), []
    real_snapshot, real_fence = core.snapshot, ck.fence

    def held(*args, **kwargs):  # the snapshot thread: no copy before the fence
        assert release.wait(60), "the optimizer step never fenced the lazy snapshot"
        return real_snapshot(*args, **kwargs)

    def fence() -> float:  # a spy on the real fence: it releases the held copy, then waits for it
        fenced.append(a.global_steps)
        release.set()
        return real_fence()

    core.snapshot, ck.fence = held, fence
    try:
        a.save_checkpoint(d, "t3")
        assert not release.is_set() and not fenced
        train(a, 4, 5)  # forward and backward of step 4 run beside the held copy; its step fences
    finally:
        core.snapshot = real_snapshot
    writes = stage > 0 or a.global_rank == 0  # without ZeRO only rank 0 saves files
    assert fenced == ([3] if writes else []), fenced  # once, by step 4's optimizer step (global_steps is 3 in it)
    assert not same_tensors(full_weights(a), ref_w)  # training went on after the save
    a.destroy()

    b = make(1)
    path, _ = b.load_checkpoint(d)
    assert path is not None and os.path.basename(os.path.dirname(path)) == "t3", path
    same(full_weights(b), ref_w, f"lazy zero{stage} weights")
    same(b.optimizer.state_dict(), ref_opt, f"lazy zero{stage} optimizer")
    same({n: x.detach().clone() for n, x in b.module.named_buffers()}, ref_buf, f"lazy zero{stage} buffers")
    b.destroy()


def universal(root: str) -> None:
    import subprocess

    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    d = os.path.join(root, "universal")
    a = engine(1, {}, seed=0)
    train(a, 1, 2)
    want = full_weights(a)
    a.save_checkpoint(d, "u2", client_state={UNIVERSAL_CHECKPOINT_INFO: {"universal_checkpoint_version": 0.2}})
    a.destroy()
    if dist.get_rank() == 0:
        proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                               os.path.join(d, "u2"), "--output_folder", os.path.join(d, "u2_universal"),
                               "--num_extract_workers", "1", "--num_merge_workers", "1"],
                              capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr[-4000:]
    dist.barrier()
    b = engine(1, {}, seed=1, checkpoint={"load_universal": True})
    path, _ = b.load_checkpoint(d, "u2_universal")
    assert path is not None and "u2_universal" in path, path
    same(full_weights(b), want, "load_universal of the converted fastckpt checkpoint")
    b.destroy()


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def export(root: str) -> None:
    from fastckpt.testing import FaultyOps

    d = os.path.join(root, "export")
    ops = FaultyOps()
    gate = ops.gate("replace", path_contains="pytorch_model.bin")  # the file's publication
    ck = fastckpt.Checkpointer(ops=ops, overhead_budget=0.99)
    real_save = ck.save

    def save(state_dict, path, group=None, **kw):  # a spy: a wait for the file opens the gate
        handle = real_save(state_dict, path, group, **kw)
        real_wait = handle.wait

        def wait(timeout=None):
            gate.open()
            return real_wait(timeout)

        handle.wait = wait
        return handle

    ck.save = save
    eng = engine(2, None, seed=0)
    attach(eng, {}, checkpointer=ck)
    train(eng, 1, 1)
    want = {k: v.clone() for k, v in eng.module_state_dict().items()}
    try:
        eng.save_16bit_model(d)
        written = os.path.exists(os.path.join(d, "pytorch_model.bin"))
    finally:
        gate.open()
    assert written or eng.global_rank != 0  # DeepSpeed writes it on rank 0 (rank 1 may see it written by then)
    if eng.global_rank == 0:
        same(fastckpt.load(os.path.join(d, "pytorch_model.bin")), want, "the 16-bit export")
    eng.destroy()
    ck.close()

    # "when_busy": "skip" drops a save that finds the staging buffer busy: the export says so
    busy_ops = FaultyOps()
    held = busy_ops.gate("pwrite", path_contains="mp_rank_00_model_states")  # the checkpoint keeps the buffer
    eng = engine(0, None, seed=0)
    attach(eng, {}, checkpointer=fastckpt.Checkpointer(ops=busy_ops, when_busy="skip", overhead_budget=0.99))
    train(eng, 1, 1)
    eng.save_checkpoint(os.path.join(root, "export-busy"), "b1")
    try:
        if eng.global_rank == 0:  # the only rank that writes, without ZeRO
            assert held.wait_entered(60)
            try:
                eng.save_16bit_model(os.path.join(root, "export-busy"))
                raise AssertionError("a dropped 16-bit export returned as if written")
            except fastckpt.CheckpointWriteError as exc:
                assert "when_busy" in str(exc), str(exc)
    finally:
        held.open()
    eng.destroy()


def nolatest(root: str) -> None:
    d = os.path.join(root, "no-latest")
    a = engine(0, {}, seed=0)
    train(a, 1, 1)
    a.save_checkpoint(d, "export", save_latest=False)
    a.destroy()
    b = engine(0, {}, seed=1)
    assert b.load_checkpoint(d) == (None, None)
    b.destroy()
    assert not os.path.exists(os.path.join(d, "latest"))
    assert os.path.exists(os.path.join(d, "export", "fastckpt-manifest.json"))  # committed all the same


def install_section(root: str) -> None:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from fastckpt.errors import ConfigError
    from fastckpt.integrations.deepspeed import install

    def built(section: dict | None):  # as Lightning's DeepSpeedStrategy builds it: the section in its config
        return engine(0, section, seed=0, use_fastckpt_initialize=False)

    d = os.path.join(root, "installed")
    ck = fastckpt.Checkpointer(overhead_budget=0.99)
    a = built(None)
    assert install(a, ck).weights_only is False  # no section: as DeepSpeed's engine under Lightning
    train(a, 1, 1)
    a.save_checkpoint(d, "i1", client_state={"obj": Note(7)})  # Lightning's hparams may be of any type
    _, client = a.load_checkpoint(d)
    assert client["obj"].v == 7
    a.destroy()
    b = built({"weights_only": True})
    assert install(b, ck).weights_only is True
    try:
        b.load_checkpoint(d)
        raise AssertionError("weights_only=True in the section was not honoured")
    except pickle.UnpicklingError as exc:
        notes = "\n".join(getattr(exc, "__notes__", []))
        assert '"weights_only": false' in notes and "DeepSpeedStrategy(config=...)" in notes, notes
    b.destroy()
    c = built({"weights_only": False, "local_dir": os.path.join(root, "nvme")})
    try:
        install(c, ck)
        raise AssertionError("a section's Checkpointer options were silently ignored")
    except ConfigError as exc:
        assert "['local_dir']" in str(exc) and "FastCkptIO(...)" in str(exc), str(exc)
    assert install(c, None).checkpointer.config.local_dir == os.path.join(root, "nvme")  # no Checkpointer: used
    c.destroy()
    off = built({"enabled": False})
    assert install(off, ck) is None and isinstance(off.checkpoint_engine, TorchCheckpointEngine)
    off.destroy()
    ck.close()


def destroy(root: str) -> None:
    d = os.path.join(root, "destroyed")
    eng = engine(2, {"local_dir": os.path.join(root, "nvme")}, seed=0)
    train(eng, 1, 1)
    eng.save_checkpoint(d, "g1")
    eng.save_16bit_model(d)  # DeepSpeed's other save: one file beside the tags, not a group
    skipped = list(eng.checkpoint_engine.skipped)
    eng.destroy()
    g1 = os.path.join(d, "g1")
    assert fastckpt.latest(g1) == g1, (sorted(os.listdir(g1)), skipped)  # durable and published when destroy returned
    with open(os.path.join(d, "latest")) as f:
        assert f.read() == "g1"
    assert sorted(n for n in os.listdir(d) if not n.endswith(".py")) == ["g1", "latest", "pytorch_model.bin"]
    assert sorted(fastckpt.load(os.path.join(d, "pytorch_model.bin"))) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    # DeepSpeedEngine.__del__ calls destroy() again (at exit too): it built a Checkpointer to close
    # it, whose metrics server, started during interpreter shutdown, never returned
    built, init = [], fastckpt.Checkpointer.__init__
    fastckpt.Checkpointer.__init__ = lambda self, *a, **k: (built.append(1), init(self, *a, **k))[1]
    try:
        eng.destroy()
    finally:
        fastckpt.Checkpointer.__init__ = init
    RESULTS["built_by_second_destroy"] = len(built)


def two_engines(root: str) -> None:
    shapes = {"actor": (2, 0, 64), "critic": (1, 1, 32)}  # ZeRO stage, seed, width
    dirs = {name: os.path.join(root, "rlhf", name) for name in shapes}
    fck = {name: {"local_dir": os.path.join(root, "nvme", name)} for name in shapes}
    engines = {name: engine(stage, fck[name], seed=seed, width=width) for name, (stage, seed, width) in shapes.items()}
    for step in (1, 2):
        for name, eng in engines.items():
            train(eng, step, step)
            eng.save_checkpoint(dirs[name], f"s{step}")
    saved = {name: full_weights(eng) for name, eng in engines.items()}
    for eng in engines.values():
        eng.destroy()
    for name, (stage, _, width) in shapes.items():
        assert fastckpt.latest(dirs[name]) == os.path.join(dirs[name], "s2"), name
        fresh = engine(stage, fck[name], seed=7, width=width)
        path, _ = fresh.load_checkpoint(dirs[name])
        assert path is not None and os.path.basename(os.path.dirname(path)) == "s2", path
        same(full_weights(fresh), saved[name], f"{name} weights")
        fresh.destroy()


def one_rank_fails(root: str) -> None:
    """A save fails on rank 1 only, at the call (t2: its directory cannot be made) and in the
    background (t3: ENOSPC mid-write): save_checkpoint raises on both ranks at the same call
    (raised on one rank only, the other would wait in DeepSpeed's barrier for ever), the tags are
    not committed, and the next tag commits on both."""
    import errno

    from fastckpt.testing import Fault, FaultyOps

    d, rank, ops = os.path.join(root, "onerank"), dist.get_rank(), FaultyOps()
    ck = fastckpt.Checkpointer(ops=ops, commit_timeout_s=60)
    eng = engine(2, None, use_fastckpt_initialize=False)
    attach(eng, checkpointer=ck)
    train(eng, 1, 1)
    eng.save_checkpoint(d, "t1")
    if rank == 1:
        ops.inject(Fault("makedirs", errno.ENOSPC, path_contains=f"{os.sep}t2"))
        ops.inject(Fault("pwrite", errno.ENOSPC, path_contains=f"t3{os.sep}zero_pp_rank_1"))
    raised = {}
    for step, tag in ((2, "t2"), (3, "t3"), (4, "t4"), (5, "t5")):
        train(eng, step, step)
        try:
            eng.save_checkpoint(d, tag)
            raised[tag] = None
        except Exception as exc:  # noqa: BLE001 (the training loop that goes on after a failed checkpoint)
            raised[tag] = type(exc).__name__
    eng.destroy()
    ck.close()
    RESULTS["onerank"] = {"raised": raised, "latest": fastckpt.latest(d)}


def mismatched_tags(root: str) -> None:
    """Each rank calls save_checkpoint with its own tag (a per-rank timestamp in it), under
    DeepSpeed's "tag_validation" "Warn" (it only warns) and "Fail" (it asserts, inside its save):
    every rank raises ConfigError naming both tags before anything is created, and the next save,
    with one tag, commits (each rank once committed its own group, and that commit's pairing
    made every later one time out)."""
    from fastckpt.commit import protocol as C
    from fastckpt.errors import ConfigError

    rank = dist.get_rank()
    for validation in ("Warn", "Fail"):
        d = os.path.join(root, "mismatch", validation)
        eng = engine(2, {"commit_timeout_s": 30}, checkpoint={"tag_validation": validation})
        train(eng, 1, 1)
        try:
            eng.save_checkpoint(d, f"t{rank}")
            raise AssertionError(f"save_checkpoint with tag t{rank} on rank {rank} only was not refused")
        except ConfigError as exc:
            said = str(exc)
            assert "different tags on the ranks (tag 't0' on rank 0; tag 't1' on rank 1" in said, said
            assert f"this is rank {rank}, asked for 't{rank}'" in said and "same save_dir and tag" in said, said
        dist.barrier()
        assert not os.path.exists(os.path.join(d, "t0")) and not os.path.exists(os.path.join(d, "t1"))
        train(eng, 2, 2)
        eng.save_checkpoint(d, "a2")
        eng.destroy()
        assert os.path.exists(os.path.join(d, "a2", C.GROUP_MANIFEST)) and fastckpt.latest(d) == os.path.join(d, "a2")


def rank0_fails_in_deepspeed(root: str) -> None:
    """Rank 0 fails inside DeepSpeed's own save_checkpoint, where fastckpt cannot reach: its copy
    of zero_to_fp32.py into save_dir (ENOSPC; after its files were handed over, before the
    commit: rank 1 waits in the commit's all-reduce, or under ZeRO-3 with persistent parameters
    first in their gather) at t2, and its makedirs of an uncreatable save_dir (a path under a
    file: rank 1 waits in DeepSpeed's barrier) at t3. Both ranks raise at each, neither hangs;
    rank 0 raises its own error, and t4 commits."""
    import errno

    import deepspeed.runtime.engine as ds_engine

    from fastckpt.errors import CheckpointWriteError

    rank = dist.get_rank()
    real = ds_engine.copyfile

    def disk_full(src: str, dst: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", dst)

    for name, stage, extra in (("zero2", 2, {}), ("zero3", 3, {"zero_optimization": {"stage": 3}})):
        d = os.path.join(root, "rank0fails", name)  # ZeRO-3's default stage3_param_persistence_threshold
        os.makedirs(d, exist_ok=True)
        blocker = os.path.join(d, "a-file")
        open(blocker, "w").close()
        eng = engine(stage, None, use_fastckpt_initialize=False, **extra)
        assert stage == 2 or eng.optimizer.persistent_parameters, "no persistent parameter: nothing gathered"
        ck = fastckpt.Checkpointer(commit_timeout_s=60)
        attach(eng, checkpointer=ck)
        train(eng, 1, 1)
        eng.save_checkpoint(d, "t1")
        raised = {}
        steps = ((2, d, "t2"), (3, os.path.join(blocker, "ckpt"), "t3"), (4, d, "t4"))
        for step, where, tag in steps if stage == 2 else (steps[0], steps[2]):
            train(eng, step, step)
            ds_engine.copyfile = disk_full if rank == 0 and tag == "t2" else real
            try:
                eng.save_checkpoint(where, tag)
                raised[tag] = None
            except Exception as exc:  # noqa: BLE001 (the training loop that goes on after a failed checkpoint)
                raised[tag] = type(exc).__name__
                if rank == 0 and tag == "t3":
                    assert "could not be created on rank 0" in "".join(getattr(exc, "__notes__", [])), exc
                if rank == 1:
                    assert isinstance(exc, CheckpointWriteError), repr(exc)
            finally:
                ds_engine.copyfile = real
        eng.destroy()
        ck.close()
        RESULTS.setdefault("rank0fails", {})[name] = {"raised": raised, "latest": fastckpt.latest(d)}


def load_race(root: str) -> None:
    """An evaluation job's two ranks load the newest tag while it moves: rank 0 resolves t1,
    then latest moves to t2 before rank 1 resolves. Both ranks end with t2, whole (rank 0 loads
    again), never rank 0's t1 with rank 1's t2. Then a load that fails on rank 1 only (its copy
    of the model file is corrupt) raises CorruptCheckpointError on both ranks, and a fallback to
    an older tag in ``except CorruptCheckpointError`` runs on both."""
    from torch.distributed.distributed_c10d import _get_default_store

    from fastckpt.errors import CorruptCheckpointError

    d, rank, store = os.path.join(root, "loadrace"), dist.get_rank(), _get_default_store()
    writer = engine(2, {"commit_timeout_s": 60}, seed=0)
    train(writer, 1, 1)
    writer.save_checkpoint(d, "t1")
    t1_w = full_weights(writer)
    train(writer, 2, 2)
    writer.save_checkpoint(d, "t2", save_latest=False)  # not the newest until latest names it (below)
    writer.checkpoint_engine.checkpointer.wait()
    t2_w, t2_opt = full_weights(writer), frozen(writer.optimizer.state_dict())
    dist.barrier()
    reader = engine(2, {"commit_timeout_s": 60}, seed=1)
    fe, load, tries = reader.checkpoint_engine, reader.checkpoint_engine.load, []

    def move_latest_first(path: str, map_location: object = None) -> object:
        tries.append(os.path.basename(os.path.dirname(path)))
        if len(tries) == 1 and rank == 0:  # rank 0 has resolved t1 and pinned it; rank 1 has not begun
            with open(os.path.join(d, ".latest.tmp"), "w") as f:
                f.write("t2")
            os.replace(os.path.join(d, ".latest.tmp"), os.path.join(d, "latest"))
            store.set("loadrace-moved", "1")
        return load(path, map_location)

    fe.load = move_latest_first
    if rank == 1:  # it resolves once rank 0 moved latest (after the ranks agreed on the call, its first collective)
        hooks, resolve = reader._fastckpt_hooks, reader._fastckpt_hooks._resolve

        def resolve_late(home: str) -> str | None:
            store.wait(["loadrace-moved"])
            return resolve(home)

        hooks._resolve = resolve_late
    path, _ = reader.load_checkpoint(d)
    assert path is not None and os.path.basename(os.path.dirname(path)) == "t2", path  # its model file
    assert rank == 1 or tries[0] == "t1", tries  # rank 0 began with t1, then loaded again
    same(full_weights(reader), t2_w, "weights after the newest moved during the load")
    same(reader.optimizer.state_dict(), t2_opt, "optimizer state after the newest moved during the load")

    def corrupt_on_rank1(path: str, map_location: object = None) -> object:
        if rank == 1 and os.sep + "t2" + os.sep in path:
            raise CorruptCheckpointError(f"{path}: block 0 does not match its checksum (a bad copy on this node)")
        return load(path, map_location)

    fe.load, fell_back = corrupt_on_rank1, None
    try:
        reader.load_checkpoint(d, "t2")
        raise AssertionError("a load that failed on rank 1 returned")
    except CorruptCheckpointError as exc:
        fell_back = str(exc)
        reader.load_checkpoint(d, "t1")  # the fallback: collective, so it runs only if every rank came here
    assert rank == 1 or "rank 1 failed to load it" in fell_back, fell_back
    same(full_weights(reader), t1_w, "weights after the fallback to t1")
    RESULTS["loadrace"] = {"tries": tries}
    writer.destroy()
    reader.destroy()


def exit_flush(root: str) -> None:
    eng = engine(2, {"local_dir": os.path.join(root, "nvme")}, seed=0, width=1024)
    train(eng, 1, 1)
    eng.save_checkpoint(os.path.join(root, "at-exit"), "x1")
    RESULTS["exit_pending"] = len(eng.checkpoint_engine.pending)
    # no wait, no destroy: returning from main leaves the commit to the exit hook


def skip(root: str) -> None:
    from fastckpt.testing import FaultyOps

    d, rank = os.path.join(root, "skipped"), dist.get_rank()
    ops = FaultyOps()
    held = os.path.join(d, "k1", "mp_rank_00_model_states.pt")  # (not the tier probe in k1/: another file)
    gate = ops.gate("pwrite", path_contains=held) if rank == 0 else None
    eng = engine(2, None, seed=0, use_fastckpt_initialize=False)
    ck = fastckpt.Checkpointer(ops=ops, when_busy="skip" if rank == 0 else "wait")  # only rank 0 skips
    fe = attach(eng, {}, checkpointer=ck)
    train(eng, 1, 1)
    eng.save_checkpoint(d, "k1")  # rank 0's write is held: its staging buffer stays busy
    eng.save_checkpoint(d, "k2")  # rank 0 skips; every rank returns (none raises, none waits in a barrier)
    assert fe.skipped == ["k2"], fe.skipped
    if gate is not None:
        gate.open()  # and k1's commit ends: rank 0's staging buffer is free again, else k3 is skipped too
        next(p for p in fe.pending if p.tag == "k1").handle.wait()
    train(eng, 2, 2)
    eng.save_checkpoint(d, "k3")
    eng.destroy()
    ck.close()
    assert fastckpt.latest(d) == os.path.join(d, "k3")
    assert not os.path.exists(os.path.join(d, "k2", "fastckpt-manifest.json"))
    RESULTS["skipped"] = fe.skipped


def bad_tag(root: str) -> None:
    from fastckpt.errors import ConfigError

    eng = engine(2, {}, seed=0)
    train(eng, 1, 1)
    long = "run-" + "x" * 224  # 228 bytes: its first save committed, and every later one failed (name too long)
    for save_dir, tag, named in ((os.path.join(root, "nested"), "epoch1/step1", "'epoch1/step1'"),
                                 ("", "t1", "save_dir=''"),
                                 (os.path.join(root, "nested"), long, "is 228 bytes long: fastckpt saves a tag again")):
        try:
            eng.save_checkpoint(save_dir, tag)
            raise AssertionError(f"save_checkpoint({save_dir!r}, {tag!r}) was not refused")
        except ConfigError as exc:
            assert named in str(exc), str(exc)
    eng.save_checkpoint(os.path.join(root, "nested"), long[:227])  # the longest that is saved again
    train(eng, 2, 2)
    eng.save_checkpoint(os.path.join(root, "nested"), long[:227], client_state={"again": True})
    eng.destroy()
    assert not os.path.exists(os.path.join(root, "nested", "epoch1"))
    assert not os.path.exists(os.path.join(root, "nested", long))
    fresh = engine(2, {}, seed=1)
    assert fresh.load_checkpoint(os.path.join(root, "nested"))[1].get("again") is True
    fresh.destroy()


def other_engine(root: str) -> None:
    from fastckpt.errors import ConfigError

    def refused(named: str, build) -> None:
        try:
            build()
            raise AssertionError(f"{named} was not refused")
        except ConfigError as exc:
            assert named in str(exc) and '"enabled": false' in str(exc), str(exc)

    ckpt = {"tag_validation": "FAIL"}
    refused('"writer"', lambda: engine(2, {}, checkpoint={**ckpt, "writer": {"type": "fast"}}))
    refused('"datastates_ckpt"', lambda: engine(2, {}, datastates_ckpt={"host_cache_size": 1}))
    refused('"use_node_local_storage"', lambda: engine(2, {}, checkpoint={**ckpt, "use_node_local_storage": True}))
    eng = engine(2, None, use_fastckpt_initialize=False, checkpoint={**ckpt, "use_node_local_storage": True})
    refused('"use_node_local_storage"', lambda: attach(eng))
    assert not isinstance(eng.checkpoint_engine, FastCkptEngine)  # left as it was
    eng.destroy()
    eng = engine(2, {"enabled": False}, checkpoint={**ckpt, "use_node_local_storage": True})  # off: DeepSpeed's own
    eng.destroy()


def drives(root: str) -> None:
    dirs = [os.path.join(root, "nvme-a"), os.path.join(root, "nvme-b")]  # one directory per drive
    eng = engine(2, {"local_dir": dirs}, seed=0)
    assert eng.checkpoint_engine.checkpointer.config.local_dirs == tuple(dirs)
    train(eng, 1, 1)
    eng.save_checkpoint(os.path.join(root, "drives"), "t1")
    path, _ = eng.load_checkpoint(os.path.join(root, "drives"))
    assert path is not None and "t1" in path, path
    eng.destroy()


def no_such_tag(root: str) -> None:
    import uuid

    from fastckpt.errors import CheckpointNotFoundError

    eng = engine(2, {"local_dir": os.path.join(root, "nvme-url")}, seed=0)
    train(eng, 1, 1)
    url = f"memory://fastckpt-{uuid.uuid4().hex[:8]}/run"
    eng.save_checkpoint(url, "t1")
    try:
        eng.load_checkpoint(url, tag="nope")
        raise AssertionError("a tag never saved was loaded")
    except CheckpointNotFoundError as exc:
        assert "does not exist" in str(exc) and "'nope'" in str(exc), str(exc)
    eng.destroy()


def resaved(root: str) -> None:
    """A tag saved again (and swapped in) by another engine between the loader's model file and
    its optimizer file: the load starts over and every file is of the new save, never a mix."""
    d, fck = os.path.join(root, "resaved"), {"commit_timeout_s": 60}
    writer = engine(2, fck, seed=0)
    train(writer, 1, 2)
    writer.save_checkpoint(d, "t1")
    writer.checkpoint_engine.checkpointer.wait()
    train(writer, 3, 4)  # the state the tag is saved with again
    ref_w, ref_opt = full_weights(writer), frozen(writer.optimizer.state_dict())
    reader = engine(2, fck, seed=1)
    fe, files = reader.checkpoint_engine, []
    load = fe.load

    def load_then_resave(path: str, map_location: object = None) -> object:
        try:
            obj = load(path, map_location)
        except fastckpt.GroupChangedError:
            files.append("changed")
            raise
        files.append(os.path.basename(path))
        if len(files) == 1:  # after the model file, before the optimizer's
            writer.save_checkpoint(d, "t1")
            writer.checkpoint_engine.checkpointer.wait()
        return obj

    fe.load = load_then_resave
    path, _ = reader.load_checkpoint(d, "t1")
    assert path is not None and files.count("changed") == 1, files  # then loaded again, whole
    same(full_weights(reader), ref_w, "weights after a re-save during the load")
    same(reader.optimizer.state_dict(), ref_opt, "optimizer state after a re-save during the load")
    RESULTS["resaved_files"] = files
    writer.destroy()
    reader.destroy()


def full_tag(root: str) -> None:
    """Both copies of t1 to save_dir fail: one failed tag, raised once (at t2's save), not once
    per file (t3's save raised the optimizer file's copy error, and saved nothing either)."""
    import errno
    from concurrent.futures import wait

    from fastckpt.testing import Fault, FaultyOps

    d = os.path.join(root, "fulltag")
    ops = FaultyOps([Fault("pwrite", errno.ENOSPC, path_startswith=d + os.sep, path_contains=n)
                     for n in ("model_states", "optim_states")])
    ck = fastckpt.Checkpointer(local_dir=os.path.join(root, "fulltag-nvme"), ops=ops, overhead_budget=0.99)
    eng = engine(2, None, seed=0, use_fastckpt_initialize=False)
    attach(eng, {}, checkpointer=ck)
    train(eng, 1, 1)
    eng.save_checkpoint(d, "t1")
    # both copies failed and the tag's commit ended; waiting on the futures marks no failure seen
    wait(ck._inflight.futures(), timeout=60)  # noqa: SLF001
    assert len(ops.fired) == 2, ops.fired
    raised = {}
    for step in (2, 3):
        train(eng, step, step)
        try:
            eng.save_checkpoint(d, f"t{step}")
            raised[step] = None
        except Exception as exc:  # noqa: BLE001
            raised[step] = type(exc).__name__
    eng.checkpoint_engine.wait()
    assert raised[2] is not None and raised[3] is None, raised
    assert fastckpt.latest(d) == os.path.join(d, "t3")
    eng.destroy()
    ck.close()


def numpy_state(root: str) -> None:
    """A client_state holding numpy's RNG state saved fine, and the resume (weights_only=True, the
    default) failed with UnpicklingError, maybe days later: the save now warns, once, naming the
    globals; one with plain types and tensors does not."""
    import pickle

    import numpy as np

    records = Records()
    logging.getLogger("fastckpt.deepspeed").addHandler(records)
    logging.getLogger("fastckpt.deepspeed").setLevel(logging.WARNING)  # (main() quiets "fastckpt" to ERROR)
    d = os.path.join(root, "numpystate")
    eng = engine(2, {}, seed=0)
    train(eng, 1, 1)
    eng.save_checkpoint(d, "p1", client_state={"step": 1, "t": torch.ones(2), "names": ["a", "b"]})
    for tag in ("n1", "n2"):
        eng.save_checkpoint(d, tag, client_state={"rng": np.random.get_state()})
    warned = [m for m in records.messages if "client_state holds" in m]
    assert len(warned) == 1 and "numpy.ndarray" in warned[0] and "add_safe_globals" in warned[0], warned
    eng.checkpoint_engine.checkpointer.wait()
    try:
        eng.load_checkpoint(d, "n2")
        raise AssertionError("a client_state of numpy objects loaded with weights_only=True")
    except pickle.UnpicklingError:
        pass  # as the warning said
    RESULTS["numpy_warned"] = warned
    logging.getLogger("fastckpt.deepspeed").setLevel(logging.NOTSET)


def missing(root: str) -> None:
    """A committed tag whose optimizer file, or whole directory, was deleted since: the load
    raises CheckpointNotFoundError naming it, not DeepSpeed's bare AssertionError; a load of the
    weights only, which reads no optimizer file, loads the tag without it."""
    import shutil

    from fastckpt.errors import CheckpointNotFoundError

    d = os.path.join(root, "missing")
    eng = engine(2, {}, seed=0)
    train(eng, 1, 1)
    eng.save_checkpoint(d, "t1")
    eng.checkpoint_engine.checkpointer.wait()
    (optim,) = [n for n in os.listdir(os.path.join(d, "t1")) if n.endswith("optim_states.pt")]
    os.unlink(os.path.join(d, "t1", optim))
    try:
        eng.load_checkpoint(d, "t1")
        raise AssertionError("a tag missing its optimizer file was loaded")
    except CheckpointNotFoundError as exc:
        assert optim in str(exc) and "does not exist" in str(exc), str(exc)
        assert f"load_checkpoint({d!r}, tag='t1', load_module_only=True)" in str(exc), str(exc)
    weights = full_weights(eng)  # a tag kept for evaluation or fine-tuning: its weights load without that file
    for kwargs in ({"load_module_only": True}, {"load_optimizer_states": False},
                   {"tag": "t1", "load_module_only": True}):
        fresh = engine(2, {}, seed=1)  # (once: CheckpointNotFoundError for the optimizer file, and "remove it")
        assert fresh.load_checkpoint(d, **kwargs)[0] is not None, kwargs
        same(full_weights(fresh), weights, str(kwargs))
        fresh.destroy()
    z3 = engine(3, {}, seed=0)  # ZeRO-3: the weights are in the optimizer files (its model file: empty partitions)
    train(z3, 1, 1)
    z3.save_checkpoint(os.path.join(root, "missing3"), "t1")
    z3.checkpoint_engine.checkpointer.wait()
    (optim3,) = [n for n in os.listdir(os.path.join(root, "missing3", "t1")) if n.endswith("optim_states.pt")]
    os.unlink(os.path.join(root, "missing3", "t1", optim3))
    fresh = engine(3, {}, seed=1)
    try:  # (once, for a moment: "loaded", keeping the fresh engine's own weights)
        fresh.load_checkpoint(os.path.join(root, "missing3"), "t1", load_module_only=True)
        raise AssertionError("a ZeRO-3 tag missing its optimizer file was loaded weights-only")
    except CheckpointNotFoundError as exc:
        assert optim3 in str(exc) and "load_module_only" not in str(exc), str(exc)
    fresh.destroy()
    z3.destroy()
    shutil.rmtree(os.path.join(root, "missing3"))
    os.unlink(os.path.join(d, "t1", "mp_rank_00_model_states.pt"))  # DeepSpeed's own bare assert, named
    try:  # latest names the damaged tag: its manifest keeps it the newest whatever latest says: remove it
        eng.load_checkpoint(d)
        raise AssertionError("a tag missing its optimizer file was loaded")
    except CheckpointNotFoundError as exc:  # (once: "write the tag to resume from into latest", which led back here)
        assert "stays the newest complete tag" in str(exc) and "checkpointer.remove(" in str(exc), str(exc)
    shutil.rmtree(os.path.join(d, "t1"))
    try:
        eng.load_checkpoint(d, "t1")
        raise AssertionError("a deleted tag was loaded")
    except CheckpointNotFoundError as exc:
        said = f"{os.sep}t1 does not exist (no tag 't1' is saved under {d}: never saved, or deleted since)"
        assert said in str(exc), str(exc)  # (once: "deleted since it was saved", for a tag never saved too)
    try:  # latest still names it (as after checkpointer.remove): the advice is to rewrite latest
        eng.load_checkpoint(d)
        raise AssertionError("a deleted tag that latest names was loaded")
    except CheckpointNotFoundError as exc:  # (once: "load_checkpoint(d) and no tag", the call that failed)
        assert f"{os.path.join(d, 'latest')} names it" in str(exc) and "and no tag" not in str(exc), str(exc)
        assert "newest remaining tag" in str(exc) and "does not roll back" in str(exc), str(exc)
    # a tag whose save never committed: killed while writing, its directory holds only a temp file
    from fastckpt.errors import IncompleteCheckpointError
    from fastckpt.io.atomic import tmp_name

    os.makedirs(os.path.join(d, "t2"))
    with open(tmp_name(os.path.join(d, "t2", "mp_rank_00_model_states.pt")), "wb") as f:
        f.write(b"PK" + bytes(100))
    try:
        eng.load_checkpoint(d, "t2")
        raise AssertionError("a tag whose save never committed was loaded")
    except IncompleteCheckpointError as exc:  # (was DeepSpeed's bare AssertionError)
        assert f"{os.sep}t2 cannot be loaded: it holds no complete save" in str(exc), str(exc)
    shutil.rmtree(os.path.join(d, "t2"))  # the round trip checks that no temp file is left under the root
    empty = os.path.join(root, "empty-latest")  # DeepSpeed cut short while writing latest, no fastckpt tag
    os.makedirs(empty)
    open(os.path.join(empty, "latest"), "w").close()
    try:
        eng.load_checkpoint(empty)
        raise AssertionError("an empty latest was loaded")
    except CheckpointNotFoundError as exc:  # (was DeepSpeed's bare AssertionError)
        assert f"{os.path.join(empty, 'latest')} is empty" in str(exc) and "tag=" in str(exc), str(exc)
    shutil.rmtree(empty)
    eng.destroy()


def whole_config(root: str) -> None:
    plain = engine(1, None, seed=0, use_fastckpt_initialize=False)
    assert attach(plain, ds_config(1, None)) is not None  # a DeepSpeed config without a section: the defaults
    # one whose keys are all off the short list attach once knew (batch sizes from the launcher's args)
    assert attach(plain, {"steps_per_print": 10, "gradient_clipping": 1.0, "wall_clock_breakdown": False}) is not None
    plain.destroy()


def redaction(root: str) -> None:
    from fastckpt.integrations._deepspeed.config import REDACTED

    secret = {"key": "AKIAEXAMPLE", "secret": "TOPSECRET123"}
    cfg = ds_config(1, {"storage_options": dict(secret)})
    models = [make_model(s) for s in (0, 1)]
    shared = [deepspeed.initialize(model=m, optimizer=torch.optim.Adam(m.parameters()), config=cfg)[0] for m in models]
    for e in shared:  # both from the one dict: the second must still see the credentials
        assert attach(e).checkpointer.config.storage_options == secret
        assert set(e.config["fastckpt"]["storage_options"].values()) == {REDACTED}
        e.destroy()
    assert cfg["fastckpt"]["storage_options"] == secret
    off = engine(1, {"enabled": False, "storage_options": dict(secret)}, seed=0)
    train(off, 1, 1)
    d = os.path.join(root, "disabled", "t1")
    off.save_checkpoint(os.path.dirname(d), "t1")  # DeepSpeed's own engine, with its ds_config copy
    off.destroy()
    for name in os.listdir(d):
        with open(os.path.join(d, name), "rb") as f:
            assert b"TOPSECRET123" not in f.read(), name


def keep_best(root: str) -> None:
    d = os.path.join(root, "keep-best")
    eng = engine(2, {"keep_persistent": 1, "local_dir": os.path.join(root, "nvme-keep"), "keep_local": 1}, seed=0)
    train(eng, 1, 1)
    eng.save_checkpoint(d, "best", save_latest=False)  # beside the series: retention leaves it
    export = os.path.join(root, "keep-best-export")
    eng.save_16bit_model(export, "model16.bin")  # an export, not a tag: keep_persistent once deleted it
    for step in (2, 3, 4):
        train(eng, step, step)
        eng.save_checkpoint(d, f"global_step{step}")
    ck = eng.checkpoint_engine.checkpointer
    local = {tag: ck.local_path(os.path.join(d, tag)) for tag in ("best", "global_step3")}
    eng.destroy()
    dist.barrier()  # rank 0's retention of the shared directory has ended too
    assert os.path.isfile(os.path.join(export, "model16.bin"))
    assert sorted(n for n in os.listdir(d) if os.path.isdir(os.path.join(d, n))) == ["best", "global_step4"]
    assert os.path.isdir(local["best"]) and not os.path.exists(local["global_step3"]), local
    assert fastckpt.latest(os.path.join(d, "best")) == os.path.join(d, "best")


def coalesce_best(root: str) -> None:
    import threading

    from fastckpt.testing import FaultyOps

    d, release = os.path.join(root, "coalesced"), threading.Event()

    def hold(op: str, path: str) -> None:  # the upload of t1 to save_dir (not its burst-buffer copy)
        if op == "pwrite" and path.startswith(os.path.join(d, "t1") + os.sep) and not release.wait(120):
            raise TimeoutError("the test never released the upload of t1")

    eng = engine(2, None, seed=0, use_fastckpt_initialize=False)
    ck = fastckpt.Checkpointer(ops=FaultyOps(on_call=hold), local_dir=os.path.join(root, "nvme-co"),
                               replicate_workers=1)  # replicate_policy "coalesce", the default
    attach(eng, {}, checkpointer=ck)
    train(eng, 1, 1)
    eng.save_checkpoint(d, "t1")  # its upload holds the one replicator: the next tags queue
    eng.save_checkpoint(d, "best", save_latest=False)
    eng.save_checkpoint(d, "t2")  # coalesces the tags queued before it, except "best"
    release.set()
    eng.destroy()
    ck.close()
    assert fastckpt.latest(os.path.join(d, "best")) == os.path.join(d, "best")  # committed
    assert fastckpt.latest(d) == os.path.join(d, "t2")


def glob_tag(root: str) -> None:
    d = os.path.join(root, "exp[lr=0.1]")  # (before: every load raised a bare AssertionError)
    eng = engine(2, {"local_dir": os.path.join(root, "nvme-glob")}, seed=0)
    saved = {}
    for step, tag in enumerate(("1", "[1]", "ab", "a*"), start=1):
        train(eng, step, step)
        eng.save_checkpoint(d, tag)
        saved[tag] = (step, full_weights(eng))
    train(eng, 5, 5)
    for tag in ("[1]", "a*", "1", None):  # (before: "[1]" loaded tag "1"'s files, "a*" raised)
        path, _ = eng.load_checkpoint(d, tag)
        step, weights = saved[tag or "a*"]
        assert eng.global_steps == step, (tag, path, eng.global_steps)
        same(full_weights(eng), weights, f"tag {tag!r}")
    eng.destroy()


SCENARIOS = {"roundtrip": lambda root: [roundtrip(root, s) for s in (0, 1, 2, 3)], "convert": convert,
             "interop": interop, "report": report, "unsafe": unsafe, "switch": switch, "s3": s3,
             "universal": universal, "export": export, "nolatest": nolatest, "install": install_section,
             "destroy": destroy, "engines": two_engines, "exit": exit_flush, "skip": skip, "badtag": bad_tag,
             "otherengine": other_engine,
             "drives": drives, "notag": no_such_tag, "wholeconfig": whole_config, "redaction": redaction,
             "keepbest": keep_best, "coalescebest": coalesce_best, "resaved": resaved, "fulltag": full_tag,
             "onerank": one_rank_fails, "rank0fails": rank0_fails_in_deepspeed, "mismatch": mismatched_tags,
             "loadrace": load_race, "missing": missing, "numpystate": numpy_state,
             "globtag": glob_tag,
             "lazy": lambda root: [lazy(root, s) for s in (0, 1, 2, 3)]}


def main(root: str, names: list[str]) -> None:
    logging.getLogger("fastckpt").setLevel(logging.ERROR)  # the overhead alarm fires in tiny runs
    deepspeed.init_distributed(dist_backend="gloo")
    for name in names:
        SCENARIOS[name](root)
        RESULTS.setdefault("done", []).append(name)  # type: ignore[union-attr]
    rank = dist.get_rank()
    os.makedirs(os.path.join(root, "results"), exist_ok=True)
    with open(os.path.join(root, "results", f"rank{rank}.json"), "w") as f:
        json.dump({k: v for k, v in RESULTS.items() if k != "roundtrip"}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
    leave()  # not through the interpreter's finalization: see _exit.leave
