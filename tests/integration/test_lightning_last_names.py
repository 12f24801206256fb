"""ModelCheckpoint(save_top_k=k, save_last=True) with a burst buffer whose uploads run behind: a
top-k file the last file at the path names is not deleted before a newer last file has landed
(integrations/_lightning/lasts.py, docs/lightning.md). Uploads of the last file are held by an
event at the replicator's open of their burst-buffer copy; every other file lands freely.

The first tests are the defect (each failed before the fix); the others are the cases that
made an earlier fix keep files for good or warn falsely (a templated last name, two
ModelCheckpoints, FSDP sharded, no burst buffer): each must keep save_top_k files and warn of none."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import fsspec
import pytest

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt.integrations.lightning import FastCkptIO  # noqa: E402
from fastckpt.io.atomic import final_path  # noqa: E402
from fastckpt.testing import FaultyOps  # noqa: E402
from fastckpt.urls import normalize  # noqa: E402
from tests.integration._fork_server import ForkServer  # noqa: E402
from tests.integration.test_lightning import TinyModel, loader  # noqa: E402
from tests.s3server import free_ports  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOP1 = {"every_n_train_steps": 1, "save_top_k": 1, "monitor": "step", "mode": "max", "save_last": True}


class ValModel(TinyModel):
    def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return {"loss": (self.net(x) - y).pow(2).mean()}


class MyCheckpoint(ModelCheckpoint):
    """A user's subclass: its state_key starts with its own name, not "ModelCheckpoint"."""


class LastUploads:
    """Holds each open of a last file's copy on ``thread`` threads while ``holding`` is set,
    until ``release`` is (the replicator's: its upload; without a burst buffer the writer's)."""

    def __init__(self, thread: str = "fastckpt-replicate") -> None:
        self.holding, self.release, self.thread = threading.Event(), threading.Event(), thread

    def on_call(self, op: str, path: str) -> None:
        if op == "open" and self.holding.is_set() and threading.current_thread().name.startswith(self.thread) \
                and os.path.basename(final_path(path) or path) == "last.ckpt":
            assert self.release.wait(60)


def missing_named(last: str, key: str) -> list[str]:
    """The files the state ``key`` in the last file at ``last`` names that do not exist."""
    st = fastckpt.load(last, weights_only=False)["callbacks"][key]
    return sorted(p for p in {st["best_model_path"], *st["best_k_models"]} if not fsspec.core.url_to_fs(p)[0].exists(p))


def trainer_for(root: str, io: FastCkptIO, steps: int, callbacks: list, strategy: object = "auto") -> L.Trainer:
    return L.Trainer(max_steps=steps, accelerator="cpu", devices=1, plugins=[io], logger=False, strategy=strategy,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                     num_sanity_val_steps=0, callbacks=callbacks)


def held_fit(root: str, dirpath: str, steps: int, hold_at: int | None, ckpt_path: str | None = None,
             ready: object = None, cls: type = ModelCheckpoint, local_dir: bool = True, strategy: object = "auto",
             model: type | None = None) -> tuple[list, L.Trainer]:
    """Top 1 by step and save_last=True, every step, on a burst buffer, one upload at a time. Once
    step ``hold_at``'s saves are durable at the home (None: from the start), last.ckpt's uploads
    are held; after the next step's saves, once the deletion of the file it replaced has run (or
    was parked), the last.ckpt at the home is looked at (``ready(trainer)`` is called then), and
    the uploads are let go. Returns the files the look found named but missing, and the trainer.
    ``local_dir=False``: no burst buffer, last.ckpt's writes are held instead."""
    uploads, looked = LastUploads("fastckpt-replicate" if local_dir else "fastckpt-write"), []
    io = FastCkptIO(local_dir=os.path.join(root, "nvme") if local_dir else None,
                    ops=FaultyOps(on_call=uploads.on_call), replicate_workers=1, staging_buffers=4)
    mc = cls(dirpath=dirpath, **TOP1)
    start, asked = None, {}
    remove = io.remove_checkpoint

    def remove_checkpoint(path: str) -> None:  # its queued deletion, kept: a later save harvests it once done
        remove(path)
        asked[normalize(path)] = io._removals.get(normalize(path))  # (None after fit: deleted at once)

    io.remove_checkpoint = remove_checkpoint  # type: ignore[method-assign]

    class Look(Callback):
        def on_train_batch_start(self, trainer, *args):  # noqa: ANN001, ANN002
            nonlocal start
            start = trainer.global_step if start is None else start
            if hold_at is not None and trainer.global_step == hold_at:
                io._checkpointer().wait(60)  # last.ckpt of hold_at (and all before) at the home
                uploads.holding.set()
            elif trainer.global_step == (start if hold_at is None else hold_at) + 1:
                try:
                    removal = asked.get(normalize(f"{dirpath}/epoch=0-step={trainer.global_step - 1}.ckpt"))
                    assert removal is not None
                    removal.result(60)  # it ran, or it was parked
                    looked.extend(missing_named(f"{dirpath}/last.ckpt", mc.state_key))
                    if ready is not None:
                        ready(trainer)
                finally:
                    uploads.release.set()

    uploads.holding.set() if hold_at is None else None
    trainer = trainer_for(root, io, steps, [Look(), mc], strategy)
    try:
        trainer.fit((model or ValModel)(), loader(), ckpt_path=ckpt_path)
    finally:
        uploads.release.set()
    assert not missing_named(f"{dirpath}/last.ckpt", mc.state_key)
    return looked, trainer


