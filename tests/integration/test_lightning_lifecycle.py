"""FastCkptIO inside Lightning's own expectations (issue #9 items 12 and 13): no thread of
fastckpt outlives the Trainer (nor a call after fit), ModelCheckpoint's version suffixes never
reuse the name of a checkpoint still in flight, and the SLURM auto-requeue checkpoint exists
before the requeue."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import fastckpt
from fastckpt.errors import CheckpointWriteError
from fastckpt.integrations.lightning import FastCkptIO
from fastckpt.testing import Fault, FaultyOps
from tests.integration.test_lightning import TinyModel, loader, make_trainer


def _fastckpt_threads(before: frozenset) -> list[str]:
    """fastckpt's threads alive now that were not in ``before``. An earlier test's Checkpointer
    that was dropped without close() keeps its idle threads until the garbage collector frees it;
    those are not this Trainer's."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("fastckpt") and t not in before)


class Boom(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 5:
            raise RuntimeError("boom")


@pytest.mark.parametrize("how", ["fit", "validate", "exception in fit"])
def test_no_fastckpt_thread_outlives_the_trainer(tmp_path, how: str) -> None:
    before = frozenset(threading.enumerate())
    io = FastCkptIO(local_dir=str(tmp_path / "nvme"))  # burst buffer: replication threads too
    trainer = make_trainer(str(tmp_path), io, max_steps=6, callbacks=[Boom()] if how == "exception in fit" else [],
                           every_n_train_steps=2, save_top_k=-1)
    model = TinyModel()
    model.validation_step = lambda batch, batch_idx: None
    if how == "exception in fit":
        with pytest.raises(RuntimeError, match="boom"):
            trainer.fit(model, loader())
    elif how == "fit":
        trainer.fit(model, loader())
    else:
        trainer.fit(model, loader())
        trainer.validate(model, loader())
    assert _fastckpt_threads(before) == []


def test_calls_after_fit_finish_before_they_return_and_leave_no_thread(tmp_path) -> None:
    """After fit no teardown follows: save, load and remove each do their work before they return
    (as TorchCheckpointIO does; the burst-buffer copy goes too) and close what they opened."""
    before = frozenset(threading.enumerate())
    nvme = tmp_path / "nvme"
    trainer = make_trainer(str(tmp_path), FastCkptIO(local_dir=str(nvme)), max_steps=2, every_n_train_steps=2)
    trainer.fit(TinyModel(), loader())
    assert _fastckpt_threads(before) == []
    path = str(tmp_path / "final.ckpt")
    trainer.save_checkpoint(path)
    assert _fastckpt_threads(before) == []
    assert trainer.strategy.load_checkpoint(path)["global_step"] == 2
    assert _fastckpt_threads(before) == []
    trainer.strategy.remove_checkpoint(path)
    assert not os.path.exists(path)
    assert [f for _, _, files in os.walk(nvme) for f in files if "final.ckpt" in f] == []
    assert _fastckpt_threads(before) == []


def test_plugin_outside_a_trainer_finishes_each_call_before_it_returns(tmp_path) -> None:
    """Never connected to a Trainer (used directly, or ddp_spawn's parent process): no teardown
    will flush, so save and remove do their work before they return and leave no thread."""
    before = frozenset(threading.enumerate())
    io, path = FastCkptIO(), str(tmp_path / "direct.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        io.save_checkpoint({"w": torch.ones(3)}, path)
    assert _fastckpt_threads(before) == []
    assert [str(w.message) for w in caught if "finishes before it returns" in str(w.message)] != []
    assert torch.equal(fastckpt.load(path)["w"], torch.ones(3))
    io.remove_checkpoint(path)
    assert not os.path.exists(path)
    assert _fastckpt_threads(before) == []


class OpenAtEnd(Callback):
    def __init__(self, gate) -> None:  # noqa: ANN001
        self.gate = gate

    def on_train_end(self, trainer, pl_module):
        self.gate.open()  # every save of the fit was chosen a name while in flight


def test_loading_last_link_waits_for_its_target_in_flight(tmp_path) -> None:
    """save_last="link": the link to step=2.ckpt, whose save is held before its final rename, is
    made only once that save is durable (last.ckpt never names a file that is not there).
    Loading last.ckpt meanwhile waits for the link, and so for the save; the spy lets the save
    land only once the load waits."""
    ops = FaultyOps()
    gate = ops.gate("replace", path_contains="step=2.ckpt")
    io = FastCkptIO(ops=ops)
    loaded: dict = {}

    class LoadLast(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step != 2 or loaded:
                return
            last = trainer.checkpoint_callback.last_model_path
            loaded["there"] = os.path.lexists(last)
            real_settle = io._settle_removal

            def settle(path):  # noqa: ANN001, ANN202
                loaded["waited"] = path
                gate.open()
                return real_settle(path)

            io._settle_removal = settle  # type: ignore[method-assign]
            try:
                loaded["step"] = trainer.strategy.load_checkpoint(last)["global_step"]
            finally:
                io._settle_removal = real_settle  # type: ignore[method-assign]
                gate.open()

    trainer = make_trainer(str(tmp_path), io, 3, callbacks=[LoadLast()], every_n_train_steps=2, save_last="link")
    trainer.fit(TinyModel(), loader())
    assert loaded == {"there": False, "waited": str(tmp_path / "ckpt" / "last.ckpt"), "step": 2}
    assert os.path.realpath(tmp_path / "ckpt" / "last.ckpt") == str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt")


def test_last_link_keeps_a_complete_target_when_the_newest_save_is_skipped(tmp_path) -> None:
    """when_busy="skip" drops the saves of steps 2 and 3 while step 1's is still being written:
    once, last.ckpt was linked to a skipped file anyway, dangled after a clean fit, and
    ckpt_path="last" silently started over from step 0. It keeps naming step 1 now."""
    ops = FaultyOps()
    gate = ops.gate("pwrite", path_contains="step=1")  # opened at on_train_end, after step 3's save was asked for
    io = FastCkptIO(checkpointer=fastckpt.Checkpointer(ops=ops, when_busy="skip"))
    mc = {"every_n_train_steps": 1, "save_top_k": 1, "monitor": "step", "mode": "max", "save_last": "link"}
    try:
        trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, plugins=[io], logger=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                            num_sanity_val_steps=0,
                            callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), **mc), OpenAtEnd(gate)])
        trainer.fit(TinyModel(), loader())
    finally:
        gate.open()
    last = tmp_path / "ckpt" / "last.ckpt"
    assert os.path.exists(last) and os.path.realpath(last) == str(tmp_path / "ckpt" / "epoch=0-step=1.ckpt")
    started: list[int] = []

    class Start(Callback):
        def on_train_start(self, trainer, pl_module):
            started.append(trainer.global_step)

    resumed = make_trainer(str(tmp_path), FastCkptIO(), 4, callbacks=[Start()], **mc)
    resumed.fit(TinyModel(), loader(), ckpt_path="last")
    assert started == [1]  # from step 1, not from 0


