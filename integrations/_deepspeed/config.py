"""The ``"fastckpt"`` section of a DeepSpeed config, read and validated once, where the engine
is built (``initialize`` before DeepSpeed starts; ``attach`` for an engine built elsewhere).

The section holds ``enabled``, ``weights_only``, ``lazy_snapshot`` and the Checkpointer options (the fields of
``fastckpt.config.CheckpointerConfig``); docs/deepspeed.md lists them all. DeepSpeed ignores
keys it does not know, so a typo here would silently turn nothing on: every key and type is
checked, and an error lists the valid keys.
"""

from __future__ import annotations

import copy
import difflib
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType, NoneType

from fastckpt import config as config_module
from fastckpt.config import CheckpointerConfig
from fastckpt.errors import ConfigError

SECTION = "fastckpt"
#: The section's own keys (not Checkpointer options): name -> (type, meaning).
OWN_KEYS: dict[str, tuple[type, str]] = {
    "enabled": (bool, "false leaves DeepSpeed's own checkpoint engine in place (default true)"),
    "weights_only": (bool, "false unpickles checkpoints with arbitrary Python objects: only for files you "
                           "trust (default true: tensors, plain types and DeepSpeed's own classes)"),
    "lazy_snapshot": (bool, ("copy parameters and optimizer state while the next step's forward and backward run; "
                             "the optimizer step waits for the copy (default false)")),
}
#: Checkpointer options that a config file cannot carry, and where they go instead.
NOT_IN_CONFIG = {
    "on_overhead_exceeded": "a function: pass "
                            "attach(engine, checkpointer=fastckpt.Checkpointer(on_overhead_exceeded=...))",
    "rank": "taken from torch.distributed",
    "world_size": "taken from torch.distributed",
    "ops": "an object (the FileOps seam): pass attach(engine, checkpointer=fastckpt.Checkpointer(ops=...))",
    "sinks": "objects (EventSinks): pass attach(engine, checkpointer=fastckpt.Checkpointer(sinks=...))",
    "store": "an object (a torch.distributed Store; the default process group's is used): pass "
             "attach(engine, checkpointer=fastckpt.Checkpointer(store=...))",
}
#: Option values never written back into the config DeepSpeed keeps (it prints its config at
#: start-up and stores it in every ZeRO checkpoint file).
SECRET_KEYS = ("storage_options",)
#: Top-level keys of DeepSpeed's config (its docs' sections and top-level options). A dict with one
#: of them is a whole config (``whole_config``); DeepSpeed's nested names (``pin_memory``,
#: ``use_gds``, ``type``, ...) tell nothing, as a user may have meant them for the section.
DEEPSPEED_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
    "gradient_clipping", "prescale_gradients", "gradient_predivide_factor", "wall_clock_breakdown",
    "memory_breakdown", "dump_state", "sparse_gradients", "communication_data_type",
    "seq_parallel_communication_data_type", "disable_allgather", "dataloader_drop_last",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "use_data_before_expert_parallelism",
    "load_universal", "use_node_local_storage", "data_types", "torch_autocast", "zero_optimization", "optimizer",
    "scheduler", "fp16", "bf16", "amp", "checkpoint", "activation_checkpointing", "flops_profiler", "aio",
    "data_efficiency", "curriculum_learning", "autotuning", "comms_logger", "tensorboard", "wandb", "csv_monitor",
    "comet", "elasticity", "compression_training", "pipeline", "sparse_attention", "nebula", "hybrid_engine",
    "compile", "tensor_parallel", "weight_quantization", "datastates_ckpt", "eigenvalue",
    "progressive_layer_drop", "quantize_training", "timers", "graph_harvesting", "mics_shard_size"})
REDACTED = "<redacted by fastckpt>"


@dataclass(frozen=True)
class Section:
    """A validated ``"fastckpt"`` section.

    Attributes:
        enabled: False leaves DeepSpeed alone.
        weights_only: load with ``torch.load(weights_only=True)`` plus DeepSpeed's classes;
            None when the section does not say: each entry point applies its documented default
            (``attach``: True; ``install``, Lightning's path: False).
        lazy_snapshot: saves return before the tensors are copied; the optimizer step waits.
        options: keyword arguments for ``fastckpt.Checkpointer`` (already validated).
    """

    enabled: bool = True
    weights_only: bool | None = None
    lazy_snapshot: bool = False
    options: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))