def kept(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("fastckpt: kept")]


def test_save_last_true_never_names_a_deleted_best_while_uploads_run_behind(tmp_path, caplog):
    """last.ckpt of step 2 lands naming step=2; last.ckpt of step 3 is held. The deletion of step=2
    (asked at step 3) ran once step=3 had landed: the durable last.ckpt named a deleted best."""
    ckdir = str(tmp_path / "ckpt")
    with caplog.at_level(logging.INFO, logger="fastckpt.lightning"):
        looked, _ = held_fit(str(tmp_path), ckdir, 5, hold_at=2)
    assert looked == []  # was: [.../epoch=0-step=2.ckpt]
    assert sorted(os.listdir(ckdir)) == ["epoch=0-step=5.ckpt", "last.ckpt"]  # none left after teardown
    assert kept(caplog) == []


def test_a_model_checkpoint_subclass_is_covered(tmp_path, caplog):
    """The same with a subclass of ModelCheckpoint, found by isinstance and read by its state_key."""
    ckdir = str(tmp_path / "ckpt")
    with caplog.at_level(logging.INFO, logger="fastckpt.lightning"):
        looked, trainer = held_fit(str(tmp_path), ckdir, 5, hold_at=2, cls=MyCheckpoint)
    assert trainer.checkpoint_callback.state_key.startswith("MyCheckpoint")
    assert looked == []  # was: [.../epoch=0-step=2.ckpt]
    assert sorted(os.listdir(ckdir)) == ["epoch=0-step=5.ckpt", "last.ckpt"]
    assert kept(caplog) == []


def test_a_url_dirpath_is_covered_too(tmp_path):
    """The same with a URL dirpath (fsspec's memory://): paths are compared as normalize writes them."""
    url = f"memory://fastckpt-last-names-{os.getpid()}/run"
    fs = fsspec.filesystem("memory")
    try:
        looked, _ = held_fit(str(tmp_path), url, 5, hold_at=2)
        assert looked == []  # was: [memory://.../epoch=0-step=2.ckpt]
        files = sorted(n for n in map(os.path.basename, fs.ls(url, detail=False)) if n.endswith(".ckpt"))
        assert files == ["epoch=0-step=5.ckpt", "last.ckpt"]  # (beside them: manifests and `latest`)
    finally:
        fs.rm(url.split("/run")[0], recursive=True)


def test_a_resumed_fit_keeps_the_best_the_last_ckpt_from_before_the_resume_names(tmp_path):
    """fit(ckpt_path="last") from last.ckpt of step 3, which names step=3. The resumed fit deletes
    step=3 at step 4, while its last.ckpt of step 4 is held: the last.ckpt at the home is still
    the one from before the resume, which this fit never saved but read (its pickle) to know."""
    ckdir = str(tmp_path / "ckpt")
    trainer_for(str(tmp_path), FastCkptIO(), 3, [ModelCheckpoint(dirpath=ckdir, **TOP1)]).fit(ValModel(), loader())
    looked, _ = held_fit(str(tmp_path / "resume"), ckdir, 5, hold_at=None, ckpt_path="last")
    assert looked == []  # was: [.../epoch=0-step=3.ckpt]
    assert sorted(os.listdir(ckdir)) == ["epoch=0-step=5.ckpt", "last.ckpt"]


