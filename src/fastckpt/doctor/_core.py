"""The core functions the doctor probes with, imported in this one place (so a move in the core
re-points one file): the tier probes and the storage targets, exactly as saves use them."""

from __future__ import annotations

from ..save.tiers import TierChoice, TierSelector, gds_probe_write, gds_unavailable_reason, probe_odirect
from ..storage.homes import open_target
from ..storage.reach import silent_endpoint
from ..storage.types import TargetUnavailableError, TargetUnreachableError
from ..urls import split_url

__all__ = ["TargetUnavailableError", "TargetUnreachableError", "TierChoice", "TierSelector", "gds_probe_write",
           "gds_unavailable_reason", "open_target", "probe_odirect", "silent_endpoint", "split_url"]
