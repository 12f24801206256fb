"""The Lightning integration for the standalone ``pytorch_lightning`` package (see ``lightning.py``)."""

from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from pytorch_lightning.callbacks import Callback

from ._lightning import STORAGE_OPTIONS, build

__all__ = ["STORAGE_OPTIONS", "FastCkptCallback", "FastCkptIO", "callbacks_factory"]

FastCkptIO, FastCkptCallback, callbacks_factory = build(__name__, CheckpointIO, Callback)