def _resumed_from_last(root: str, ckdir: str) -> int:
    """The global step a new fit with ckpt_path="last" starts at, for the checkpoints in ``ckdir``."""
    started: list[int] = []

    class Start(Callback):
        def on_train_start(self, trainer, pl_module):
            started.append(trainer.global_step)

    mc = {"dirpath": ckdir, "every_n_train_steps": 1, "save_top_k": 1, "monitor": "step", "mode": "max",
          "save_last": "link"}
    make_trainer(root, FastCkptIO(), 6, callbacks=[Start()], **mc).fit(TinyModel(), loader(), ckpt_path="last")
    return started[0]


def test_last_link_never_names_a_skipped_save_meanwhile(tmp_path) -> None:
    """when_busy="skip": step 1 is durable and linked, step 2 is held mid-write, so step 3's save
    is skipped. Lightning used to link last.ckpt to the skipped file at once (only a save in
    flight had its link queued): a job killed then left last.ckpt dangling and ckpt_path="last"
    started over from step 0. The kill is a copy of the directory taken at that moment."""
    ops = FaultyOps()
    gate = ops.gate("pwrite", path_contains="step=2.ckpt")
    io = FastCkptIO(checkpointer=fastckpt.Checkpointer(ops=ops, when_busy="skip"))
    ckdir, killed = tmp_path / "ckpt", tmp_path / "as_left_by_a_kill"
    last = ckdir / "last.ckpt"

    class KillAtStep3(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 1:  # step 1 durable, and its queued link made
                io._ck.wait()
                trainer.strategy.load_checkpoint(str(last))
            elif trainer.global_step == 3:  # step 2 held in its write, step 3 skipped
                assert gate.wait_entered(60)
                shutil.copytree(ckdir, killed, symlinks=True)
                gate.open()

    try:
        make_trainer(str(tmp_path), io, 4, callbacks=[KillAtStep3()], every_n_train_steps=1, save_top_k=1,
                     monitor="step", mode="max", save_last="link").fit(TinyModel(), loader())
    finally:
        gate.open()
        io._ck.close()
    assert os.path.realpath(killed / "last.ckpt") == str(killed / "epoch=0-step=1.ckpt")
    assert _resumed_from_last(str(tmp_path), str(killed)) == 1  # from step 1, not from 0


def test_last_link_never_names_a_save_that_failed_already(tmp_path, caplog) -> None:
    """Step 2's write fails (ENOSPC) before ModelCheckpoint links last.ckpt to it, as a fast
    failure does. Only a save still in flight had its link queued, so Lightning linked last.ckpt
    to the missing file for good, and ckpt_path="last" started over from step 0."""
    ops = FaultyOps([Fault("pwrite", errno.ENOSPC, path_contains="step=2.ckpt")])
    gate = ops.gate("pwrite", path_contains="step=2.ckpt")  # fails once opened
    io = FastCkptIO(ops=ops)
    save = io.save_checkpoint

    def save_checkpoint(checkpoint, path, storage_options=None):  # noqa: ANN001, ANN202
        save(checkpoint, path, storage_options)
        if "step=2.ckpt" in str(path):  # returned with the write held: let it fail before the link
            gate.open()
            with contextlib.suppress(Exception):  # its error is raised once, by the training thread
                io._saves.tracked[-1].handle.result()

    io.save_checkpoint = save_checkpoint  # type: ignore[method-assign]
    ckdir = tmp_path / "ckpt"
    trainer = make_trainer(str(tmp_path), io, 4, every_n_train_steps=1, save_top_k=1, monitor="step", mode="max",
                           save_last="link")
    with caplog.at_level(logging.WARNING, logger="fastckpt.lightning"), pytest.raises(CheckpointWriteError):
        trainer.fit(TinyModel(), loader())
    ops.assert_all_reached()
    assert os.path.realpath(ckdir / "last.ckpt") == str(ckdir / "epoch=0-step=1.ckpt")
    kept = [r.getMessage() for r in caplog.records if "still names the checkpoint before" in r.getMessage()]
    assert len(kept) == 1 and "step=2.ckpt" in kept[0] and "failed" in kept[0]
    assert _resumed_from_last(str(tmp_path), str(ckdir)) == 1


def test_version_suffixes_count_saves_in_flight(tmp_path) -> None:
    """ModelCheckpoint(filename="test", save_top_k=-1, monitor=...) names later checkpoints test-v1.ckpt,
    test-v2.ckpt... only if the earlier file exists. No file is renamed into place until the fit
    ends, so every earlier save is still in flight when the next name is chosen."""
    from fastckpt import Checkpointer

    ops = FaultyOps()
    gate = ops.gate("replace")
    ck = Checkpointer(ops=ops, replicate_policy="all", staging_buffers=4)  # the held saves each keep one
    io = FastCkptIO(checkpointer=ck)
    mc = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), filename="test", save_top_k=-1, every_n_train_steps=2,
                         monitor="step", mode="max")
    trainer = L.Trainer(max_steps=8, accelerator="cpu", devices=1, plugins=[io], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        num_sanity_val_steps=0, callbacks=[OpenAtEnd(gate), mc])
    try:
        trainer.fit(TinyModel(), loader())
    finally:
        gate.open()
        ck.close()
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names == ["test-v1.ckpt", "test-v2.ckpt", "test-v3.ckpt", "test.ckpt"]
    assert len(mc.best_k_models) == 4
    assert "file_exists" not in mc.__dict__  # restored at teardown


