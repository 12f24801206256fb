"""When an unpublished group was attempted: where ``ls`` lists an incomplete group among the others.

A complete group is ordered by when rank 0's commit began (``protocol.group_order``, its
manifest's ``requested_at``). An incomplete one has no manifest, so it was listed with no time at
all, first, as the oldest checkpoint, though its attempt is usually the newest (a job killed
while saving it). Its attempt record says when rank 0's commit began; without one (a store
keeps the attempt, or no rank reached its commit) the newest of its files and markers does.
"""

from __future__ import annotations

import contextlib

from ..commit.protocol import ATTEMPT, read_record
from ..storage.homes import Homes, Location


def attempted_at(h: Homes, where: Location, keys: list[str]) -> float | None:
    """When the unpublished group ``where`` was attempted (its files and markers: ``keys``); None
    when nothing of it can be read."""
    with contextlib.suppress(OSError):
        if isinstance(when := (read_record(where.place(), ATTEMPT) or {}).get("written_at"), (int, float)):
            return float(when)
    times = []
    for k in keys:
        loc = h.resolve(k)
        with contextlib.suppress(OSError):  # gone since the listing
            times.append(loc.target.modified(loc.key))
    return max(times, default=None)
