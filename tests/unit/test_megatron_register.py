"""``register`` and the Megatron strategies refuse arguments they cannot use when given them.

``register("abc")`` and ``register(ops="x")`` were accepted, and failed only at the first save
or load, deep inside it, as ``TypeError: 'str' object is not callable`` or an AttributeError.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from megatron.core.dist_checkpointing.strategies.base import StrategyAction, get_default_strategy  # noqa: E402

import fastckpt.integrations.megatron as fm  # noqa: E402
from fastckpt.errors import ConfigError  # noqa: E402
from fastckpt.testing import FaultyOps  # noqa: E402


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"checkpointer": "abc"}, r"checkpointer='abc': give a fastckpt\.Checkpointer, a function returning one, or None"),
    ({"checkpointer": 3}, r"checkpointer=3: give a fastckpt\.Checkpointer"),
    ({"ops": "x"}, r"ops='x': give a fastckpt\.io\.ops\.FileOps .* or None"),
    ({"tracker": "no"}, r"tracker='no': give True .* or False"),
])
def test_register_refuses_what_it_cannot_use_and_keeps_the_registered_strategies(kwargs, match) -> None:
    save, _ = fm.register()
    with pytest.raises(ConfigError, match=match):
        fm.register(**kwargs)
    assert get_default_strategy(StrategyAction.SAVE_SHARDED, fm.BACKEND, fm.VERSION) is save


def test_the_load_strategy_refuses_ops_that_are_not_file_ops() -> None:
    with pytest.raises(ConfigError, match=r"ops=42: give a fastckpt\.io\.ops\.FileOps"):
        fm.FastCkptLoadStrategy(ops=42)  # type: ignore[arg-type]


def test_a_checkpointer_function_must_return_a_checkpointer() -> None:
    save = fm.FastCkptSaveStrategy(lambda: "not one")  # type: ignore[arg-type,return-value]
    with pytest.raises(ConfigError, match=r"returned 'not one': it must return a fastckpt\.Checkpointer"):
        save.checkpointer  # noqa: B018 (what a save resolves first)


def test_what_it_accepts_is_kept() -> None:
    ops = FaultyOps()
    save = fm.FastCkptSaveStrategy(None, tracker=False, ops=ops)
    assert (save._tracker, save._ops) == (False, ops)
    assert fm.FastCkptLoadStrategy(ops=ops)._ops is ops


def test_a_checkpointer_function_is_called_once_for_both_strategies(tmp_path) -> None:
    """It was called on every use: a new Checkpointer per file saved and several per load (the
    second fought the first for its metrics port; each had its own overhead monitor)."""
    import fastckpt

    made: list[fastckpt.Checkpointer] = []

    def make() -> fastckpt.Checkpointer:
        made.append(fastckpt.Checkpointer(event_log=str(tmp_path / "events.jsonl")))
        return made[-1]

    save, load = fm.register(make)
    try:
        seen = {id(s.checkpointer) for s in (save, load, save, load)}
        assert len(made) == 1 and seen == {id(made[0])}
        assert fm.FastCkptSaveStrategy(make).checkpointer is not made[0]  # a strategy of its own calls it itself
    finally:
        fm.register()
        for ck in made:
            ck.close()
