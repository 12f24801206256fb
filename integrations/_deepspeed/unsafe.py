"""What in a ``client_state`` a load with ``weights_only=True`` would refuse, known at the save.

fastckpt loads DeepSpeed checkpoints with ``weights_only=True`` by default (``SAFE_GLOBALS`` added).
A ``client_state`` holding other classes (``numpy.random.get_state()``, numpy scalars, a class of
the user's) saves fine, and its resume failed with ``UnpicklingError``, possibly days later. Each
save asks torch which globals of the ``client_state`` its safe unpickler would refuse, on a copy
whose tensors are empty (the structure alone: a few milliseconds), and warns once per set.
"""

from __future__ import annotations

import io
from collections.abc import Iterable

import torch

_warned: set[tuple[str, ...]] = set()


def _skeleton(obj: object, depth: int = 0) -> object:
    """``obj`` with every tensor replaced by an empty one of its dtype (containers rebuilt)."""
    if depth > 64:
        return obj
    if isinstance(obj, torch.Tensor):
        return torch.empty(0, dtype=obj.dtype)
    if type(obj) in (dict, list, tuple):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        built = {k: _skeleton(v, depth + 1) for k, v in items}
        return built if isinstance(obj, dict) else type(obj)(built.values())
    return obj


def refused_globals(client_state: object, allowed: Iterable[object]) -> list[str]:
    """The globals of ``client_state`` that ``torch.load(weights_only=True)`` refuses with
    ``allowed`` (and torch's own safe globals) added; [] when it loads (or cannot be judged)."""
    buf = io.BytesIO()
    try:
        torch.save(_skeleton(client_state), buf)
        buf.seek(0)
        with torch.serialization.safe_globals(list(allowed)):
            return list(torch.serialization.get_unsafe_globals_in_checkpoint(buf))
    except Exception:  # noqa: BLE001 (not picklable: the save itself says so)
        return []


def warn_once(refused: list[str], log: object, opt_out: str) -> None:
    key = tuple(sorted(refused))
    if key and key not in _warned:
        _warned.add(key)
        log.warning("fastckpt: this save's client_state holds %s, which a load with weights_only=True (this "  # type: ignore[attr-defined]
                    "engine's setting) refuses: resuming from it would fail with UnpicklingError. Before loading, "
                    "allow them with torch.serialization.add_safe_globals([...]), or store plain types "
                    "(numpy.random.get_state() -> its array as a list or tensor), or set %s.", ", ".join(key), opt_out)


def refuse_unsafe_config(config: dict, allowed: Iterable[object]) -> None:
    """Refuse a DeepSpeed config holding a value that a load with ``weights_only=True`` refuses:
    DeepSpeed stores the config in every checkpoint file, and ZeRO-1/2 its parsed values besides
    (``gradient_clipping`` as the optimizer state's ``clip_grad``), so every save would succeed
    and every resume fail with UnpicklingError. A copy with plain values would not reach what
    DeepSpeed parsed from it when the engine was built: the user's config is the one place to fix.

    Raises:
        ConfigError: naming the value's key and the fix.
    """
    from fastckpt.errors import ConfigError

    def check(obj: object, key: str) -> None:
        if type(obj) in (dict, list, tuple):
            for k, v in (obj.items() if isinstance(obj, dict) else enumerate(obj)):  # type: ignore[attr-defined]
                check(v, f"{key}[{k!r}]")
        elif obj is not None and type(obj) not in (str, int, float, bool) and refused_globals(obj, allowed):
            what = f"{type(obj).__module__}.{type(obj).__qualname__}"
            plain = "an int, float, str, list or dict"
            fix = f"float({key[2:-2]}) or int(...)" if type(obj).__module__ == "numpy" else plain
            raise ConfigError(f"the DeepSpeed config's value at {key} is a {what}, which DeepSpeed stores in every "
                              "checkpoint file and a load with weights_only=True (this engine's setting) refuses: no "
                              f"checkpoint could be resumed. Give it as a plain value ({fix}), or set "
                              '"fastckpt": {"weights_only": false} in the config (only for checkpoints you trust)')

    for k, v in config.items():
        check(v, f"[{k!r}]")
