"""ZeRO-3's weights-only load, through fastckpt.

DeepSpeed's ``_load_checkpoint`` under ZeRO-3 with ``load_optimizer_states=False`` (Lightning's
``trainer.validate(ckpt_path=...)`` among others) takes the module's weights from
``get_fp32_state_dict_from_zero_checkpoint(load_dir)``, never from its checkpoint engine: with no
tag (it reads ``load_dir/latest``: asked for ``t1``, it loaded the weights of the tag ``latest``
names, beside ``t1``'s step counters), a glob of the tag directory as written, and plain
``torch.load(weights_only=False)`` of the files (``deepspeed.utils.zero_to_fp32``:
``parse_model_states`` and ``parse_optim_states``, ``mmap=True``) at ``load_dir`` itself (at an
``s3://`` save_dir, a bare ValueError: the burst-buffer mirror holds no ``latest``). Those bytes
were never verified: with a ``local_dir`` fastckpt checked the burst-buffer copies while DeepSpeed
read save_dir's (a file replaced there since the save loaded unnoticed), and a re-save of the tag
swapped in during the consolidation went unnoticed too (weights of the new save, step counters
of the old).

``weights_only_load`` makes that call, for the one load of this engine in this thread, read the
tag fastckpt resolved, and every file of it through the checkpoint engine's load: verified against
its checksum (from the burst buffer when its copy is complete), from the save pinned for the load
(``Checkpointer.reading``: a re-save swapped in meanwhile raises ``GroupChangedError``, and the
load starts over), unpickled as ``weights_only`` says (a file that passes unpickles to the same
objects under DeepSpeed's own ``torch.load``). DeepSpeed's consolidation module calls
``torch.load`` by its module-global name ``torch``: that name is bound, once, to ``RoutedTorch``,
which is ``torch`` except that ``load`` of a file of the routed tag goes through fastckpt, and
defers to ``torch.load`` everywhere else (other threads, other paths, fastckpt's load not
running). Each file is whole in memory while it is parsed (DeepSpeed mapped the optimizer files).
Before DeepSpeed's load begins every file is also read once through the same load (``verify``), so
that a failure is agreed on by every rank before its collectives (``preread.py``). The
consolidation function is looked up in DeepSpeed's engine module at each call, so it is swapped
there, once, for one that defers to DeepSpeed's own everywhere else.
"""

from __future__ import annotations

import contextlib
import glob
import os
import threading
import types
from collections.abc import Callable, Iterator

from fastckpt.errors import ConfigError

_route = threading.local()  # .where: the directory this thread's DeepSpeed load was given; .tag: the tag;
# .read: the verified load of its files; .done: its consolidation returned (``rejoin.py``: what a rank whose load
# raised still runs)
_FILES = ("_model_states.pt", "_optim_states.pt")  # what DeepSpeed's consolidation reads


def applies(engine: object, kwargs: dict) -> bool:
    """DeepSpeed's load will consolidate the weights itself (see the module docstring)."""
    return bool(engine.zero_optimization_partition_weights() and not kwargs.get("load_optimizer_states", True)  # type: ignore[attr-defined]
                and not engine.has_moe_layers)  # type: ignore[attr-defined]


def as_given(engine: object, kwargs: dict) -> dict:
    """``load_checkpoint``'s ``kwargs`` as DeepSpeed's load is given them. Under ZeRO-3 (no MoE,
    not a universal checkpoint) ``load_module_only=True`` with ``load_optimizer_states`` left True
    loads as ``load_optimizer_states=False`` does, through the consolidation: DeepSpeed's own load
    takes the weights from the model files, which under ZeRO-3 hold empty partitions, skips the
    optimizer files that hold them, and returns without a weight loaded or an error raised."""
    if (kwargs.get("load_module_only") and kwargs.get("load_optimizer_states", True)
            and engine.zero_optimization_partition_weights() and not engine.has_moe_layers  # type: ignore[attr-defined]
            and not engine.load_universal_checkpoint()):  # type: ignore[attr-defined]
        return {**kwargs, "load_optimizer_states": False}
    return kwargs


