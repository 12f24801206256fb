"""Giving the C heap's free memory back after a save of many tensors.

A save of 100,000 small tensors makes and frees an object or more per tensor (the walk's
signature, the layout's records, torch's metadata pass the first time), tens of MB in all. glibc
keeps what is freed for later allocations, so the process stays that much larger after every
such save: measured at 100,000 tensors, RSS grew by 105-108 MB at the first save for 29 MB of
staging, and by 125-130 MB after eight. ``malloc_trim`` hands those pages back in 3-5 ms; the
writer thread calls it once a large save's write is done and its objects are gone (82-89 MB,
first save and later ones alike). It holds each malloc arena's lock while it walks that arena,
so a thread that allocates meanwhile (the training thread) may wait those few milliseconds, once
per such save. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

from ..io.ops import malloc_trim as trim

__all__ = ["TRIM_AFTER_RECORDS", "trim"]

#: A save of at least this many storages trims the heap after its write.
TRIM_AFTER_RECORDS = 10_000
