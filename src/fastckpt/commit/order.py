"""The order of commits: which of two checkpoints is the newer, for the ``latest`` pointer and
for the trackers of the integrations that keep one (Megatron-LM's), so that both follow one rule.

A group is ordered by rank 0's wall clock when its commit was requested. A restart may run on a
host whose clock is behind the previous run's (or that run's ran ahead): the previous run's
checkpoints are then dated after every new one, and would hold the pointer for as long as the
clocks disagree. So a checkpoint dated more than ``AHEAD_S`` after this host's clock now is
passed over (docs/groups.md, "latest").
"""

from __future__ import annotations

import time

AHEAD_S = 60.0  # a checkpoint dated this far ahead of the clock now was dated by a clock that ran ahead


def group_order(manifest: dict) -> float:
    """When a group was committed, for ordering: rank 0's ``commit`` call, else its publish.

    Commits overlap (step N may wait for a slow rank while step N+1 completes), so the time of
    publication does not follow the order of the steps; the time of the request does.
    """
    return float(manifest.get("requested_at", manifest.get("committed_at", 0.0)))


def holds(held: float, order: float) -> bool:
    """Whether a pointer (or tracker) at a commit ordered ``held`` stays against a commit ordered
    ``order``: it does when ``held`` is newer, unless ``held`` is dated more than ``AHEAD_S``
    after this host's clock (a skewed node dated it)."""
    return order < held <= time.time() + AHEAD_S
