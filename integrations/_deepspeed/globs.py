"""DeepSpeed finds a tag's files by globbing the directory and tag it is given
(``DeepSpeedEngine._get_all_ckpt_names``: ``load_dir/tag/mp_rank_*_model_states.pt``; a pipeline
module's layers: ``PipelineModule.ckpt_layer_path_list``), unescaped. A tag ``[1]`` matched tag
``1``'s files and loaded them without a word, ``a*`` several tags' ("checkpoint count ... is
different"), and a ``save_dir`` such as Hydra's ``exp[lr=0.1]`` matched nothing (a bare
AssertionError). ``literal_globs`` wraps both on the instances (DeepSpeed's classes are untouched)
so that the directory and tag are matched as written; only the file-name pattern globs.
"""

from __future__ import annotations

import glob
from collections.abc import Callable


def literal_globs(engine: object) -> Callable[[], None]:
    """Wrap the engine's (and its pipeline module's) globbing of checkpoint files so that the
    directory and tag are escaped; returns what undoes it. A DeepSpeed without these methods
    (another version) is left as it is."""
    undo: list[Callable[[], None]] = []
    own = getattr(engine, "_get_all_ckpt_names", None)
    if callable(own):
        def ckpt_names(checkpoints_path: str, tag: object) -> list[str]:
            return own(glob.escape(str(checkpoints_path)), glob.escape(str(tag)))

        undo.append(_set(engine, "_get_all_ckpt_names", ckpt_names))
    module = getattr(engine, "module", None)
    layers = getattr(module, "ckpt_layer_path_list", None)
    if callable(layers):
        def layer_paths(ckpt_dir: str, local_layer_idx: int) -> list[str]:
            return layers(glob.escape(str(ckpt_dir)), local_layer_idx)

        undo.append(_set(module, "ckpt_layer_path_list", layer_paths))

    def remove() -> None:
        for u in undo:
            u()

    return remove


def _set(obj: object, name: str, fn: Callable) -> Callable[[], None]:
    object.__setattr__(obj, name, fn)

    def remove() -> None:
        if obj.__dict__.get(name) is fn:
            del obj.__dict__[name]

    return remove
