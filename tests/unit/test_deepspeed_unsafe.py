"""What a load with weights_only=True would refuse in a DeepSpeed client_state, judged at the save."""

from __future__ import annotations

import logging

import numpy as np
import torch

from fastckpt.integrations._deepspeed.unsafe import refused_globals, warn_once


class Mine:
    pass


def test_numpy_and_own_classes_are_named_plain_types_and_tensors_pass() -> None:
    big = torch.zeros(1 << 20)  # judged on an empty stand-in: its bytes are not pickled
    assert refused_globals({"step": 3, "t": big, "names": ["a"], "pair": (1, 2.0)}, []) == []
    got = refused_globals({"rng": np.random.get_state(), "nested": [{"x": np.float64(1.0)}]}, [])
    assert all(g.startswith("numpy") for g in got), got  # (which ones: what earlier tests allowed aside)
    assert any(g.endswith("Mine") for g in refused_globals({"o": Mine()}, [])), "a class of the user's"
    assert refused_globals({"o": Mine()}, [Mine]) == []  # allowed as the load will allow it


def test_the_warning_is_given_once_per_set(caplog) -> None:
    log = logging.getLogger("fastckpt.test-unsafe")
    with caplog.at_level(logging.WARNING, logger=log.name):
        for _ in range(3):
            warn_once(["numpy.dtype", "numpy.ndarray"], log, '"weights_only": false')
    assert sum("client_state holds numpy.dtype, numpy.ndarray" in r.getMessage() for r in caplog.records) == 1



def test_a_value_a_safe_load_refuses_in_the_deepspeed_config_is_named() -> None:
    """DeepSpeed stores its config in every checkpoint file (and ZeRO-1/2 gradient_clipping again
    as clip_grad): a numpy scalar there made each one unloadable with weights_only=True."""
    import pytest

    from fastckpt.errors import ConfigError
    from fastckpt.integrations._deepspeed.unsafe import refuse_unsafe_config

    refuse_unsafe_config({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
                          "betas": [0.9, 0.99], "x": None}, [])
    with pytest.raises(ConfigError, match=r"\['gradient_clipping'\] is a numpy.float64.*float\(gradient_clipping\)"):
        refuse_unsafe_config({"gradient_clipping": np.float64(1.0)}, [])
    with pytest.raises(ConfigError, match=r"\['run'\]\['name'\] is a .*Mine.*plain value"):
        refuse_unsafe_config({"run": {"name": Mine()}}, [])
