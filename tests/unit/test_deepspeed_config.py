"""The "fastckpt" section of a DeepSpeed config: validated where the engine is built, before
DeepSpeed starts (these tests never initialise torch.distributed)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("deepspeed")

from fastckpt.errors import ConfigError  # noqa: E402
from fastckpt.integrations._deepspeed.config import (  # noqa: E402
    REDACTED,
    parse_section,
    read_config,
    redacted,
    section_of,
)
from fastckpt.integrations.deepspeed import attach, initialize  # noqa: E402
from tests.helpers import StubEngine  # noqa: E402


def _initialize(section: object) -> None:
    model = torch.nn.Linear(2, 2)
    initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "fastckpt": section})


@pytest.mark.parametrize("section, words", [
    ({"locall_dir": "/x"}, ["unknown key(s) ['locall_dir']", "local_dir (str or list of str or null)",
                             "enabled (bool)"]),
    ({"local_dir": 5}, ['"fastckpt.local_dir"', "must be str or list of str or null, got 5", "valid keys:"]),
    ({"enabled": "yes"}, ['"fastckpt.enabled" in the DeepSpeed config must be bool', "valid keys:"]),
    ({"lazy_snapshot": 1}, ['"fastckpt.lazy_snapshot" in the DeepSpeed config must be bool', "lazy_snapshot (bool)"]),
    ({"overhead_budget": True}, ['"fastckpt.overhead_budget"', "must be number"]),
    ({"keep_local": 1.5}, ['"fastckpt.keep_local"', "must be int or null"]),
    ({"on_overhead_exceeded": "f"}, ["on_overhead_exceeded is a function", "checkpointer=fastckpt.Checkpointer"]),
    (["local_dir"], ['"fastckpt" in the DeepSpeed config must be an object', "valid keys:"]),
])
def test_bad_sections_fail_before_deepspeed_starts(section: object, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        _initialize(section)
    for w in words:
        assert w in str(info.value), str(info.value)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("how", ["initialize", "attach to its engine", "attach with the config"])
def test_a_null_section_is_refused_naming_both_meanings(how: str) -> None:
    """``"fastckpt": null`` (YAML's empty ``fastckpt:``) turned fastckpt off without a word at
    initialize, while attach(engine) of an engine without a section turns it on: null reads as
    either, so it is refused, naming {} (on, the defaults) and {"enabled": false} (off)."""
    cfg = {"train_micro_batch_size_per_gpu": 1, "fastckpt": None}
    with pytest.raises(ConfigError) as info:
        if how == "initialize":
            initialize(model=torch.nn.Linear(2, 2), config=cfg)
        else:
            attach(StubEngine(cfg), None if how == "attach to its engine" else cfg)  # type: ignore[arg-type]
    for w in ('"fastckpt" in the', "is null", '"fastckpt": {} to save through fastckpt with its defaults',
              '"fastckpt": {"enabled": false} (or no "fastckpt" section)'):
        assert w in str(info.value), str(info.value)
    assert not torch.distributed.is_initialized()
    assert section_of({"train_batch_size": 8}).enabled is False and section_of(None).enabled is False


def test_values_the_checkpointer_refuses_name_the_section() -> None:
    with pytest.raises(ConfigError) as info:
        _initialize({"overhead_budget": 2})
    assert "overhead_budget=2 must be a fraction" in str(info.value)
    assert 'in the "fastckpt" section of the DeepSpeed config' in "".join(info.value.__notes__)


def test_a_full_section_parses() -> None:
    s = parse_section({"enabled": True, "weights_only": False, "local_dir": "/nvme", "overhead_budget": 0.05,
                       "keep_local": 2, "storage_options": {"key": "k"}, "commit_timeout_s": 60})
    assert s.enabled and not s.weights_only and not s.lazy_snapshot
    assert parse_section({"lazy_snapshot": True}).lazy_snapshot
    assert parse_section({}).weights_only is None  # unset: each entry point's documented default applies
    assert dict(s.options) == {"local_dir": "/nvme", "overhead_budget": 0.05, "keep_local": 2,
                               "storage_options": {"key": "k"}, "commit_timeout_s": 60}
    assert section_of({"train_batch_size": 8}).enabled is False  # no section: DeepSpeed alone
    assert section_of({"fastckpt": {"enabled": False, "local_dir": "/nvme"}}).enabled is False
    assert section_of({"fastckpt": {}}).enabled is True


def test_config_file_path_is_read_like_deepspeed_does(tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "fastckpt": {"local_dir": "/nvme", "keep_local": 2}}))
    assert dict(section_of(read_config(str(path))).options) == {"local_dir": "/nvme", "keep_local": 2}


def test_credentials_are_not_passed_on_to_deepspeed() -> None:
    cfg = {"train_batch_size": 8, "fastckpt": {"local_dir": "/nvme", "storage_options": {"key": "AK", "secret": "SK"}}}
    out = redacted(cfg)
    assert out["fastckpt"]["storage_options"] == {"key": REDACTED, "secret": REDACTED}
    assert out["fastckpt"]["local_dir"] == "/nvme" and out["train_batch_size"] == 8
    assert cfg["fastckpt"]["storage_options"]["secret"] == "SK"  # the caller's dict is untouched
    plain = {"fastckpt": {"local_dir": "/nvme"}}
    assert redacted(plain) is plain  # nothing secret: passed on as given


@pytest.mark.parametrize("given", ["the whole config", "its path", "the section", "a disabled section"])
def test_attach_with_a_config_given_redacts_the_engines_copy_too(tmp_path, given: str) -> None:
    """Only attach(engine) (config=None) redacted engine.config: attach(engine, cfg) left the
    credentials in it, and DeepSpeed wrote them into every checkpoint file."""
    secret = {"key": "AK", "secret": "SK"}
    cfg = {"train_batch_size": 8, "fastckpt": {"storage_options": dict(secret)}}
    engine = StubEngine(json.loads(json.dumps(cfg)))  # what deepspeed.initialize(config=cfg) kept
    arg: object = {"the whole config": cfg, "the section": cfg["fastckpt"],
                   "a disabled section": {"enabled": False}}.get(given)
    if given == "its path":
        (tmp_path / "ds.json").write_text(json.dumps(cfg))
        arg = str(tmp_path / "ds.json")
    fe = attach(engine, arg)  # type: ignore[arg-type]
    try:
        assert engine.config["fastckpt"]["storage_options"] == {"key": REDACTED, "secret": REDACTED}
        assert fe is None or fe.checkpointer.config.storage_options == secret
        assert cfg["fastckpt"]["storage_options"] == secret  # the caller's dict is untouched
    finally:
        engine.destroy()


@pytest.mark.parametrize("extra, named", [
    ({"checkpoint": {"writer": {"type": "fast", "decoupled": True}}}, '"writer"'),
    ({"checkpoint": {"use_node_local_storage": True}}, '"use_node_local_storage"'),
    ({"datastates_ckpt": {"host_cache_size": 16}}, '"datastates_ckpt"'),
])
def test_options_for_another_checkpoint_engine_are_refused_before_deepspeed_starts(extra: dict, named: str) -> None:
    """DeepSpeed would have built that engine (a decoupled writer forks processes) and fastckpt
    replaced it without a word; use_node_local_storage put two nodes' files under one name."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=named) as info:
        initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "fastckpt": {}, **extra})
    assert '"fastckpt": {"enabled": false}' in str(info.value)