SLURM_JOB = textwrap.dedent("""
    import os, signal, sys
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    sys.path.insert(0, {repo!r})
    import fastckpt
    from fastckpt.integrations.lightning import FastCkptIO
    from fastckpt.records import SaveHandle
    from fastckpt.testing import FaultyOps
    from tests.integration.test_lightning import TinyModel, loader

    ops = FaultyOps()
    renamed = ops.gate("replace")  # no checkpoint is renamed into place until someone waits for it
    real_wait = SaveHandle.wait

    def wait(self, timeout=None):
        renamed.open()
        return real_wait(self, timeout)

    SaveHandle.wait = wait

    class Preempted(Callback):  # SLURM's warning signal (sbatch --signal=USR1@90) at step 2
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2 and {signal_at_2}:
                os.kill(os.getpid(), signal.SIGUSR1)

    io = FastCkptIO(checkpointer=fastckpt.Checkpointer(ops=ops))
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, plugins=[io], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir={root!r}, callbacks=[Preempted()])
    trainer.fit(TinyModel(), loader())
    print("resumed from", trainer.ckpt_path)
""")


def test_slurm_requeue_checkpoint_is_durable_before_scontrol_requeue(lightning_python, tmp_path) -> None:
    """Lightning's SLURM handler saves hpc_ckpt_1.ckpt, then runs `scontrol requeue`, which ends
    the job. A fake scontrol on PATH lists the directory, then SIGKILLs the job as SLURM would.
    Renames into place are held until a save is waited for, so an asynchronous save would show
    no checkpoint at requeue; the requeued job resumes from it (Lightning finds hpc_ckpt_*)."""
    root, bin_dir = tmp_path / "root", tmp_path / "bin"
    root.mkdir()
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/bash\nls -a {root} > {tmp_path / "at_requeue.txt"}\nkill -9 $PPID\n')
    scontrol.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1",
               SLURM_JOB_NAME="train", SLURM_JOB_ID="123", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
               SLURM_NODELIST="localhost", SLURM_CPUS_ON_NODE="2")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def job(signal_at_2: bool) -> subprocess.CompletedProcess:
        script = SLURM_JOB.format(repo=repo, root=str(root), signal_at_2=signal_at_2)
        return lightning_python.run_code(script, [], 300, env)

    first = job(signal_at_2=True)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    at_requeue = (tmp_path / "at_requeue.txt").read_text().split()
    assert "hpc_ckpt_1.ckpt" in at_requeue
    assert fastckpt.load(str(root / "hpc_ckpt_1.ckpt"))["global_step"] == 2

    # A later preemption's save of hpc_ckpt_2.ckpt killed before its rename leaves a temp file
    # beside hpc_ckpt_1.ckpt. Lightning's resume takes the digits after "hpc_ckpt_" in every
    # name holding it: a temp name carrying the file's name would send it to a version that
    # does not exist.
    killed = subprocess.Popen([sys.executable, "-c", KILLED_SAVE.format(repo=repo, path=str(root / "hpc_ckpt_2.ckpt"))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert killed.stdout.readline().strip() == "renaming", killed.communicate(timeout=60)
    killed.kill()
    killed.wait(timeout=60)
    leftovers = [n for n in os.listdir(root) if n.startswith(".") and n not in (".", "..")]
    assert leftovers and "hpc_ckpt_2.ckpt" not in os.listdir(root), os.listdir(root)

    second = job(signal_at_2=False)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {root / 'hpc_ckpt_1.ckpt'}" in second.stdout


KILLED_SAVE = textwrap.dedent("""
    import sys, threading
    sys.path.insert(0, {repo!r})
    import torch
    import fastckpt
    from fastckpt.testing import FaultyOps

    def hook(op, path):
        if op == "replace":  # the temp file is written and fsynced: stop here until killed
            print("renaming", flush=True)
            threading.Event().wait()

    ck = fastckpt.Checkpointer(ops=FaultyOps(on_call=hook))
    ck.save({{"w": torch.ones(1024)}}, {path!r})
    ck.wait()
""")


LINK_JOB = textwrap.dedent("""
    import os, signal, sys
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    sys.path.insert(0, {repo!r})
    import fastckpt
    from fastckpt.integrations.lightning import FastCkptIO
    from fastckpt.integrations._lightning.link import LINK
    from fastckpt.testing import FaultyOps
    from fastckpt.urls import normalize
    from tests.integration.test_lightning import TinyModel, loader

    ops = FaultyOps()
    ops.gate("replace", path_contains="step=6")  # the step-6 save is in flight when the job dies

    last = os.path.join({ckpt!r}, "last.ckpt")

    class Kill(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 5:
                # step 4's link, queued on the plugin's remover thread at its save, is made (a loaded
                # machine had linked nothing yet when the kill came)
                trainer.strategy.checkpoint_io._removals[LINK + normalize(last)].result(120)
            elif trainer.global_step == 6:
                os.kill(os.getpid(), signal.SIGKILL)

    mc = ModelCheckpoint(dirpath={ckpt!r}, every_n_train_steps=2, save_top_k=1, monitor="step", mode="max",
                         save_last="link")
    trainer = L.Trainer(max_steps=100, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Kill(), mc],
                        plugins=[FastCkptIO(checkpointer=fastckpt.Checkpointer(ops=ops))])
    trainer.fit(TinyModel(), loader())
""")


def test_last_link_survives_a_kill_while_its_next_target_is_saved(lightning_python, tmp_path) -> None:
    """save_last="link" and ckpt_path="last" (docs/lightning.md's resume): a job killed with
    the step-6 save in flight. last.ckpt was linked to the step-6 file before it existed, so
    Lightning dropped the dangling link and the resume started over from step 0; now last.ckpt
    names the newest checkpoint that is durable."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ckpt = tmp_path / "ckpt"
    job = lightning_python.run_code(LINK_JOB.format(repo=repo, ckpt=str(ckpt)), [], 300)
    assert job.returncode == -signal.SIGKILL, job.stderr[-3000:]
    target = os.path.realpath(ckpt / "last.ckpt")
    assert target == str(ckpt / "epoch=0-step=4.ckpt")
    step = fastckpt.load(target)["global_step"]
    started: list[int] = []

    class Start(Callback):
        def on_train_start(self, trainer, pl_module):
            started.append(trainer.global_step)

    resumed = make_trainer(str(tmp_path), FastCkptIO(), 6, callbacks=[Start()], every_n_train_steps=2,
                           save_top_k=1, monitor="step", mode="max", save_last="link")
    resumed.fit(TinyModel(), loader(), ckpt_path="last")
    assert started == [step]


def test_a_retry_with_the_same_model_checkpoint_after_a_crash_counts_saves_in_flight(tmp_path) -> None:
    """Lightning calls no teardown hook after an exception: the ModelCheckpoint kept a
    file_exists wrapper tied to the crashed run's plugin, so a retry with a new Trainer and
    plugin but the same ModelCheckpoint reused the names of its saves in flight and overwrote
    checkpoints the user asked to keep (save_top_k=-1)."""
    from fastckpt import Checkpointer

    class Boom(TinyModel):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    mc = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), filename="{epoch}", every_n_train_steps=1, save_top_k=-1,
                         monitor="step", mode="max")

    def trainer(io: FastCkptIO, max_steps: int, *extra: Callback) -> L.Trainer:
        return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, plugins=[io], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=str(tmp_path), callbacks=[*extra, mc])

    with pytest.raises(RuntimeError, match="boom"):
        trainer(FastCkptIO(), 3).fit(Boom(), loader())
    assert "file_exists" not in mc.__dict__ and "_link_checkpoint" not in mc.__dict__  # restored at the crash
    ops = FaultyOps()
    gate = ops.gate("replace")  # every save of the retry is in flight when the next one picks its name
    ck = Checkpointer(ops=ops, staging_buffers=4)
    try:
        trainer(FastCkptIO(checkpointer=ck), 3, OpenAtEnd(gate)).fit(TinyModel(), loader())
    finally:
        gate.open()
        ck.close()
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["epoch=0-v1.ckpt", "epoch=0-v2.ckpt", "epoch=0.ckpt"]


def test_a_save_during_validate_is_synchronous(tmp_path) -> None:
    """Outside fit no teardown hook flushes under every strategy (FSDPStrategy's never reaches
    CheckpointIO.teardown): a trainer.save_checkpoint in validate() is durable when it returns."""
    path = tmp_path / "during_validate.ckpt"
    seen: dict = {}

    class SaveInValidation(Callback):
        def on_validation_end(self, trainer, pl_module):
            trainer.save_checkpoint(str(path))
            seen["exists"] = path.exists()

    class Validated(TinyModel):
        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    io = FastCkptIO()
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[io], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[SaveInValidation()])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nor the "not connected to a Trainer" warning
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers|val_dataloader).*")
        trainer.validate(Validated(), loader())
    assert seen == {"exists": True} and io._ck is None  # nothing of fastckpt left running


class FadingScore(TinyModel):
    """Its "score" improves for the first 4 steps and never after: a resumed fit makes no top-k
    save, so every save_last of it links last.ckpt to the last.ckpt it saved whole."""

    def training_step(self, batch, batch_idx):
        self.log("score", float(-self.global_step if self.global_step < 4 else 100 + self.global_step))
        return super().training_step(batch, batch_idx)


def test_last_link_to_itself_keeps_the_checkpoint_there(tmp_path) -> None:
    """After fit(ckpt_path="last"), Lightning saves last.ckpt whole, then asks to link last.ckpt
    to last.ckpt, which it skips itself. The plugin made that link: last.ckpt became a symlink to
    itself, the checkpoint there was gone and the next ckpt_path="last" trained from step 0."""
    def fit(steps: int, started: list[int], ckpt_path: str | None = None) -> None:
        class Start(Callback):
            def on_train_start(self, trainer, pl_module):
                started.append(trainer.global_step)

        make_trainer(str(tmp_path), FastCkptIO(), steps, callbacks=[Start()], monitor="score", mode="min",
                     save_top_k=1, every_n_train_steps=1, save_last="link").fit(FadingScore(), loader(),
                                                                                 ckpt_path=ckpt_path)

    started: list[int] = []
    fit(4, started)
    fit(7, started, "last")
    last = tmp_path / "ckpt" / "last.ckpt"
    assert not last.is_symlink()
    step = fastckpt.load(str(last))["global_step"]
    fit(9, started, "last")
    assert started == [0, 4, step] and step >= 5