def test_a_kill_while_uploads_run_behind_resumes_with_its_best_file(tmp_path):
    """The whole story: a child process trains as in the first test and is SIGKILLed once the
    deletion of step=2 was judged, while last.ckpt of step 3 is held. fit(ckpt_path="last") then
    restores last.ckpt of step 2, and validate(ckpt_path="best") loads step=2 (it raised)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]), OMP_NUM_THREADS="1")
    child = subprocess.Popen([sys.executable, "-m", "tests.integration._lightning_last_names_worker", "kill",
                              str(tmp_path)], cwd=str(REPO), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        lines = []  # the child says "ready" once it is where the kill goes, and waits
        while not lines or lines[-1] not in ("ready\n", ""):
            lines.append(child.stdout.readline())
        assert lines[-1] == "ready\n", lines
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(60)
    assert child.returncode == -signal.SIGKILL
    ckdir = str(tmp_path / "ckpt")
    trainer = trainer_for(str(tmp_path / "resume"), FastCkptIO(), 2, [ModelCheckpoint(dirpath=ckdir, **TOP1)])
    model = ValModel()
    trainer.fit(model, loader(), ckpt_path="last")  # restores step 2: max_steps reached, no step trained
    assert trainer.global_step == 2
    assert os.path.exists(trainer.checkpoint_callback.best_model_path)
    trainer.validate(model, loader(), ckpt_path="best")  # raised: the best file was gone


def test_without_a_burst_buffer_nothing_is_held(tmp_path, caplog):
    """No local_dir: a save is durable when its write ends, and the deletion of step=2 runs once the
    saves before it are durable, as before (and as with Lightning's own CheckpointIO, which deletes
    before it saves last.ckpt), even while the write of last.ckpt of step 3 is held."""
    ckdir = str(tmp_path / "ckpt")
    with caplog.at_level(logging.INFO, logger="fastckpt.lightning"):
        looked, _ = held_fit(str(tmp_path), ckdir, 5, hold_at=2, local_dir=False)
    assert looked == [normalize(f"{ckdir}/epoch=0-step=2.ckpt")]  # deleted at once: nothing held
    assert sorted(os.listdir(ckdir)) == ["epoch=0-step=5.ckpt", "last.ckpt"]
    assert kept(caplog) == []


@pytest.mark.parametrize("local_dir", [True, False], ids=["burst-buffer", "no-burst-buffer"])
def test_a_templated_last_name_keeps_only_save_top_k_files(tmp_path, caplog, local_dir):
    """CHECKPOINT_NAME_LAST = "{epoch}-{step}-last": each last file has its own path and Lightning
    deletes the one before. A deleted last file holds nothing back (an earlier fix kept every
    top-k file, each with a false WARNING, with and without a burst buffer)."""
    ckdir = str(tmp_path / "ckpt")
    mc = ModelCheckpoint(dirpath=ckdir, **TOP1)
    mc.CHECKPOINT_NAME_LAST = "{epoch}-{step}-last"
    io = FastCkptIO(local_dir=str(tmp_path / "nvme") if local_dir else None, replicate_workers=1)
    with caplog.at_level(logging.INFO, logger="fastckpt.lightning"):
        trainer_for(str(tmp_path), io, 6, [mc]).fit(ValModel(), loader())
    assert sorted(os.listdir(ckdir)) == ["epoch=0-step=6-last.ckpt", "epoch=0-step=6.ckpt"]
    assert kept(caplog) == []


@pytest.mark.parametrize("local_dir", [True, False], ids=["burst-buffer", "no-burst-buffer"])
def test_a_templated_link_last_name_keeps_only_save_top_k_files(tmp_path, caplog, local_dir):
    """save_last="link" with CHECKPOINT_NAME_LAST = "{epoch}-{step}-last": Lightning deletes the
    previous link, a symlink whose own target once counted as "named by a link", so its deletion
    and then its target's waited for good and every checkpoint stayed. Deleting a link deletes
    only the link, and the top-k file it named goes once no other link names it: the files left
    are TorchCheckpointIO's."""
    ckdir = str(tmp_path / "ckpt")
    mc = ModelCheckpoint(dirpath=ckdir, **{**TOP1, "save_top_k": 2, "save_last": "link"})
    mc.CHECKPOINT_NAME_LAST = "{epoch}-{step}-last"
    io = FastCkptIO(local_dir=str(tmp_path / "nvme") if local_dir else None, replicate_workers=1)
    with caplog.at_level(logging.INFO, logger="fastckpt.lightning"):
        trainer_for(str(tmp_path), io, 6, [mc]).fit(ValModel(), loader())
    assert sorted(os.listdir(ckdir)) == ["epoch=0-step=5.ckpt", "epoch=0-step=6-last.ckpt", "epoch=0-step=6.ckpt"]
    assert os.readlink(f"{ckdir}/epoch=0-step=6-last.ckpt") == "epoch=0-step=6.ckpt"
    assert kept(caplog) == []


