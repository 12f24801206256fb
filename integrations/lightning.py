"""Lightning integration: ``Trainer(plugins=[FastCkptIO(local_dir=...)])`` (docs/lightning.md).

This is the build for the unified ``lightning`` package; ``fastckpt.integrations.pytorch_lightning``
holds the same classes for the standalone ``pytorch_lightning`` package. The logic is in
``_lightning_common``.
"""

from __future__ import annotations

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Callback

from ._lightning_callback import FastCkptCallbackMixin
from ._lightning_common import STORAGE_OPTIONS, FastCkptIOMixin

__all__ = ["STORAGE_OPTIONS", "FastCkptCallback", "FastCkptIO", "callbacks_factory"]


class FastCkptIO(FastCkptIOMixin, CheckpointIO):
    __doc__ = FastCkptIOMixin.__doc__
    _PACKAGE = "lightning"
    _OTHER_BUILD = "fastckpt.integrations.pytorch_lightning"


class FastCkptCallback(FastCkptCallbackMixin, Callback):
    __doc__ = FastCkptCallbackMixin.__doc__


def callbacks_factory() -> list[Callback]:
    """The ``lightning.pytorch.callbacks_factory`` entry point: Lightning calls it in every
    ``Trainer.__init__``; it adds a FastCkptCallback only while a FastCkptIO exists."""
    return [FastCkptCallback()] if len(FastCkptIO._live) else []
