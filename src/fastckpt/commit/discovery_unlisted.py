"""Which folders a scan could not list may hold the newest checkpoint (``discovery.scan``).

A folder that cannot be listed (EACCES: a job restarted under another account; EIO) is passed
over by the listing, as ``os.walk`` does. Passed over silently, a step folder that holds the
newest checkpoint makes ``latest`` name an older one: a resume goes back in time. Raising for
every such folder broke ``latest`` over a run folder holding a root-owned ``.Trash-0``, DeepSpeed's
loads and the burst buffer's restart scan. So the scan raises only for a folder that could hold
a candidate by the discovery rule:

* the scanned folder itself, or one below it that is not hidden (``.x``), no temp name and no
  ``lost+found`` (hidden names and temp files are never checkpoints), with no such part above it;
* not inside a complete checkpoint the scan found (a group's ``tb_logs``: its files are no
  separate checkpoints), nor inside a burst buffer below the root (``names.burst_buffers``);
* named like a checkpoint: ``CHECKPOINT_NAME`` (a number at its end, as a step or tag folder
  ``step-200``, ``global_step200``, ``iter_0000200``, which orders tags; ``ckpt`` or ``checkpoint``
  in it; a ``.ckpt``/``.pt``/``.pth`` end) for itself or a folder between it and the root.

Any other folder (``bob-run``, ``tb_logs``, ``wandb``) is passed over, with a debug line, as is
one deeper than the caller's candidates lie (DeepSpeed: ``save_dir/tensorboard/version_0``).
A folder below the root that answers ESTALE (NFS: deleted since the listing) is gone, not
unlistable: the scan lists again, as for a file gone since the listing.
"""

from __future__ import annotations

import errno
import logging
import re

from ..io.atomic import is_tmp
from ..urls import join

log = logging.getLogger("fastckpt")
CHECKPOINT_NAME = re.compile(r"\d$|ckpt|checkpoint|\.pth?$", re.IGNORECASE)
NEVER = ("lost+found",)  # the file system's own, root's alone


def check(url: str, prefix: str, unlisted: tuple[tuple[str, OSError], ...], inside: set[str],
          depth: int | None = None, stale_gone: bool = True) -> list[str]:
    """Raise for the first folder of ``unlisted`` (key, error) that could hold a candidate of the
    scan of ``url`` (keys under ``prefix``; ``inside``: complete checkpoints' folders, relative;
    ``depth``: when given, only folders at most that many levels below ``url`` hold candidates of
    the caller, as DeepSpeed's tags are direct children of ``save_dir``; ``stale_gone``: False on
    the scan's last listing, where a folder still answering ESTALE (a stale NFS handle that
    persists) is judged as any folder that cannot be listed: passed over, it named an older one).

    Returns:
        The folders below ``url`` gone since the listing (NFS answers ESTALE for a folder deleted
        under it, as for a file: retention removing the oldest group): the scan lists again.

    Raises:
        OSError: the listing's own (PermissionError for EACCES), with a note naming the folder
            and the fix, as ``foreign.unreadable`` does for a file.
    """
    gone = []
    for key, exc in unlisted:
        rel = "" if f"{key}/" == prefix or key == prefix else key[len(prefix):]
        if rel and exc.errno == errno.ESTALE and stale_gone:
            gone.append(join(url, rel))
        elif may_hold_candidates(rel, inside) and (depth is None or rel.count("/") < depth):
            where = join(url, rel) if rel else url
            fix = ("a stale NFS file handle (the server restarted or the folder was replaced): remount, or list "
                   "again once the server answers") if exc.errno == errno.ESTALE else (
                f"make it listable (owner/mode: chmod a+rx, or run as its owner), or move it out of {url} "
                "if it holds no checkpoint")
            exc.add_note(f"{where} cannot be listed, and it may hold the newest checkpoint (naming an older one "
                         f"would resume from the past): {fix}")
            raise exc
        else:
            log.debug("fastckpt: %s cannot be listed (%s); passed over: it holds no checkpoint by its name", key, exc)
    return gone


def may_hold_candidates(rel: str, inside: set[str]) -> bool:
    """Whether the folder ``rel`` (relative to the scanned root; '' the root) could hold a
    checkpoint the scan would count (the module docstring says which)."""
    if not rel:
        return True
    parts = rel.split("/")
    if any(p.startswith(".") or is_tmp(p) or p in NEVER for p in parts):
        return False
    if any(rel == g or rel.startswith(f"{g}/") or not g for g in inside):
        return False
    return any(CHECKPOINT_NAME.search(p) for p in parts)