def test_two_model_checkpoints_each_keep_their_top_k(tmp_path, caplog):
    """Two ModelCheckpoint(save_last=True), every step and every other step, in two folders: each
    last file holds back only its own callback's files (its state_key), not the other's stale
    state in it (an earlier fix left a file beyond save_top_k, with a false WARNING)."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    callbacks = [ModelCheckpoint(dirpath=a, **TOP1), ModelCheckpoint(dirpath=b, **{**TOP1, "every_n_train_steps": 2})]
    io = FastCkptIO(local_dir=str(tmp_path / "nvme"), replicate_workers=1)
    with caplog.at_level(logging.INFO, logger="fastckpt.lightning"):
        trainer_for(str(tmp_path), io, 6, callbacks).fit(ValModel(), loader())
    assert sorted(os.listdir(a)) == ["epoch=0-step=6.ckpt", "last.ckpt"]
    assert sorted(os.listdir(b)) == ["epoch=0-step=6.ckpt", "last.ckpt"]
    assert kept(caplog) == []


# ``python -m tests.integration._lightning_last_names_worker MODE ROOT``, with PYTHONWARNINGS=ignore's filter
_RUN_WORKER = ("import runpy, warnings; warnings.simplefilter('ignore'); "
               "runpy.run_module('tests.integration._lightning_last_names_worker', run_name='__main__')")


def _one_process_fit(server: ForkServer, mode: str, root: Path) -> None:
    """``_lightning_last_names_worker MODE ROOT`` in a process of its own (a gloo process group of
    one), forked by the session's ``lightning_python`` server (tests/integration/conftest.py)."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports(1)[0])}
    proc = server.run_code(_RUN_WORKER, [mode, str(root)], 300, env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_fsdp_sharded_saves_bypass_checkpoint_io_and_hold_nothing(lightning_python, tmp_path):
    """FSDPStrategy(state_dict_type="sharded") on a burst buffer: its saves (folders, last.ckpt too)
    never pass through CheckpointIO, so no last file is seen to land and the sharded last.ckpt
    cannot be read: nothing is held (an earlier fix kept every top-k folder). A real FSDP fit, one
    CPU process (gloo), in a subprocess."""
    _one_process_fit(lightning_python, "fsdp", tmp_path)
    out = json.loads((tmp_path / "summary.json").read_text())
    assert out["files"] == ["epoch=0-step=5.ckpt", "last.ckpt"], out
    assert max(out["counts"]) <= 3 and out["kept"] == [], out  # the folder before the newest goes each step


def test_model_parallel_saving_through_checkpoint_io_is_covered(lightning_python, tmp_path):
    """ModelParallelStrategy(save_distributed_checkpoint=False) saves rank 0's whole checkpoint
    through CheckpointIO, so it is covered as the other strategies are (it was passed over with the
    distributed saves that bypass CheckpointIO: the durable last.ckpt named a deleted best file). A
    real fit, one CPU process (gloo), in a subprocess."""
    _one_process_fit(lightning_python, "model_parallel", tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text()) == {"missing": []}
