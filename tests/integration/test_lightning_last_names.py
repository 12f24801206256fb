"""ModelCheckpoint(save_last=True) with a burst buffer whose uploads run behind: a top-k file is
not deleted while the last file at the path names it (integrations/_lightning/lasts.py,
docs/lightning.md). Uploads of last.ckpt are held by an event at the replicator's open of their
burst-buffer copy (the same hold for a local and a URL home); every other file lands freely."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

L = pytest.importorskip("lightning")
import fsspec  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt.integrations.lightning import FastCkptIO  # noqa: E402
from fastckpt.io.atomic import final_path  # noqa: E402
from fastckpt.testing import FaultyOps  # noqa: E402
from fastckpt.urls import normalize  # noqa: E402
from tests.integration.test_lightning import TinyModel, loader, make_trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


class ValModel(TinyModel):
    def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return {"loss": (self.net(x) - y).pow(2).mean()}


class LastUploads:
    """Holds every upload of a last.ckpt while ``holding`` is set, until ``release`` is."""

    def __init__(self) -> None:
        self.holding, self.release = threading.Event(), threading.Event()

    def on_call(self, op: str, path: str) -> None:
        if op == "open" and self.holding.is_set() and threading.current_thread().name.startswith(
                "fastckpt-replicate") and os.path.basename(final_path(path) or path) == "last.ckpt":
            assert self.release.wait(60)


def missing_named(last: str) -> list[str]:
    """The files the last.ckpt at ``last`` names (best_model_path, best_k_models) that do not exist."""
    state = fastckpt.load(last, weights_only=False)
    named = set()
    for key, st in state["callbacks"].items():
        if key.startswith("ModelCheckpoint"):
            named |= {st["best_model_path"], *st["best_k_models"]}
    return sorted(p for p in named if not fsspec.core.url_to_fs(p)[0].exists(p))


def held_fit(root: str, dirpath: str, steps: int, hold_at: int | None, last_name: str | None = None,
             ckpt_path: str | None = None, ready: object = None) -> tuple[list, object]:
    """Top 1 by step and save_last=True, every step, on a burst buffer, one upload at a time. Once
    step ``hold_at``'s saves are durable at the home (None: from the start), last.ckpt's uploads
    are held; after the next step's saves, once the deletion of the file it replaced has run (or
    waits), the last.ckpt at the home is looked at (``ready(trainer)`` is called then), and the
    uploads are let go. Returns the files the look found named but missing, and the trainer."""
    uploads, looked = LastUploads(), []
    io = FastCkptIO(local_dir=os.path.join(root, "nvme"), ops=FaultyOps(on_call=uploads.on_call),
                    replicate_workers=1, staging_buffers=4)
    start = None

    class Look(Callback):
        def on_train_batch_start(self, trainer, *args):  # noqa: ANN001, ANN002
            nonlocal start
            start = trainer.global_step if start is None else start
            if hold_at is not None and trainer.global_step == hold_at:
                io._checkpointer().wait(60)  # last.ckpt of hold_at (and all before) at the home
                uploads.holding.set()
            elif trainer.global_step == (start if hold_at is None else hold_at) + 1:
                try:
                    removal = io._removals.get(normalize(f"{dirpath}/epoch=0-step={trainer.global_step - 1}.ckpt"))
                    if removal is not None:  # (queued at once; one held back until later is not)
                        removal.result(60)
                    looked.extend(missing_named(last))
                    if ready is not None:
                        ready(trainer)
                finally:
                    uploads.release.set()

    uploads.holding.set() if hold_at is None else None
    trainer = make_trainer(root, io, steps, callbacks=[Look()], dirpath=dirpath, every_n_train_steps=1,
                           save_top_k=1, monitor="step", mode="max", save_last=True)
    if last_name is not None:
        trainer.checkpoint_callback.CHECKPOINT_NAME_LAST = last_name
    last = f"{dirpath}/{last_name or 'last'}.ckpt"
    try:
        trainer.fit(ValModel(), loader(), ckpt_path=ckpt_path)
    finally:
        uploads.release.set()
    assert not missing_named(last)
    return looked, trainer


def test_save_last_true_never_names_a_deleted_best_while_uploads_run_behind(tmp_path):
    """last.ckpt of step 2 lands naming step=2; last.ckpt of step 3 is held. The deletion of step=2
    (asked at step 3) ran once step=3 had landed: the durable last.ckpt named a deleted best."""
    ckdir = str(tmp_path / "ckpt")
    looked, _ = held_fit(str(tmp_path), ckdir, 5, hold_at=2)
    assert looked == []  # was: [.../epoch=0-step=2.ckpt]
    assert sorted(os.listdir(ckdir)) == ["epoch=0-step=5.ckpt", "last.ckpt"]  # none left after teardown


def test_a_url_dirpath_is_covered_too(tmp_path):
    """The same with a URL dirpath (fsspec's memory://): a URL is taken as it is."""
    url = f"memory://fastckpt-last-names-{os.getpid()}/run"
    fs = fsspec.filesystem("memory")
    try:
        looked, _ = held_fit(str(tmp_path), url, 5, hold_at=2)
        assert looked == []  # was: [memory://.../epoch=0-step=2.ckpt]
        files = sorted(n for n in map(os.path.basename, fs.ls(url, detail=False)) if n.endswith(".ckpt"))
        assert files == ["epoch=0-step=5.ckpt", "last.ckpt"]  # (beside them: manifests and `latest`)
    finally:
        fs.rm(url.split("/run")[0], recursive=True)


def test_a_last_file_in_a_subfolder_is_covered_and_top_k_files_still_go(tmp_path):
    """CHECKPOINT_NAME_LAST = "last/last": the last file is ckpt/last/last.ckpt, below the top-k
    files. It is looked at as last.ckpt is, and the top-k files it no longer names are deleted."""
    ckdir = str(tmp_path / "ckpt")
    looked, _ = held_fit(str(tmp_path), ckdir, 5, hold_at=2, last_name="last/last")
    assert looked == []
    assert sorted(os.listdir(ckdir)) == ["epoch=0-step=5.ckpt", "last"]
    assert os.listdir(os.path.join(ckdir, "last")) == ["last.ckpt"]


def test_a_resumed_fit_keeps_the_best_the_last_ckpt_from_before_the_resume_names(tmp_path):
    """fit(ckpt_path="last") from last.ckpt of step 3, which names step=3. The resumed fit deletes
    step=3 at step 4, while its last.ckpt of step 4 is held: the last.ckpt at the home is still
    the one from before the resume, which this fit never saved but read when it needed to know."""
    ckdir = str(tmp_path / "ckpt")
    make_trainer(str(tmp_path), FastCkptIO(), 3, every_n_train_steps=1, save_top_k=1, monitor="step",
                 mode="max", save_last=True).fit(ValModel(), loader())
    looked, trainer = held_fit(str(tmp_path / "resume"), ckdir, 5, hold_at=None, ckpt_path="last")
    assert looked == []  # was: [.../epoch=0-step=3.ckpt]
    assert sorted(os.listdir(ckdir)) == ["epoch=0-step=5.ckpt", "last.ckpt"]


def test_a_kill_while_uploads_run_behind_resumes_with_its_best_file(tmp_path):
    """The whole story: a child process trains as in the first test and is SIGKILLed right after
    the deletion of step=2 ran (or waits), while last.ckpt of step 3 is held. fit(ckpt_path="last")
    then restores last.ckpt of step 2, and validate(ckpt_path="best") loads step=2 (it raised)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]), OMP_NUM_THREADS="1")
    child = subprocess.Popen([sys.executable, "-m", "tests.integration._lightning_last_names_worker", str(tmp_path)],
                             cwd=str(REPO), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
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
    trainer = make_trainer(str(tmp_path / "resume"), FastCkptIO(), 2, dirpath=ckdir, every_n_train_steps=1,
                           save_top_k=1, monitor="step", mode="max", save_last=True)
    model = ValModel()
    trainer.fit(model, loader(), ckpt_path="last")  # restores step 2: max_steps reached, no step trained
    assert trainer.global_step == 2
    assert os.path.exists(trainer.checkpoint_callback.best_model_path)
    trainer.validate(model, loader(), ckpt_path="best")  # raised: the best file was gone
