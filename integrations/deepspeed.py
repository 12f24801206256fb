"""DeepSpeed integration: a ``"fastckpt"`` section in the DeepSpeed config turns on saves that
return after a snapshot, atomic per-tag group commits and a ``latest`` that only names complete
checkpoints (docs/deepspeed.md).

The one line a user changes is the import::

    from fastckpt.integrations.deepspeed import initialize   # instead of deepspeed.initialize
    engine, optimizer, _, scheduler = initialize(model=model, optimizer=opt, config="ds_config.json")
    engine.save_checkpoint(save_dir, tag)   # returns after the snapshot, on every rank
    engine.load_checkpoint(save_dir)        # the newest complete tag

with ``"fastckpt": {"local_dir": "/local_nvme/ckpt"}`` in ``ds_config.json``. DeepSpeed picks its
checkpoint engine from its own config only (it ignores unknown keys), so the section is read
here and the engine installed in code; ``attach(engine)`` does the same for an engine built
elsewhere (Lightning's ``DeepSpeedStrategy`` goes through ``install``, see FastCkptIO).

The pieces: ``_deepspeed.config`` (the section), ``_deepspeed.engine`` (the CheckpointEngine:
one call per file), ``_deepspeed.hooks`` (wrappers of the engine's public save_checkpoint,
load_checkpoint and destroy: ``latest``, resume, flushing, reporting; and, for a lazy snapshot,
of its optimizer's step: the fence), ``_deepspeed.globs`` (DeepSpeed's globbing of a tag's files,
made to match the directory and tag as written).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

import deepspeed
import torch
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.runtime.engine import DeepSpeedEngine

from fastckpt import Checkpointer, SaveHandle
from fastckpt.errors import ConfigError

from ._deepspeed import config as section_rules
from ._deepspeed.config import SECTION, Section, parse_section, read_config, redacted, section_of, whole_config
from ._deepspeed.engine import SAFE_GLOBALS, FastCkptEngine
from ._deepspeed.hooks import CheckpointReport, EngineHooks, OwnedCheckpointer, fenced_tensors, resolve_tag
from ._deepspeed.unsafe import refuse_unsafe_config

__all__ = ["FastCkptEngine", "CheckpointReport", "SAFE_GLOBALS", "attach", "initialize", "install", "resolve_tag"]

_HOOKS = "_fastckpt_hooks"  # the engine attribute holding its EngineHooks


def initialize(args: object = None, model: torch.nn.Module | None = None,
               optimizer: torch.optim.Optimizer | Callable | None = None,
               model_parameters: Iterable | None = None, training_data: torch.utils.data.Dataset | None = None,
               lr_scheduler: object = None, distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
               mpu: object = None, dist_init_required: bool | None = None, collate_fn: Callable | None = None,
               config: str | dict | None = None, mesh_param: object = None,
               config_params: str | dict | None = None) -> tuple:
    """``deepspeed.initialize`` with fastckpt attached when the config has a ``"fastckpt"`` section.

    Same arguments and return value as ``deepspeed.initialize``. The section is validated
    before DeepSpeed starts; fsspec credentials in it (``storage_options``) are not passed on to
    DeepSpeed, which prints its config and stores it in every ZeRO checkpoint.

    Raises:
        ConfigError: the section has an unknown key or a value of the wrong type (the message
            lists the valid keys).
        ConfigError: the config also picks another checkpoint engine or layout (a ``"checkpoint"``
            ``"writer"``, ``"use_node_local_storage"``, ``"datastates_ckpt"``).
        ConfigError: the config has no ``"fastckpt"`` section but a key that looks like a
            misspelt one (``"fast_ckpt"``, ``"FastCkpt"``): DeepSpeed would ignore it.
    """
    source = config if config is not None else config_params
    from_args = source is None and args is not None
    if from_args:
        source = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    ds_config = read_config(source)
    section = section_of(ds_config)
    if section.enabled:
        section_rules.refuse_other_writers(ds_config)  # before DeepSpeed builds its engine (a decoupled one forks)
    if ds_config is not None and redacted(ds_config) is not ds_config:  # enabled or not: DeepSpeed keeps it
        if from_args:  # DeepSpeed refuses both args.deepspeed_config and config: pass a copy of args
            import copy

            args = copy.copy(args)
            args.deepspeed_config = args.deepscale_config = None
        config, config_params = redacted(ds_config), None
    out = deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                               training_data=training_data, lr_scheduler=lr_scheduler,
                               distributed_port=distributed_port, mpu=mpu, dist_init_required=dist_init_required,
                               collate_fn=collate_fn, config=config, mesh_param=mesh_param,
                               config_params=config_params)
    if section.enabled:
        attach(out[0], section)
    return out


def attach(engine: DeepSpeedEngine, config: str | Mapping | Section | None = None, *,
           checkpointer: Checkpointer | None = None,
           on_commit: Callable[[SaveHandle], None] | None = None) -> FastCkptEngine | None:
    """Make ``engine`` (a ``DeepSpeedEngine``) save and load through fastckpt.

    Args:
        engine: from ``deepspeed.initialize``.
        config: the ``"fastckpt"`` section (a dict), or a whole DeepSpeed config (dict or file
            path) holding one; None reads the section of the config the engine was built with.
            No section at all means the defaults; ``"enabled": false`` leaves the engine alone.
        checkpointer: a Checkpointer of your own (for options a config cannot hold, such as
            ``on_overhead_exceeded``); the section may then hold only ``enabled`` and
            ``weights_only``. You close it; ``destroy()`` and interpreter exit flush it.
        on_commit: called with each checkpoint's group-commit SaveHandle; the caller then
            reports and waits for them (FastCkptIO does) instead of this integration.

    Returns:
        The installed FastCkptEngine, or None when the section says ``"enabled": false``.

    Raises:
        ConfigError: an invalid section (also a misspelt section name, see ``initialize``),
            options given twice, or an engine config that picks another checkpoint engine or
            layout (see ``initialize``).
    """
    if not hasattr(engine, "save_checkpoint") or not hasattr(engine, "checkpoint_engine"):
        raise TypeError(f"attach() needs a deepspeed.DeepSpeedEngine (from deepspeed.initialize), "
                        f"got {type(engine).__name__}")
    section = _section(engine, config)
    _redact(engine)
    if not section.enabled:
        return None
    if checkpointer is not None and section.options:
        raise ConfigError(f"attach(engine, checkpointer=...) uses that Checkpointer's settings; do not also set "
                          f'{sorted(section.options)} in the "{SECTION}" section (set them on the Checkpointer)')
    return _install(engine, checkpointer, section, on_commit)


def install(engine: DeepSpeedEngine, checkpointer: Checkpointer | Callable[[], Checkpointer] | None = None,
            on_commit: Callable[[SaveHandle], None] | None = None, *,
            lazy_snapshot: bool = False) -> FastCkptEngine | None:
    """``attach`` for code that already holds a Checkpointer, or a function returning the one to
    use now (FastCkptIO with Lightning's DeepSpeedStrategy); None creates one from the section.

    The ``"fastckpt"`` section of the engine's DeepSpeed config (Lightning:
    ``DeepSpeedStrategy(config=...)``) is honoured: ``"enabled": false`` leaves the engine alone,
    ``weights_only`` is taken from it, ``"lazy_snapshot": true`` turns the lazy snapshot on as
    ``lazy_snapshot`` does. Without ``weights_only`` there, loads unpickle anything
    (``weights_only=False``), as DeepSpeed's own engine under Lightning does: Lightning keeps the
    module's hyper-parameters, of any type, in every checkpoint.

    Raises:
        ConfigError: an invalid section, or one with Checkpointer options while ``checkpointer``
            is given (set them on FastCkptIO, or on that Checkpointer).
            Or the engine's config picks another checkpoint engine or layout (see ``initialize``).
    """
    section = _section(engine, None)
    _redact(engine)
    if not section.enabled:
        return None
    if checkpointer is not None and section.options:
        raise ConfigError(f"FastCkptIO (and install(engine, checkpointer)) saves through its own Checkpointer; do not "
                          f'also set {sorted(section.options)} in the "{SECTION}" section of the DeepSpeed config: '
                          "pass them to FastCkptIO(...) (or to that Checkpointer)")
    section = replace(section, weights_only=False if section.weights_only is None else section.weights_only,
                      lazy_snapshot=section.lazy_snapshot or lazy_snapshot)
    return _install(engine, checkpointer, section, on_commit)


def _section(engine: DeepSpeedEngine, config: str | Mapping | Section | None) -> Section:
    if isinstance(config, Section):
        return config
    if config is None:
        ds_config = getattr(engine, "config", None)
        if isinstance(ds_config, dict):
            if SECTION not in ds_config:
                section_rules.refuse_misspelt(ds_config, "the engine's DeepSpeed config")
                return Section()
            return parse_section(ds_config[SECTION], "the engine's DeepSpeed config")
        return Section()
    if isinstance(config, Mapping) and not whole_config(config):
        try:
            return parse_section(config, "attach(config=...)")
        except ConfigError as exc:
            exc.add_note(f'(attach read this dict as the "{SECTION}" section itself: it has no "{SECTION}" key and '
                         "no key it knows as DeepSpeed's. If it is a whole DeepSpeed config, add "
                         f'"{SECTION}": {{}} to it for the defaults, or call attach(engine) to use the config the '
                         "engine was built with)")
            raise
    whole = read_config(config)
    if whole is not None and SECTION not in whole:  # no section: the defaults
        section_rules.refuse_misspelt(whole, "the DeepSpeed config given to attach")
        return Section()
    return section_of(whole)


def _redact(engine: DeepSpeedEngine) -> None:
    """Replace the engine's config by a copy without fsspec credentials, whatever config
    ``attach`` was given (the engine's own, a whole config, its path): DeepSpeed stores
    ``engine.config`` in every checkpoint file. A copy: the dict is the user's."""
    ds_config = getattr(engine, "config", None)
    if isinstance(ds_config, dict) and redacted(ds_config) is not ds_config:
        engine.config = redacted(ds_config)


def _install(engine: DeepSpeedEngine, source: Checkpointer | Callable[[], Checkpointer] | None, section: Section,
             on_commit: Callable[[SaveHandle], None] | None) -> FastCkptEngine:
    section_rules.refuse_other_writers(getattr(engine, "config", None))
    previous: EngineHooks | None = getattr(engine, _HOOKS, None)
    if previous is not None:  # attached before (a second fit on the same engine): flush, then replace
        previous.close()
        previous.uninstall()
    weights_only = section.weights_only is not False  # unset: True (attach's default)
    if weights_only and isinstance(getattr(engine, "config", None), dict):  # stored in every checkpoint file
        refuse_unsafe_config(engine.config, SAFE_GLOBALS)
    owned = OwnedCheckpointer(section.options) if source is None else None
    fe = FastCkptEngine(owned if owned is not None else source, on_commit,  # type: ignore[arg-type]
                        weights_only=weights_only,
                        fenced=(lambda: fenced_tensors(engine)) if section.lazy_snapshot else None)
    hooks = EngineHooks(engine, fe, owned, flush_at_exit=source is None or isinstance(source, Checkpointer))
    hooks.install()
    object.__setattr__(engine, _HOOKS, hooks)
    return fe
