"""The write side of one save, after the snapshot: file image -> temp file -> rename.

``Pipeline.write`` runs on the writer thread (one per Checkpointer, so a rank's files are
written in order); its chunks run on the I/O pool. ``Pipeline.gds_write`` runs on the
training thread (the GPU tensors are read in place) and ``gds_finish`` on the writer thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import replace

from . import commit as C
from . import format as F
from .background import surfaced
from .config import CheckpointerConfig
from .errors import CheckpointWriteError, FastCkptError
from .io.engine import write_file
from .io.gds import finish_gds_file, gds_write
from .io.ops import FileOps
from .monitor import Monitor
from .records import SaveRecord
from .staging import StagingPool

log = logging.getLogger("fastckpt")
#: Block digests listed in a file's manifest at most (16 hex digits each: 48,000 of the zip
#: comment's 65,535 bytes; files up to 46.9 GiB). Larger files list none: readers verify them whole.
MAX_LISTED_BLOCKS = 3000


def reraise(exc: BaseException, path: str, renamed: bool = False) -> None:
    """Raise ``exc``; an OSError becomes a CheckpointWriteError that names the checkpoint.

    ``renamed``: the failure came after the new file was renamed into place (the directory
    fsync), so the message must not claim the previous file is still there.
    """
    if isinstance(exc, FastCkptError) or not isinstance(exc, OSError) or surfaced(exc):
        raise exc
    state = ("the new file is in place but its directory entry may not be durable (directory fsync failed)"
             if renamed else "the previous checkpoint is untouched")
    err = CheckpointWriteError(exc.errno, f"saving {path} failed: {exc.strerror or exc}; {state}")
    err.filename = path
    raise err from exc


class Pipeline:
    def __init__(self, cfg: CheckpointerConfig, ops: FileOps, io_pool: Executor, staging: StagingPool,
                 monitor: Monitor, emit: Callable[..., None]) -> None:
        self._cfg, self._ops, self._io, self._staging = cfg, ops, io_pool, staging
        self._monitor, self._emit = monitor, emit
        self._swept: set[str] = set()

    def manifest(self, rec: SaveRecord, layout: F.FileLayout, digest: str, blocks: list[int] = ()) -> dict:
        """The file's manifest; ``blocks`` (the checksum's block digests) are listed as one hex
        string when they fit the zip comment, so a reader of part of the file can verify the
        blocks it reads (docs/format.md)."""
        from . import __version__

        rel = None
        if rec.group:
            rel = rec.path[len(rec.group):].lstrip("/" + os.sep)
        return {"format": F.FORMAT_VERSION, "kind": "file", "covered": layout.covered_bytes,
                "checksum": {"algo": "xxh3_64-tree-16MiB", "value": digest,
                             **({"blocks": "".join(f"{b:016x}" for b in blocks)}
                                if 0 < len(blocks) <= MAX_LISTED_BLOCKS else {})}, "rank": rec.rank,
                "group": rec.group.rstrip("/").rsplit("/", 1)[-1] if rec.group else None,
                "group_rel": rel, "tier": rec.tier, "payload_bytes": layout.payload_bytes,
                "written_at": time.time(), "blocked_s": round(rec.blocked_s, 6),
                "versions": {"fastckpt": __version__, "torch": F.torch_version()}}

    def _tail(self, base: SaveRecord, layout: F.FileLayout, digest: str, blocks: list[int] = ()) -> bytes:
        body = F.comment_bytes(self.manifest(base, layout, digest, blocks))
        return F.comment_length_field(len(body)) + body

    def _sweep(self, directory: str) -> None:
        """Once per directory: remove temp files that killed processes left there."""
        if directory not in self._swept:
            self._swept.add(directory)
            n = C.sweep_stale_tmp(self._ops, directory)
            if n:
                log.info("fastckpt: removed %d temp file(s) of dead processes in %s", n, directory)

    def write(self, snap, base_in: SaveRecord | Future, dest: str, t_call: float, odirect: bool) -> SaveRecord:  # noqa: ANN001
        """Write the snapshot to ``dest`` (temp, fsync, rename, dir fsync); release its buffer.

        With a ``Progress`` on the snapshot the writer starts while the snapshot is still
        copying (chunks wait for their bytes), and ``base_in`` is a Future of the record the
        training thread completes when its copy is done.
        """
        def base() -> SaveRecord:
            return base_in.result() if isinstance(base_in, Future) else base_in

        w0 = time.time()
        tmp = C.tmp_name(dest)
        progress = getattr(snap, "progress", None)
        try:
            if progress is None:
                snap.wait_ready()
            layout = snap.layout
            self._ops.makedirs(os.path.dirname(dest))
            self._sweep(os.path.dirname(dest))
            res = write_file(self._ops, self._io, tmp, snap.buffer.view, layout.covered_bytes,
                             lambda digest, blocks: self._tail(base(), layout, digest, blocks),
                             chunk_bytes=self._cfg.chunk_bytes, odirect=odirect,
                             ready=progress.wait_for if progress is not None else None)
        except BaseException as exc:
            C.discard(self._ops, tmp)
            self._emit("write", base().path, base().bytes, w0, base().tier, exc)
            reraise(exc, base().path)
        finally:
            if progress is not None:
                progress.wait_done()  # never hand the buffer back while the copy still fills it
            self._staging.release(snap.buffer)
        write_s = time.monotonic() - t_call
        base_rec = base()
        self._emit("write", dest, res.bytes, w0, base_rec.tier,
                   detail=None if res.odirect else f"buffered: {res.odirect_reason}")
        return self._publish(base_rec, tmp, dest, res, t_call, write_s)

    def _publish(self, base: SaveRecord, tmp: str, dest: str, res, t_call: float, write_s: float) -> SaveRecord:  # noqa: ANN001
        c0 = time.time()
        try:
            self._ops.replace(tmp, dest)
            self._ops.fsync_dir(os.path.dirname(dest))
        except BaseException as exc:
            renamed = not os.path.lexists(tmp)
            C.discard(self._ops, tmp)
            self._emit("commit", dest, res.bytes, c0, base.tier, exc)
            reraise(exc, base.path, renamed)
        commit_s = time.monotonic() - t_call
        self._emit("commit", dest, res.bytes, c0, base.tier)
        local = dest != base.path
        if not local:
            self._monitor.record_durable(commit_s)
        return replace(base, bytes=res.bytes, write_s=write_s, commit_s=commit_s,
                       durable_s=None if local else commit_s, local_durable_s=commit_s if local else None,
                       checksum=res.checksum, odirect=res.odirect, odirect_reason=res.odirect_reason)

    def gds_write(self, layout: F.FileLayout, dest: str) -> str:
        """GPU -> temp file through kvikio, on the training thread; returns the temp path."""
        self._ops.makedirs(os.path.dirname(dest))
        tmp = C.tmp_name(dest)
        try:
            gds_write(tmp, layout)
        except BaseException:
            C.discard(self._ops, tmp)
            raise
        return tmp

    def gds_finish(self, tmp: str, layout: F.FileLayout, base: SaveRecord, dest: str, t_call: float) -> SaveRecord:
        """Checksum by read-back, append the manifest, then publish like any other file."""
        try:
            res = finish_gds_file(self._ops, self._io, tmp, layout, lambda d: self._tail(base, layout, d),
                                  self._cfg.chunk_bytes)
        except BaseException as exc:
            C.discard(self._ops, tmp)
            reraise(exc, base.path)
        return self._publish(base, tmp, dest, res, t_call, time.monotonic() - t_call)
