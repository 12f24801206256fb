"""FastCkptIO(metrics_port=...): a Lightning run's checkpoints scraped over HTTP during fit."""

from __future__ import annotations

import pickle
import urllib.error
import urllib.request

import pytest

L = pytest.importorskip("lightning")
pytest.importorskip("prometheus_client")
from fastckpt.integrations.lightning import FastCkptIO  # noqa: E402

from ._scrape import scrape, value  # noqa: E402
from .test_lightning import TinyModel, loader, make_trainer  # noqa: E402


class _Scraper(L.Callback):
    """Scrapes the plugin's endpoint at the end of a training batch, after a checkpoint was saved."""

    def __init__(self, io: FastCkptIO, at_step: int) -> None:
        self.io, self.at_step, self.samples, self.url = io, at_step, None, None

    def on_train_batch_end(self, trainer, *args: object) -> None:
        if trainer.global_step == self.at_step:
            self.url = self.io.metrics_url
            self.samples = scrape(self.url)


def test_metrics_served_during_fit(tmp_path):
    io = FastCkptIO(local_dir=str(tmp_path / "nvme"), metrics_port=0)
    spy = _Scraper(io, at_step=5)
    trainer = make_trainer(str(tmp_path), io, 6, callbacks=[spy], every_n_train_steps=2, save_top_k=-1)
    trainer.fit(TinyModel(), loader())
    lab = {"rank": "0", "tier": "nvme"}
    assert value(spy.samples, "fastckpt_saves_total", **lab) == 2  # steps 2 and 4
    assert value(spy.samples, "fastckpt_save_blocked_seconds_count", **lab) == 2
    assert value(spy.samples, "fastckpt_overhead_budget_ratio", rank="0") == 0.02
    assert io.metrics_url is None  # teardown closed the Checkpointer and its endpoint
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(spy.url, timeout=5)


def test_metrics_port_is_validated_and_pickled():
    from fastckpt import ConfigError

    with pytest.raises(ConfigError, match="metrics_port"):
        FastCkptIO(metrics_port=-5)
    assert pickle.loads(pickle.dumps(FastCkptIO(metrics_port=9400))).config.metrics_port == 9400


def test_a_failed_resume_is_one_failed_load(tmp_path):
    """A Trainer resuming from a damaged checkpoint: the plugin's load raises, and the event log
    holds one failed ``load`` event (the core's), not none (before) and not two."""
    import json

    from fastckpt.errors import CorruptCheckpointError

    io = FastCkptIO(event_log=str(tmp_path / "fit.jsonl"))
    make_trainer(str(tmp_path), io, 2, every_n_train_steps=2).fit(TinyModel(), loader())
    (ckpt,) = (tmp_path / "ckpt").glob("*.ckpt")
    with open(ckpt, "r+b") as f:  # one damaged region in the tensor data
        f.seek(ckpt.stat().st_size // 2)
        f.write(b"\xff\xfe\xfd\xfc")
    log = tmp_path / "resume.jsonl"
    with pytest.raises(CorruptCheckpointError):
        make_trainer(str(tmp_path), FastCkptIO(event_log=str(log)), 4, every_n_train_steps=2).fit(
            TinyModel(), loader(), ckpt_path=str(ckpt))
    loads = [e for e in map(json.loads, log.read_text().splitlines()) if e["name"] == "load"]
    assert [(e["path"], e["error"].split("(")[0]) for e in loads] == [(str(ckpt), "CorruptCheckpointError")]
