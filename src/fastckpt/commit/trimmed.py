"""Retention's record of the groups it trimmed, so that a rank still waiting for one of them can
tell "published, then trimmed" from "removed" (docs/groups.md, "A rank late to a group that is
already gone").

Without a store the other ranks learn that rank 0 published a group by reading its manifest. With
``keep_persistent``, rank 0 may publish the group, commit a later one (a rolling ``last`` tag
committed at the same step, or the next step) and trim this group before a rank's poll reads the
manifest: the rank finds its marker gone. Nothing in the group's directory survives the trim, so
rank 0 writes, before it deletes anything of a group committed without a store, one small record
beside it: ``.fastckpt-trimmed/<written_s>-<key>.json`` in the group's parent, ``key`` a digest of
the group's name and its published attempt. A rank whose attempt's record is there reports its commit done,
as rank 0 did; with none it is a removal (``Checkpointer.remove``, or a deletion outside fastckpt).

The record is written before the deletion (a kill between the two leaves the group whole and a
record nobody reads), and a deletion whose record cannot be written does not happen (retention
tries it again later). Nobody compares clocks: a waiting rank matches the record by name, and rank
0 prunes the records it wrote more than ``keep_s`` ago by its own clock (``keep_for``: longer than
any rank waits for an attempt) each time it writes one, with one listing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
import time

from ..errors import CorruptCheckpointError
from ..storage.places import Place
from .names import TRIMMED_DIR
from .protocol import ATTEMPT, read_group_manifest, read_record

log = logging.getLogger("fastckpt")


def keep_for(commit_timeout_s: float) -> float:
    """How long a record stays: a rank waits at most ``commit_timeout_s`` plus its grace (up to 30 s)
    for the manifest, then as long again once rank 0 claimed the attempt; its wait began before rank 0
    published, so before the trim. A minute more for slow polls."""
    return 2 * (commit_timeout_s + 30.0) + 60.0


def _key(group: Place, attempt: str) -> str:
    name = posixpath.basename(group.key)
    return hashlib.sha1(f"{name}\0{attempt}".encode()).hexdigest()[:20]


def record(group: Place, keep_s: float) -> None:
    """Rank 0, before retention deletes ``group``: record its published attempt, and prune the
    records older than ``keep_s``. Only for a group committed without a store (its ``attempt.json``):
    through a store the other ranks heard the outcome before anything was trimmed, and a group of
    one rank has nobody waiting; nor for one without a readable manifest (no attempt to vouch for).

    Raises:
        OSError: a record could not be read or written: the group must not go yet.
    """
    if read_record(group, ATTEMPT) is None:
        return
    try:
        m = read_group_manifest(group)
    except CorruptCheckpointError:
        return
    if m is None or m.get("attempt") is None:
        return
    parent, now = group.parent(), time.time()
    body = {"group": posixpath.basename(group.key), "attempt": m["attempt"], "written_at": now,
            "total": sum(int(f["size"]) for f in m["files"].values())}
    parent.put(f"{TRIMMED_DIR}/{int(now)}-{_key(group, m['attempt'])}.json", json.dumps(body, sort_keys=True).encode())
    try:
        for n in parent.names(TRIMMED_DIR):
            written = n.partition("-")[0]
            if written.isdigit() and abs(now - int(written)) > keep_s:  # (dated far ahead: a clock set back since)
                parent.delete(f"{TRIMMED_DIR}/{n}")
    except OSError as exc:  # a record left over costs nothing but its bytes: the next trim prunes it
        log.warning("fastckpt: could not prune retention's old records in %s: %s", parent.url(TRIMMED_DIR), exc)


def find(group: Place, attempt: str | None) -> dict | None:
    """Another rank: retention's record that rank 0 trimmed ``group`` after it published ``attempt``
    (its ``total`` bytes), or None (no attempt joined, no such record: the group was removed)."""
    if attempt is None:
        return None
    parent, key = group.parent(), _key(group, attempt)
    for n in parent.names(TRIMMED_DIR):
        if n.endswith(f"-{key}.json") and (body := read_record(parent, f"{TRIMMED_DIR}/{n}")) is not None \
                and body.get("attempt") == attempt and body.get("group") == posixpath.basename(group.key):
            return body
    return None
