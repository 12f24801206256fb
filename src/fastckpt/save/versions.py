"""Version links: a queued upload keeps the bytes of its own save when a newer save of the same
single file replaces its burst-buffer copy (``replicate_in_order=True``, ``replicate_policy="all"``).

Why: a newer save of a path renames its local copy over the older one, so an upload of the older
save still queued has nothing left to send. Dropping it ("superseded") is fine when the order of
landing does not matter, but in order a file saved every step (Lightning's ``last.ckpt``) is then
dropped again and again while uploads run behind: none of its saves reaches its path, and a kill
leaves top-k files there but no ``last.ckpt`` (``ckpt_path="last"`` starts from scratch).

How: as a save's upload is queued (``Replicator.submit``, on the writer thread that just renamed its
local copy into place), the Replicator hard-links that copy to a hidden temp name beside it
(``io.atomic.tmp_name``) and the upload reads the link, so each save lands, in its turn, with
exactly its own bytes. The next save of that path is written by the same writer thread, after the
link (``save.stripes``): its rename replaces the name, not the bytes the link keeps. Linking when
the upload is queued, not only when a newer save replaces the copy, also covers an upload that
starts just then (it read its manifest from the old copy and would open the new one). The link
goes as its job ends, however it ends (landed, failed, cancelled, dropped, or ``close()`` gave up
on it). Temp names are skipped by every listing (``ls``, scans, retention, the restart scan). A
killed run's are removed (``io.atomic``: this host and PID namespace, dead processes only) by the
next Checkpointer's first save on that drive, which sweeps the drive's whole tree, up to
``io.atomic.TREE_SWEEP_NAMES`` names (``Stripes.choose``): the next run often saves into other
folders (Lightning's next ``version_N``), and once its links stayed there for good. Folders past
that cap are swept when a save writes into them or looks for room there. Only the oldest queued version of a
path waits (``Replicator.submit``): one saved between it and the newest is dropped, so a backlog
holds at most two versions of a path, not one per save (which filled the burst buffer). A
version replaced at its name keeps its disk blocks until its upload ends: the
burst buffer's room check sees them (it reads the drive's free space). Where no link can be made (a
file system without hard links: EPERM, EXDEV, ENOTSUP...), the upload reads the copy itself and a
queued one is dropped for the newer save as before (``save.behind`` warns).
"""

from __future__ import annotations

import logging
import os

from ..io.atomic import discard, tmp_name
from ..io.ops import FileOps

log = logging.getLogger("fastckpt")
_refused: set[str] = set()  # directories whose hard links failed: said once each


def link_version(ops: FileOps, local: str) -> str | None:
    """A second, hidden name for the burst-buffer copy ``local``, or None when the file system
    makes none (the upload then reads ``local``, and may be dropped for a newer save, as before)."""
    version = tmp_name(local)
    try:
        ops.link(local, version)
    except OSError as exc:
        if os.path.dirname(local) not in _refused:
            _refused.add(os.path.dirname(local))
            log.info("fastckpt: no version link for the upload of %s (hard link: %s): a newer save of it before "
                     "its upload starts drops it", local, exc)
        return None
    return version


def unlink_version(ops: FileOps, version: str) -> None:
    """Remove a version link once its upload ended (a missing one is fine; other errors are logged)."""
    if version:
        discard(ops, version)