def verify(where: str, tag: str, read: Callable[[str], object], how: str = "load_optimizer_states=False") -> None:
    """Read every file DeepSpeed's consolidation of ``where/tag`` reads (each rank reads all of
    them, as DeepSpeed does), one at a time, through ``read``.

    Raises:
        ConfigError: ``where`` or ``tag`` holds glob characters, which DeepSpeed's consolidation
            matches as patterns (``how``: the argument that asked for the weights only, named).
    """
    if glob.escape(where) != where or glob.escape(tag) != tag:
        raise ConfigError(f"load_checkpoint({where!r}, tag={tag!r}, {how}) under ZeRO-3 loads the weights only, "
                          "which DeepSpeed reads by globbing that directory and tag, and they hold glob characters "
                          "(*?[): it would read other files. Copy or rename the tag (and its save_dir) to names "
                          "without them, or load the whole state (load_optimizer_states=True, load_module_only=False)")
    folder = os.path.join(where, tag)
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if name.endswith(_FILES):
            read(os.path.join(folder, name))


@contextlib.contextmanager
def weights_only_load(where: str, tag: str, read: Callable[[str, object], object]) -> Iterator[None]:
    """While DeepSpeed's load of ``where/tag`` runs on this thread, its consolidation reads ``tag``,
    each file through ``read(path, map_location)`` (the checkpoint engine's verified load)."""
    import deepspeed.runtime.engine as ds_engine
    import deepspeed.utils.zero_to_fp32 as ds_fp32

    if not getattr(ds_engine.get_fp32_state_dict_from_zero_checkpoint, "_fastckpt", False):
        ds_engine.get_fp32_state_dict_from_zero_checkpoint = _routed(ds_engine.get_fp32_state_dict_from_zero_checkpoint)
    if not isinstance(ds_fp32.torch, RoutedTorch):
        ds_fp32.torch = RoutedTorch(ds_fp32.torch)
    _route.where, _route.tag, _route.read, _route.done = where, tag, read, False
    try:
        yield
    finally:
        _route.where = _route.tag = _route.read = None


class RoutedTorch(types.ModuleType):
    """``torch`` as DeepSpeed's consolidation module names it: every attribute is torch's, but
    ``load`` of a file of the tag routed on this thread (``weights_only_load``) is fastckpt's."""

    def __init__(self, module: types.ModuleType) -> None:
        super().__init__(module.__name__, module.__doc__)
        self._module = module

    def __getattr__(self, name: str) -> object:  # (only names not found on the instance)
        return getattr(self._module, name)

    def load(self, f: object, map_location: object = None, *args: object, **kwargs: object) -> object:
        """``torch.load``; a file under the routed ``where/tag`` is read by the route's ``read``
        (``map_location`` kept; ``mmap`` and ``weights_only`` are the checkpoint engine's)."""
        read, where = getattr(_route, "read", None), getattr(_route, "where", None)
        if read is not None and isinstance(f, (str, os.PathLike)):
            path = os.fspath(f)
            if os.path.dirname(path) == os.path.join(where, _route.tag):
                return read(path, map_location)
        return self._module.load(f, map_location, *args, **kwargs)


def consolidated() -> bool:
    """This thread's DeepSpeed load (inside ``weights_only_load``) returned from its consolidation."""
    return bool(getattr(_route, "done", False))


def _routed(original: Callable) -> Callable:
    def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: object = None, *args: object,
                                                 **kwargs: object) -> object:
        where = getattr(_route, "where", None)
        if where is None or checkpoint_dir != where:
            return original(checkpoint_dir, tag, *args, **kwargs)
        out = original(checkpoint_dir, _route.tag if tag is None else tag, *args, **kwargs)
        _route.done = True
        return out

    get_fp32_state_dict_from_zero_checkpoint._fastckpt = True  # type: ignore[attr-defined]
    return get_fp32_state_dict_from_zero_checkpoint
