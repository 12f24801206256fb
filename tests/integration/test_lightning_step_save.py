"""The files Lightning saves for one training step are one save for the overhead monitor and the
event log: ``ModelCheckpoint(save_last=True)`` saves one state twice (its top-k file, then
``last.ckpt``), and two ModelCheckpoints save at one step. Each file counted as a save, so the first
checkpoint raised the overhead alarm (the milliseconds between the two files were the interval) and
the alarm's advice was sized from one file. Real Trainer, real event log, its replay by the CLI."""

from __future__ import annotations

import json
import os

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import fastckpt  # noqa: E402
from fastckpt.cli import main  # noqa: E402
from fastckpt.integrations.lightning import FastCkptIO  # noqa: E402

from .test_lightning import TinyModel, loader, make_trainer  # noqa: E402


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_steps_top_k_file_and_last_file_are_one_save(tmp_path, capsys, lazy: bool) -> None:
    log = tmp_path / "events.jsonl"
    # (the overhead itself is not judged here: a 9-step run of a tiny model is mostly its saves)
    ck = fastckpt.Checkpointer(event_log=str(log), overhead_budget=0.99)
    io = FastCkptIO(checkpointer=ck, lazy_snapshot=lazy)
    second = ModelCheckpoint(dirpath=str(tmp_path / "every"), every_n_train_steps=3, save_top_k=-1,
                             mode="max")  # another state_key: two ModelCheckpoints in one Trainer
    trainer = make_trainer(str(tmp_path), io, 9, callbacks=[second], every_n_train_steps=3, save_last=True)
    trainer.fit(TinyModel(), loader())
    ck.wait()
    saves = ck.stats().saves
    ck.close()
    files = len(os.listdir(tmp_path / "ckpt")) + len(os.listdir(tmp_path / "every"))
    assert saves == 3 and files >= 4, (saves, files)  # steps 3, 6 and 9: was 9 (three files each)
    main(["report", str(log), "--json"])  # (its exit code is the overhead alarm's: not judged here)
    report = json.loads(capsys.readouterr().out)
    assert report["saves"] == 3 and report["files"] == 9 and report["ranks"][0]["saves"] == 3, report


def test_saves_of_different_steps_are_not_joined(tmp_path) -> None:
    """A save at each step (every_n_train_steps=1) is a save each, as before."""
    ck = fastckpt.Checkpointer(overhead_budget=0.99)
    trainer = make_trainer(str(tmp_path), FastCkptIO(checkpointer=ck), 4, every_n_train_steps=1, save_top_k=-1)
    trainer.fit(TinyModel(), loader())
    ck.wait()
    assert ck.stats().saves == 4
    ck.close()


def test_a_save_from_another_thread_during_fit_is_a_save_of_its_own(tmp_path) -> None:
    """A user's ``trainer.save_checkpoint`` from a worker thread while the training thread's block
    of a step was open took over the plugin's one block: the training thread's block was closed on
    the worker, and every later save on the training thread joined a closed block (never counted,
    no alarm). A block is the training thread's now; the worker's save counts alone."""
    import threading

    class SideSave(L.Callback):
        def on_train_batch_start(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
            if trainer.global_step == 3:  # step 3's save made, the block open until the next fence
                t = threading.Thread(target=trainer.save_checkpoint, args=(str(tmp_path / "side.ckpt"),))
                t.start()
                t.join()

    ck = fastckpt.Checkpointer(overhead_budget=0.99)
    trainer = make_trainer(str(tmp_path), FastCkptIO(checkpointer=ck), 4, callbacks=[SideSave()],
                           every_n_train_steps=3, save_top_k=-1)
    trainer.fit(TinyModel(), loader())
    ck.wait()
    assert ck.stats().saves == 2  # step 3's file, side.ckpt
    for i in range(3):  # the training thread's own saves after fit, outside any block
        ck.save({"w": torch.zeros(4)}, str(tmp_path / f"after-{i}.pt")).wait()
    assert ck.stats().saves == 5 and ck._monitor.current() is None
    ck.close()
