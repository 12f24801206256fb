"""A Ctrl-C (a real SIGINT, so a KeyboardInterrupt) that lands in save() while it hands the
staging buffer on: the buffer goes back unless a writer job has it, so the next save gets it.

The signal is raised where a Ctrl-C can be delivered: inside the real executor's ``submit``
(Python code), before or after it queued the job. ``when_busy="skip"`` with one staging buffer
makes a leaked buffer visible at once: the next save is skipped instead of waiting for ever."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import Executor

import pytest
import torch

import fastckpt


def _state(step: int) -> dict:
    return {"w": torch.full((1 << 18,), step, dtype=torch.int32), "step": step}


def _interrupt_submit(monkeypatch: pytest.MonkeyPatch, executor: Executor, after: bool,
                      before_signal: threading.Event | None = None) -> None:
    """The next ``executor.submit`` gets a SIGINT: before it queues the job, or after (then, with
    ``before_signal``, only once that event is set)."""
    real = executor.submit

    def submit(*args: object, **kwargs: object):
        monkeypatch.setattr(executor, "submit", real)
        if not after:
            signal.raise_signal(signal.SIGINT)
        fut = real(*args, **kwargs)
        if before_signal is not None:
            assert before_signal.wait(30)
        signal.raise_signal(signal.SIGINT)
        return fut

    monkeypatch.setattr(executor, "submit", submit)


@pytest.mark.parametrize("mode", ["eager", "lazy-copy", "lazy-write", "overlapped"])
def test_a_ctrl_c_before_the_job_is_queued_gives_the_buffer_back(tmp_path, monkeypatch, mode: str) -> None:
    """Before: the buffer stayed with the interrupted save, and every later save waited for it."""
    with fastckpt.Checkpointer(staging_buffers=1, when_busy="skip", overlap_write=mode == "overlapped") as ck:
        lazy = mode.startswith("lazy")
        ck.save(_state(0), str(tmp_path / "warm.pt"), lazy=lazy).wait(30)
        saver = ck._saver
        _interrupt_submit(monkeypatch, saver._snap_thread if mode == "lazy-copy" else saver._write_threads[0],
                          after=False)
        with pytest.raises(KeyboardInterrupt):
            ck.save(_state(1), str(tmp_path / "a.pt"), lazy=lazy)
        ck.fence()
        rec = ck.save(_state(2), str(tmp_path / "b.pt"), lazy=lazy).wait(30)
        assert not rec.skipped and ck.load(rec.path)["step"] == 2
    assert not (tmp_path / "a.pt").exists()


@pytest.mark.parametrize("lazy", [False, True])
def test_a_ctrl_c_after_the_job_was_queued_before_it_ran(tmp_path, monkeypatch, lazy: bool) -> None:
    """The writer job was queued but had not started (the writer was busy): the buffer goes back
    and the job, when its turn comes, writes nothing (the save raised)."""
    with fastckpt.Checkpointer(staging_buffers=1, when_busy="skip") as ck:
        ck.save(_state(0), str(tmp_path / "warm.pt"), lazy=lazy).wait(30)
        writer = ck._saver._write_threads[0]
        gate = threading.Event()
        busy = writer.submit(gate.wait, 30)  # the writer thread is busy with something else
        _interrupt_submit(monkeypatch, writer, after=True)
        with pytest.raises(KeyboardInterrupt):
            ck.save(_state(1), str(tmp_path / "a.pt"), lazy=lazy)
        ck.fence()
        gate.set()
        assert busy.result(30)
        writer.submit(lambda: None).result(30)  # the interrupted save's job has run (and done nothing)
        rec = ck.save(_state(2), str(tmp_path / "b.pt"), lazy=lazy).wait(30)
        assert not rec.skipped and ck.load(rec.path)["step"] == 2
    assert not (tmp_path / "a.pt").exists()


def test_a_ctrl_c_after_the_writer_took_the_buffer_leaves_it_to_the_writer(tmp_path, monkeypatch) -> None:
    """The writer job started first: it owns the buffer, writes the file and releases the buffer
    once; the interrupted call does not release it a second time under the next save."""
    with fastckpt.Checkpointer(staging_buffers=1, when_busy="skip") as ck:
        ck.save(_state(0), str(tmp_path / "warm.pt")).wait(30)
        took = threading.Event()
        real_taken = ck._staging.taken

        def taken(lease) -> bool:  # spy: the writer job has decided
            got = real_taken(lease)
            took.set()
            return got

        monkeypatch.setattr(ck._staging, "taken", taken)
        writer = ck._saver._write_threads[0]
        _interrupt_submit(monkeypatch, writer, after=True, before_signal=took)
        with pytest.raises(KeyboardInterrupt):
            ck.save(_state(1), str(tmp_path / "a.pt"))
        writer.submit(lambda: None).result(30)  # the interrupted save's write has ended
        assert torch.load(tmp_path / "a.pt", weights_only=True)["step"] == 1
        rec = ck.save(_state(2), str(tmp_path / "b.pt")).wait(30)
        assert not rec.skipped and ck.load(rec.path)["step"] == 2
        assert ck._staging._buffers[0].owner is None  # released once, by the writer of b.pt
