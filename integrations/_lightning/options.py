"""What FastCkptIO accepts: its Checkpointer options, Lightning's ``storage_options``, and the
saves Lightning expects on disk when ``save_checkpoint`` returns."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from fastckpt.config import CheckpointerConfig, option_names
from fastckpt.errors import ConfigError
from fastckpt.urls import is_url

#: The ``storage_options`` keys FastCkptIO understands (``Trainer.save_checkpoint(...,
#: storage_options=...)``); any other key is rejected by name.
STORAGE_OPTIONS = {"wait": "True: return only once the checkpoint is durable at its path"}

#: The name Lightning's SLURM auto-requeue handler gives its checkpoint (``hpc_save_path``:
#: ``<default_root_dir>/hpc_ckpt_<N>.ckpt``): it saves it, then runs ``scontrol requeue``, which
#: ends the job, and the requeued job resumes from the highest N it finds.
REQUEUE_CHECKPOINT = re.compile(r"hpc_ckpt_\d+\.ckpt")


def checkpointer_config(**options: object) -> CheckpointerConfig:
    """The Checkpointer options FastCkptIO was given, validated; an unknown name lists the valid ones."""
    unknown = sorted(set(options) - set(option_names()))
    if unknown:
        raise ConfigError(f"FastCkptIO got unknown option(s) {unknown}; it takes local_dir, lazy_snapshot, "
                          f"staging_buffers, checkpointer and the Checkpointer options: {', '.join(option_names())}")
    return CheckpointerConfig(**options)  # type: ignore[arg-type]


def refuse_keep_persistent(config: CheckpointerConfig) -> None:
    """With a ModelCheckpoint (checked at setup): ``keep_persistent`` trims the checkpoints at
    their path by age, while ModelCheckpoint decides which of them stay (by its metric): together
    they deleted the best one, which it still names. Without one it is the retention there is."""
    if config.keep_persistent is not None:
        raise ConfigError(f"FastCkptIO: keep_persistent={config.keep_persistent} deletes the oldest checkpoints at "
                          "their path, but ModelCheckpoint decides which stay there (save_top_k, best_model_path, "
                          "last.ckpt): together they delete checkpoints it still names. Drop keep_persistent and "
                          "give ModelCheckpoint(save_top_k=N) (keep_local still bounds the burst buffer)")


def refuse_url_without_local_dir(config: CheckpointerConfig, dirpaths: list[str]) -> None:
    """At setup: a ModelCheckpoint ``dirpath`` that is a URL needs a burst buffer to upload from.
    Found only at the first save, the error came after ``every_n_train_steps`` of training."""
    urls = [d for d in dirpaths if is_url(d)]
    if urls and not config.local_dirs:
        raise ConfigError(f"FastCkptIO: ModelCheckpoint saves under {urls[0]}, a URL: saving there needs "
                          "local_dir=<node-local directory>, the burst buffer each checkpoint is uploaded from. "
                          "Give FastCkptIO(local_dir=...) (or a Checkpointer with one), or a local dirpath")


def parse_storage_options(storage_options: object) -> bool:
    """Returns ``wait``. Unknown keys are rejected by name."""
    if storage_options is None:
        return False
    if not isinstance(storage_options, Mapping):
        raise TypeError(f"storage_options must be a dict (FastCkptIO understands {sorted(STORAGE_OPTIONS)}), "
                        f"got {type(storage_options).__name__}")
    unknown = sorted(set(storage_options) - set(STORAGE_OPTIONS))
    if unknown:
        known = "; ".join(f"{k!r}: {v}" for k, v in STORAGE_OPTIONS.items())
        raise ConfigError(f"storage_options {unknown} not understood by FastCkptIO (it understands {known}). "
                          "Storage settings are FastCkptIO(...) arguments: local_dir, tier, and storage_options "
                          "for fsspec credentials of a URL dirpath.")
    return bool(storage_options.get("wait", False))



def is_requeue_checkpoint(path: str) -> bool:
    """Whether Lightning saves ``path`` right before the job is requeued (and killed), so the
    save must be durable when ``save_checkpoint`` returns. Lightning tells a CheckpointIO nothing
    else about that save (it calls ``trainer.save_checkpoint(path)`` from its signal handler):
    its file name is the one public mark, and the one its resume looks for."""
    return REQUEUE_CHECKPOINT.fullmatch(os.path.basename(path)) is not None
