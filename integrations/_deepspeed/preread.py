"""Every rank reads and verifies the files DeepSpeed's ``load_checkpoint`` will ask it for before
that load begins, so that a load fails, if it fails, before DeepSpeed's first collective.

DeepSpeed's load runs collectives between and after its file reads (ZeRO-3 gathers its persistent
parameters in ``checkpoint_event_epilogue``, on every rank, at the end of the load). A rank whose
read raised (its own model file damaged, a re-save swapped in, a file a safe load refuses) went to
fastckpt's agreement all-reduce while the others went on into that gather: the two collectives
never paired, and every rank hung until the process group's timeout. Read first, the ranks agree
on the outcome (``agree.agree_on_load``) before any rank enters DeepSpeed's load, and DeepSpeed's
reads of those files are then served from memory (``FastCkptEngine.preread``), each object once.

The files are the ones DeepSpeed's own naming methods give for this rank (its model file, and its
ZeRO optimizer partition when optimizer states are loaded). What is not predicted here (MoE expert
files, a pipeline module's layer files, merging or splitting files across a changed model-parallel
size, universal checkpoints) is read by DeepSpeed as before, inside its load. The cost: this rank's
model and optimizer files are held in memory together, where DeepSpeed held one after the other.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from deepspeed import comm as dist

from . import fp32


def model_files(engine: object, where: str, tag: str) -> list[str]:
    """The model-state files DeepSpeed's ``_load_checkpoint`` reads on this rank (its
    ``SDLoader``: the file of this rank's model-parallel index when the counts match); [] when
    it would merge or split several (inference-only resizing: read by DeepSpeed itself)."""
    from deepspeed.runtime.pipe.module import PipelineModule

    names = engine._get_all_ckpt_names(where, tag)  # type: ignore[attr-defined]  # (escaped: globs.literal_globs)
    mp_world_size, mp_rank = engine.mp_world_size, engine.checkpoint_mp_rank  # type: ignore[attr-defined]
    if not names:
        return []  # DeepSpeed's own error, named by the hooks (a missing tag or file)
    if isinstance(engine.module, PipelineModule) and len(names) != mp_world_size:  # type: ignore[attr-defined]
        return [names[0]]
    return [names[mp_rank * len(names) // mp_world_size]] if len(names) == mp_world_size else []


def optimizer_files(engine: object, where: str, tag: str, model_state: object) -> list[str]:
    """The ZeRO optimizer-state files ``_load_zero_checkpoint`` reads on this rank (its own
    partition; every rank's with an elastic checkpoint), given the model file it loaded
    (``dp_world_size``); [] when it reads none, or raises its own error first (another
    data-parallel size)."""
    e = engine
    dp_world_size = model_state.get("dp_world_size") if isinstance(model_state, dict) else None
    if not isinstance(dp_world_size, int) or e.seq_dp_world_size != dp_world_size:  # type: ignore[attr-defined]
        return []
    bf16 = e.bfloat16_enabled()  # type: ignore[attr-defined]
    names = [e._get_rank_zero_ckpt_name(where, tag, e.checkpoint_mp_rank, i, bf16)  # type: ignore[attr-defined]
             for i in range(dp_world_size)]
    for i, name in enumerate(names):  # DeepSpeed's fallback to the old name of these files
        old = name.replace("_optim_states.pt", "optim_states.pt")
        if not os.path.exists(name) and os.path.exists(old):
            names[i] = old
    if e.zero_elastic_checkpoint():  # type: ignore[attr-defined]
        return names
    own = dist.get_rank(group=e.optimizer.dp_process_group)  # type: ignore[attr-defined]
    return [names[own]] if own < len(names) else []


def reads_optimizer_files(engine: object, kwargs: dict) -> bool:
    """DeepSpeed's load with ``kwargs`` reads the ``*optim_states.pt`` files: a load of the
    optimizer states, a universal checkpoint's, or any load under ZeRO-3, whose model files hold
    empty partitions (the weights are in those files: its weights-only consolidation, ``fp32.py``,
    and an MoE model's experts read them). A load of the weights only (``load_module_only=True``,
    or ``load_optimizer_states=False``) outside ZeRO-3 never opens them."""
    if kwargs.get("load_optimizer_states", True) and not kwargs.get("load_module_only", False):
        return True
    return bool(engine.zero_optimization_partition_weights()  # type: ignore[attr-defined]
                or engine.load_universal_checkpoint())  # type: ignore[attr-defined]


def preread(engine: object, where: str, tag: str, kwargs: dict, read: Callable[[str], object],
            check: Callable[[str], object]) -> None:
    """Read (``read``: the checkpoint engine's verified load, kept for DeepSpeed's) the files this
    rank's DeepSpeed load of ``where/tag`` will ask for; ``check`` (the same load, not kept) the
    ones ZeRO-3's weights-only consolidation reads (through the same load again, ``fp32.py``).
    Raises what a read raised."""
    e = engine
    if e.load_universal_checkpoint():  # type: ignore[attr-defined]
        return
    if fp32.applies(e, kwargs):
        fp32.verify(where, tag, check, "load_module_only=True" if kwargs.get("load_module_only") else
                    "load_optimizer_states=False")
    models = model_files(e, where, tag)
    first = None
    for i, path in enumerate(models):
        obj = read(path)
        first = obj if i == 0 else first
    optimizer_states = kwargs.get("load_optimizer_states", True) and not kwargs.get("load_module_only", False)
    if (not models or not optimizer_states or e.optimizer is None  # type: ignore[attr-defined]
            or not e.zero_optimization() or e.zero_nvme_offload_optimizer()):  # type: ignore[attr-defined]
        return
    for path in optimizer_files(e, where, tag, first):
        read(path)