def test_attach_refuses_what_is_not_an_engine() -> None:
    with pytest.raises(TypeError, match="needs a deepspeed.DeepSpeedEngine"):
        attach(torch.nn.Linear(2, 2))


def test_docs_list_every_key_with_its_type() -> None:
    """docs/deepspeed.md's table of the section is the list the validator accepts."""
    import re
    from pathlib import Path

    from fastckpt.integrations._deepspeed.config import valid_keys

    text = (Path(__file__).resolve().parents[2] / "docs" / "deepspeed.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([\w ]+?) \|", text, flags=re.M))
    assert valid_keys() == ", ".join(f"{k} ({t})" for k, t in rows.items())


@pytest.mark.parametrize("key", ["fast_ckpt", "FastCkpt", "fastckpt_config", "fast-ckpt", "fastckp"])
@pytest.mark.parametrize("how", ["initialize", "attach to its engine", "attach with the config"])
def test_a_misspelt_section_is_refused_naming_it(key: str, how: str) -> None:
    """DeepSpeed ignores keys it does not know: a misspelt "fastckpt" section kept DeepSpeed's own
    checkpoint engine (initialize) or fastckpt's defaults (attach) without a word."""
    cfg = {"train_micro_batch_size_per_gpu": 1, key: {"local_dir": "/nvme"}}
    with pytest.raises(ConfigError) as info:
        if how == "initialize":
            initialize(model=torch.nn.Linear(2, 2), config=cfg)
        else:
            attach(StubEngine(cfg), None if how == "attach to its engine" else cfg)  # type: ignore[arg-type]
    assert f"{key!r} in " in str(info.value) and 'misspelt "fastckpt" section' in str(info.value)
    assert 'rename it "fastckpt"' in str(info.value)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("key", ["checkpoint", "fast_persist", "datastates_ckpt", "last_ckpt", "last_ckpts"])
