"""Resuming the replication of single files that an earlier run saved to the burst buffer but
did not replicate (docs/burst-buffer.md, "Restarts").

Why: a job killed while an older save was still uploading (and a newer one was already
verified) restarts after the newer one and never saves that name again. Its burst-buffer copy
may be the only copy of that save (a Lightning top-k file the restored ModelCheckpoint still
names), so retention may not delete it; left alone it would stay on the NVMe for good, one more
with every such kill. Instead it is replicated as it would have been: once verified at its home
it is an ordinary durable copy, and keep_local counts it, the oldest.

How: the first time this run saves into a directory, the single files this rank wrote directly
beside that path in its burst-buffer copy (complete, own manifest, not the path being saved) go
to the ``Replicator`` as ordinary jobs, so the home gets the same atomic, verified copy and the
event log its ``queued``/``replicate`` events; with ``replicate_in_order`` before this run's
files (they are older). A job's last look, on a replication worker, skips a copy whose home
holds that save already (retention's own restart scan counts it), lists one whose home holds a
newer save of the name (obsolete: keep_local may count it), and never uploads one whose local
bytes do not verify (damaged: warned about, left, not counted). A kill during the resumed upload
leaves the home as it was (the copy is published only once verified); the next restart resumes
it again. A newer save of the name by this run supersedes it as any older save.
"""

from __future__ import annotations

import itertools
import logging
import os
import posixpath
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from ..commit.discovery import Found, scan
from ..errors import CorruptCheckpointError
from ..records import SaveRecord
from ..storage.homes import Homes
from ..urls import join
from .replicator import ReplicaJob, Replicator

log = logging.getLogger("fastckpt")
OLDEST = -10**9  # resumed copies take tokens below every other in retention's list: they are the oldest


class Resumer:
    """Args:
        homes: resolves names to their targets.
        replicator: where the resumed copies go.
        local_copies: the burst-buffer copies of a name (several with striped ``local_dir``s).
        rank: only the files this rank wrote are its to resume.
        listed: ``Retention.resumed``: keep_local counts the copy (a name, its token).
    """

    def __init__(self, homes: Homes, replicator: Replicator, local_copies: Callable[[str], list[str]], rank: int,
                 listed: Callable[[str, int], None]) -> None:
        self._homes, self._replicator, self._copies = homes, replicator, local_copies
        self._rank, self._listed = rank, listed
        self._lock = threading.Lock()
        self._looked: set[str] = set()  # directories scanned once
        self._tokens = itertools.count(OLDEST)

    def beside(self, path: str) -> None:
        """This run saves ``path``: the first time in its directory, resume what earlier runs left
        unreplicated there. Never raises: a save must not fail for it (it warns)."""
        parent = posixpath.dirname(path)
        with self._lock:
            if parent in self._looked:
                return
            self._looked.add(parent)
        try:
            found = [(name, f) for mirror in self._copies(parent)
                     for f in scan(self._homes.resolve(mirror), max_depth=1)
                     if "/" not in (rel := posixpath.relpath(f.path, mirror)) and (name := join(parent, rel)) != path
                     and f.kind == "file" and not f.foreign and f.manifest.get("group") is None
                     and f.manifest.get("rank", 0) == self._rank]  # a group's file is published with its group
            for name, f in sorted(found, key=lambda nf: nf[1].time):
                self._submit(name, f)
        except Exception as exc:  # noqa: BLE001 (a save must not fail for it: say so; the next restart tries again)
            log.warning("fastckpt: could not resume the replication of what earlier runs left in the burst buffer "
                        "beside %s: %s", path, exc)

    def _submit(self, name: str, f: Found) -> None:
        m, token, final = f.manifest, next(self._tokens), Future()
        asked = float(m.get("requested_at", f.time))
        rec = SaveRecord(name, str(m.get("tier", "nvme")), os.path.getsize(f.path), 0.0, 0.0, 0.0, None,
                         checksum=m["checksum"]["value"], rank=self._rank, requested_at=asked)
        verdict: list[str] = []
        job = ReplicaJob(rec, f.path, time.monotonic() - max(0.0, time.time() - asked), time.time(), final,
                         finish=lambda r: self._done(r, token, verdict),
                         order=self._replicator.hold(final, True), check=lambda: self._check(rec, f, verdict))
        try:
            self._replicator.submit(job)
        except BaseException:
            final.cancel()  # ends its hold
            raise

    def _check(self, rec: SaveRecord, f: Found, verdict: list[str]) -> str | None:
        """On a replication worker, before the upload: a reason not to upload the copy, or None."""
        home = self._homes.resolve(rec.path)
        try:
            theirs = home.target.read_manifest(home.key) or {}
        except (OSError, ValueError):  # absent, unreadable or damaged at the home: the upload replaces it
            theirs = {}
        if theirs.get("checksum") == f.manifest.get("checksum"):
            return "already at its home"  # retention's restart scan counts it (``restarts.earlier_copies``)
        if float(theirs.get("requested_at", 0.0)) > rec.requested_at:
            verdict.append("obsolete")
            return "its home holds a newer save"
        local = self._homes.resolve(f.path)
        try:
            local.target.verify(local.key, rec.bytes, rec.checksum, f.manifest.get("covered"))
        except (OSError, CorruptCheckpointError) as exc:
            log.warning("fastckpt: not replicating %s, which an earlier run saved to the burst buffer: its copy %s "
                        "does not verify (%s); it stays there and keep_local does not count it", rec.path, f.path, exc)
            return "damaged"
        log.info("fastckpt: resuming the replication of %s, which an earlier run saved to the burst buffer but did "
                 "not replicate", rec.path)
        return None

    def _done(self, rec: SaveRecord, token: int, verdict: list[str]) -> SaveRecord:
        """Verified at its home (or obsolete there): keep_local counts its burst-buffer copy now."""
        if rec.durable_s is not None or verdict:
            self._listed(rec.path, token)
        return rec
