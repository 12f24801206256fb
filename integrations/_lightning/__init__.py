"""The Lightning plugin, written once; ``build`` makes the classes for one Lightning package.

Lightning ships its classes twice (``lightning`` and ``pytorch_lightning``) and a Trainer of one
rejects a plugin built on the other, so ``fastckpt.integrations.lightning`` and
``fastckpt.integrations.pytorch_lightning`` each call ``build`` with their package's
``CheckpointIO`` and ``Callback``. See ``plugin.py`` for who calls what.
"""

from __future__ import annotations

from collections.abc import Callable

from .callback import FastCkptCallbackMixin
from .options import STORAGE_OPTIONS
from .plugin import FastCkptIOMixin

__all__ = ["STORAGE_OPTIONS", "build"]

_PACKAGES = {"lightning": "fastckpt.integrations.pytorch_lightning",
             "pytorch_lightning": "fastckpt.integrations.lightning"}


def build(module: str, checkpoint_io: type, callback: type) -> tuple[type, type, Callable[[], list]]:
    """``FastCkptIO``, ``FastCkptCallback`` and the ``callbacks_factory`` entry point for the
    Lightning package that ``module`` (``fastckpt.integrations.<package>``) is named after."""
    package = module.rsplit(".", 1)[1]

    def named(name: str, bases: tuple[type, ...], doc: str | None, **attrs: object) -> type:
        return type(name, bases, {"__module__": module, "__qualname__": name, "__doc__": doc, **attrs})

    io_cls = named("FastCkptIO", (FastCkptIOMixin, checkpoint_io), FastCkptIOMixin.__doc__,
                   _PACKAGE=package, _OTHER_BUILD=_PACKAGES[package])
    cb_cls = named("FastCkptCallback", (FastCkptCallbackMixin, callback), FastCkptCallbackMixin.__doc__)

    def callbacks_factory() -> list:
        """The ``callbacks_factory`` entry point: Lightning calls it in every ``Trainer.__init__``;
        it adds a FastCkptCallback only while a FastCkptIO exists."""
        return [cb_cls()] if len(io_cls._live) else []

    callbacks_factory.__module__ = module
    return io_cls, cb_cls, callbacks_factory