def _option_types() -> dict[str, tuple[type, ...]]:
    namespace = vars(config_module)  # the options a config can carry have plain JSON types
    out: dict[str, tuple[type, ...]] = {}
    for f in fields(CheckpointerConfig):
        if f.name in NOT_IN_CONFIG:
            continue
        hint = eval(f.type, namespace) if isinstance(f.type, str) else f.type  # noqa: S307 (our own annotation)
        args = [typing.get_origin(a) or a for a in typing.get_args(hint) or (hint,)]  # Sequence[str]: Sequence
        out[f.name] = tuple(list if a is Sequence else a for a in args  # JSON: a list, and no Path (local_dir)
                            if isinstance(a, type) and a is not os.PathLike)
    return out


def _type_name(types: tuple[type, ...]) -> str:
    json_names = {NoneType: "null", float: "number", dict: "object", list: "list of str"}
    names = [json_names.get(t, t.__name__) for t in types]
    return " or ".join(names)


def valid_keys() -> str:
    """Every key the section accepts, with its type, for error messages."""
    own = [f"{k} ({t.__name__})" for k, (t, _) in OWN_KEYS.items()]
    return ", ".join(own + [f"{k} ({_type_name(t)})" for k, t in _option_types().items()])


def _type_ok(value: object, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # a bool is an int to Python, never a number to a config
        return bool in types
    if isinstance(value, int) and float in types or isinstance(value, tuple) and list in types:
        return True
    return isinstance(value, types)


def parse_section(raw: object, where: str = "the DeepSpeed config") -> Section:
    """Validate a ``"fastckpt"`` section (a dict).

    Raises:
        ConfigError: not a dict (also null: ``"fastckpt": null``, or YAML's empty ``fastckpt:``,
            may mean "on, with the defaults" as much as "off", and either guess is silently wrong
            for some user), an unknown key, a value of the wrong type, or a value the
            Checkpointer refuses; the message names the key and lists the valid keys.
    """
    if raw is None:
        raise ConfigError(f'"{SECTION}" in {where} is null: write "{SECTION}": {{}} to save through fastckpt with '
                          f'its defaults, or "{SECTION}": {{"enabled": false}} (or no "{SECTION}" section) to keep '
                          "DeepSpeed's own checkpoint engine")
    if not isinstance(raw, Mapping):
        raise ConfigError(f'"{SECTION}" in {where} must be an object of options, got {type(raw).__name__}; '
                          f"valid keys: {valid_keys()}")
    types = _option_types()
    misplaced = sorted(k for k in raw if k in NOT_IN_CONFIG)
    if misplaced:
        raise ConfigError(f'"{SECTION}" in {where}: {", ".join(f"{k} is {NOT_IN_CONFIG[k]}" for k in misplaced)}')
    unknown = sorted(k for k in raw if k not in types and k not in OWN_KEYS)
    if unknown:
        raise ConfigError(f'unknown key(s) {unknown} in the "{SECTION}" section of {where}; '
                          f"valid keys: {valid_keys()}")
    for key, value in raw.items():
        want = (OWN_KEYS[key][0],) if key in OWN_KEYS else types[key]
        if not _type_ok(value, want):
            raise ConfigError(f'"{SECTION}.{key}" in {where} must be {_type_name(want)}, got {value!r}; '
                              f"valid keys: {valid_keys()}")
    options = {k: v for k, v in raw.items() if k not in OWN_KEYS}
    try:
        CheckpointerConfig(**options)  # type: ignore[arg-type]
    except ConfigError as exc:
        exc.add_note(f'(in the "{SECTION}" section of {where})')
        raise
    weights_only = raw.get("weights_only")
    return Section(bool(raw.get("enabled", True)), None if weights_only is None else bool(weights_only),
                   bool(raw.get("lazy_snapshot", False)), MappingProxyType(dict(options)))


def read_config(config: str | Mapping | None) -> dict | None:
    """A DeepSpeed config given as DeepSpeed accepts it: a dict, a JSON/HJSON file path, or
    base64 JSON. None stays None."""
    if config is None:
        return None
    if isinstance(config, Mapping):
        return dict(config)
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    return load_ds_config(config)


def section_of(config: Mapping | None, where: str = "the DeepSpeed config") -> Section:
    """The validated section of a whole DeepSpeed config (disabled when there is none).

    Raises:
        ConfigError: see ``parse_section``; or there is no section but a key that looks like a
            misspelt one (``refuse_misspelt``).
    """
    if config is None:
        return Section(enabled=False)
    if SECTION not in config:
        refuse_misspelt(config, where)
        return Section(enabled=False)
    return parse_section(config[SECTION], where)


def misspelt(config: Mapping) -> str | None:
    """A top-level key of ``config`` (which has no ``"fastckpt"``) that looks like a misspelt
    ``"fastckpt"``: the same letters in another case or with ``_``/``-`` (``"fast_ckpt"``,
    ``"FastCkpt"``), ``fastckpt`` with more around it (``"fastckpt_config"``), or a close match
    that starts as it does (``"fastckp"``; a user's own ``"last_ckpt"`` is as close, and is not
    one); None otherwise."""
    for key in config:
        if not isinstance(key, str):
            continue
        plain = key.lower().replace("_", "").replace("-", "")
        close = plain.startswith("fast") and difflib.SequenceMatcher(None, plain, SECTION).ratio() >= 0.8
        if SECTION in plain or close:
            return key
    return None


def refuse_misspelt(config: Mapping, where: str) -> None:
    """DeepSpeed ignores keys it does not know, so a misspelt section would leave DeepSpeed's own
    checkpoint engine in place without a word.

    Raises:
        ConfigError: naming the key and the fix.
    """
    key = misspelt(config)
    if key is not None:
        raise ConfigError(f'{key!r} in {where} looks like a misspelt "{SECTION}" section, which DeepSpeed would '
                          f'ignore without a word (saves would go through DeepSpeed\'s own checkpoint engine): '
                          f'rename it "{SECTION}", or remove it to keep DeepSpeed\'s own engine')


def section_keys() -> frozenset[str]:
    """Every key the section accepts, and those it refuses with advice (``NOT_IN_CONFIG``)."""
    return frozenset(OWN_KEYS) | frozenset(_option_types()) | frozenset(NOT_IN_CONFIG)


def whole_config(config: Mapping) -> bool:
    """``config`` is a whole DeepSpeed config, not a section: it has a section (also a misspelt
    one), or none of the section's keys and one of DeepSpeed's top-level keys (``DEEPSPEED_KEYS``)."""
    if SECTION in config or misspelt(config) is not None:
        return True
    return not any(k in section_keys() for k in config) and any(k in DEEPSPEED_KEYS for k in config)


def redacted(config: dict) -> dict:
    """``config`` with the section's secrets (fsspec credentials) replaced, for DeepSpeed to keep."""
    raw = config.get(SECTION)
    if not isinstance(raw, Mapping) or not any(isinstance(raw.get(k), Mapping) for k in SECRET_KEYS):
        return config
    out = dict(config)
    out[SECTION] = {k: ({kk: REDACTED for kk in v} if k in SECRET_KEYS and isinstance(v, Mapping) else copy.copy(v))
                    for k, v in raw.items()}
    return out


def refuse_other_writers(config: Mapping | None) -> None:
    """Refuse the DeepSpeed options that pick another checkpoint engine or file layout: with the
    section on, fastckpt replaces DeepSpeed's checkpoint engine, so they would be dropped without
    a word (a FastPersist ``writer``, DataStates) or break the group commit
    (``use_node_local_storage`` names ZeRO files by local rank: two nodes write the same name).

    Raises:
        ConfigError: naming each such option, and the fix.
    """
    if not isinstance(config, Mapping):
        return
    ckpt = config.get("checkpoint")
    ckpt = ckpt if isinstance(ckpt, Mapping) else {}
    found = []
    if ckpt.get("writer") is not None:
        found.append('"checkpoint": {"writer": ...} (DeepSpeed\'s FastPersist writer)')
    if ckpt.get("use_node_local_storage"):
        found.append('"checkpoint": {"use_node_local_storage": true}')
    if config.get("datastates_ckpt", False) is not False:
        found.append('"datastates_ckpt" (the DataStates engine)')
    if found:
        raise ConfigError(f"{' and '.join(found)} in the DeepSpeed config picks another checkpoint engine or file "
                          f'layout, but the "{SECTION}" section replaces DeepSpeed\'s checkpoint engine: remove '
                          f'{"them" if len(found) > 1 else "it"}, or set "{SECTION}": {{"enabled": false}} to keep '
                          f"DeepSpeed's own (for a copy on each node's own drive, fastckpt's \"local_dir\" is a "
                          "burst buffer)")