def test_deepspeeds_own_keys_are_no_misspelt_section(key: str) -> None:
    """Neither DeepSpeed's keys nor a user's own (DeepSpeed ignores keys it does not know) are
    taken for a misspelt section: ``last_ckpt`` is as close to ``fastckpt`` as ``fastckp``."""
    assert section_of({"train_batch_size": 8, key: {}}).enabled is False


@pytest.mark.parametrize("whole", [
    {"steps_per_print": 10, "gradient_clipping": 1.0, "wall_clock_breakdown": False},  # batch sizes from the launcher
    {"train_batch_size": 8},
    {"flops_profiler": {"enabled": True}, "activation_checkpointing": {}},
])
def test_attach_takes_a_whole_config_by_deepspeeds_own_keys(whole: dict) -> None:
    """A whole DeepSpeed config with keys off a short list was read as the section itself and
    refused as "unknown key(s) ... in the "fastckpt" section": it attaches with the defaults."""
    engine = StubEngine(dict(whole))
    fe = attach(engine, whole)  # type: ignore[arg-type]
    try:
        assert fe is not None and fe.checkpointer.config.local_dir is None
    finally:
        engine.destroy()  # closes the Checkpointer attach made


@pytest.mark.parametrize("section", [{"pin_memory": True}, {"verbose": True}, {"use_gds": True},
                                     {"local_dir": "/nvme", "parallel_write": {}}])
def test_a_section_with_only_deepspeeds_nested_names_is_still_the_section(section: dict) -> None:
    """Names DeepSpeed uses inside its sections (``pin_memory``, ``use_gds``) made attach take the
    dict for a whole config and attach with the defaults without a word: it is the section, and
    the unknown key is named."""
    with pytest.raises(ConfigError) as info:
        attach(StubEngine({"train_batch_size": 8}), section)  # type: ignore[arg-type]
    assert "unknown key(s)" in str(info.value) and "If it is a whole DeepSpeed config" in "".join(info.value.__notes__)


def test_a_section_with_an_unknown_key_says_it_was_read_as_the_section() -> None:
    with pytest.raises(ConfigError) as info:
        attach(StubEngine({"train_batch_size": 8}), {"local_dir": "/nvme", "steps_per_print": 10})  # type: ignore[arg-type]
    assert "unknown key(s) ['steps_per_print']" in str(info.value)
    assert "If it is a whole DeepSpeed config, add" in "".join(info.value.__notes__)
