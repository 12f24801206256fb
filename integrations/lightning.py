"""Lightning integration: ``Trainer(plugins=[FastCkptIO(local_dir=...)])`` (docs/lightning.md).

The build for the unified ``lightning`` package; ``fastckpt.integrations.pytorch_lightning`` is
the same plugin for the standalone ``pytorch_lightning`` package. The logic is in ``_lightning``.
"""

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Callback

from ._lightning import STORAGE_OPTIONS, build

__all__ = ["STORAGE_OPTIONS", "FastCkptCallback", "FastCkptIO", "callbacks_factory"]

FastCkptIO, FastCkptCallback, callbacks_factory = build(__name__, CheckpointIO, Callback)
