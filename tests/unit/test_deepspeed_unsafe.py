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
