"""The Lightning integration for the standalone ``pytorch_lightning`` package.

Same classes as ``fastckpt.integrations.lightning``, built on ``pytorch_lightning`` and
``lightning_fabric`` (a Trainer rejects plugins of the other package)::

    from fastckpt.integrations.pytorch_lightning import FastCkptIO
"""

from __future__ import annotations

from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from pytorch_lightning.callbacks import Callback

from ._lightning_callback import FastCkptCallbackMixin
from ._lightning_common import STORAGE_OPTIONS, FastCkptIOMixin

__all__ = ["STORAGE_OPTIONS", "FastCkptCallback", "FastCkptIO", "callbacks_factory"]


class FastCkptIO(FastCkptIOMixin, CheckpointIO):
    __doc__ = FastCkptIOMixin.__doc__
    _PACKAGE = "pytorch_lightning"
    _OTHER_BUILD = "fastckpt.integrations.lightning"


class FastCkptCallback(FastCkptCallbackMixin, Callback):
    __doc__ = FastCkptCallbackMixin.__doc__


def callbacks_factory() -> list[Callback]:
    """The ``pytorch_lightning.callbacks_factory`` entry point (see the lightning build)."""
    return [FastCkptCallback()] if len(FastCkptIO._live) else []
