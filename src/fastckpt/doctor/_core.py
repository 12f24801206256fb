"""The core functions the doctor probes with, imported in this one place (so a move in the core
re-points one file): the tier probes and the storage targets, exactly as saves use them."""

from __future__ import annotations

from ..places import split_url
from ..targets import open_target
from ..tiers import TierSelector, gds_probe_write, gds_unavailable_reason, probe_odirect

__all__ = ["TierSelector", "gds_probe_write", "gds_unavailable_reason", "open_target", "probe_odirect", "split_url"]
