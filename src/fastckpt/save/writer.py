"""The write side of one save, after the snapshot: file image -> temp file -> rename.

``FileWriter.write`` runs on the writer thread (one per Checkpointer, so a rank's files are
written in order); its chunks run on the I/O pool. ``gds_write`` runs on the training thread
(the GPU tensors are read in place) and ``gds_finish`` on the writer thread. Each file goes
through ``io.atomic``'s recipe, timed as two phases: "write" (bytes written and fsynced) and
"commit" (a file at its own path dated as final, ``Staged.stamp``; renamed into place, directory
fsynced). The file carries its manifest in its zip comment (``format.manifest``), computed from
the checksum of the bytes just written.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import replace

from ..format import layout as F
from ..format.manifest import file_manifest, tail_bytes
from ..inflight import raise_as_write_error
from ..io.atomic import Staged, sweep_once
from ..io.engine import WriteResult, write_file
from ..io.gds import finish_gds_file, gds_write
from ..io.ops import FileOps
from ..records import SaveRecord
from ..storage.places import dir_lock
from ..urls import is_within, normalize
from ..version import __version__
from .snapshot import Snapshot
from .staging import StagingPool
from .tiers import TierChoice

log = logging.getLogger("fastckpt")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def manifest_of(rec: SaveRecord, layout: F.FileLayout, digest: str, blocks: Sequence[int] = ()) -> dict:
    """The manifest a file of this save carries (see ``format.manifest.file_manifest``)."""
    rel = rec.path[len(rec.group):].lstrip("/") if rec.group else None
    return file_manifest(covered=layout.covered_bytes, digest=digest, rank=rec.rank,
                         group_name=rec.group.rstrip("/").rsplit("/", 1)[-1] if rec.group else None,
                         group_rel=rel, tier=rec.tier, payload_bytes=layout.payload_bytes, blocked_s=rec.blocked_s,
                         fastckpt_version=__version__, blocks=blocks, requested_at=rec.requested_at or None)


class FileWriter:
    """Writes snapshots to files.

    Args:
        ops: the FileOps seam.
        io_pool: the I/O threads chunks run on.
        staging: the pool each snapshot's buffer goes back to once written.
        chunk_bytes: bytes per parallel write.
        emit: the Checkpointer's event emitter.
        on_written: called with (file, bytes, seconds) after each file is written and fsynced
            (the burst buffer's per-directory bandwidth, ``save.stripes``).
        local_dirs: the burst-buffer directories: a file written in one is a local copy, still
            to be replicated (any other file is at its home, durable once renamed).
        unlink_later: removes a replaced file off the writer thread (``io.atomic.Staged``).
    """

    def __init__(self, ops: FileOps, io_pool: Executor, staging: StagingPool, chunk_bytes: int,
                 emit: Callable[..., None], on_written: Callable[[str, int, float], None] | None = None,
                 local_dirs: Sequence[str] = (), unlink_later: Callable[[str], None] | None = None) -> None:
        self._ops, self._io, self._staging, self._chunk = ops, io_pool, staging, chunk_bytes
        self._emit, self._on_written, self._local_dirs = emit, on_written, tuple(local_dirs)
        self._unlink_later = unlink_later

    def write(self, snap: Snapshot, base: SaveRecord, dest: str, t_call: float, choice: TierChoice,
              fallback: Callable[[], TierChoice] | None = None, turn: Callable[[], None] | None = None
              ) -> SaveRecord:
        """Write the snapshot to ``dest`` (temp, fsync, rename, dir fsync); release its buffer
        once written (before the rename, so the next save can take it). ``choice``: the save's
        tier, whose probe says whether ``dest`` is written with O_DIRECT and, if not, why.

        With ``snap.progress`` the writer starts while the snapshot is still copying (chunks wait
        for their bytes), and the time the caller was blocked is known only when the copy ends.
        ``fallback`` (a single file whose ``dest`` is in the burst buffer, ``Saver``): when that
        drive runs out of space mid-write, the file is written straight to its path instead,
        with the tier ``fallback()`` returns. ``turn`` (``replicate_in_order``): a file written to
        its own path is renamed into place only once ``turn()`` returns (``save.ordering``).
        """
        w0 = time.time()
        progress = snap.progress

        def base_now() -> SaveRecord:
            if progress is None:
                return base
            progress.wait_done()  # the caller's blocked time is known once it finished the copy
            return replace(base, blocked_s=progress.blocked_s)

        try:
            if progress is None:
                snap.wait_ready()
                w0 = time.time()  # the write starts once its bytes are there: a lazy copy's end, in the log
            try:
                st, res, t0 = self._write_once(snap, dest, choice, base_now)
            except OSError as exc:
                if fallback is None or exc.errno not in _NO_SPACE:
                    raise
                # The save goes on (its events show the write to the path): no failed event.
                log.warning("fastckpt: the burst buffer ran out of space while writing %s (%s): writing it straight "
                            "to its path instead. Free space on %s, keep fewer local copies (keep_local=N), or point "
                            "local_dir at a larger drive", base.path, exc, os.path.dirname(dest))
                choice = fallback()
                base, dest = replace(base, tier=choice.tier), base.path
                st, res, t0 = self._write_once(snap, dest, choice, base_now)
        except BaseException as exc:
            self._fail("write", exc, base, dest, base.path, base.bytes, w0)
        finally:
            if progress is not None:
                progress.wait_done()  # never hand the buffer back while the copy still fills it
            self._staging.release(snap.buffer)
        write_s = time.monotonic() - t_call
        if self._on_written is not None:
            self._on_written(dest, res.bytes, time.monotonic() - t0)
        self._emit("write", dest, res.bytes, w0, base.tier,
                   detail=None if res.odirect else f"buffered: {res.odirect_reason}")
        return self._publish(base_now(), st, res, t_call, write_s, turn)

    def _write_once(self, snap: Snapshot, dest: str, choice: TierChoice, base_now: Callable[[], SaveRecord]
                    ) -> tuple[Staged, WriteResult, float]:
        """Write the snapshot to a temp file beside ``dest`` (removed again if that fails); return
        it, the result and when the write started."""
        st, layout, progress = Staged(self._ops, dest, self._unlink_later), snap.layout, snap.progress
        try:
            self._ops.makedirs(os.path.dirname(dest))
            sweep_once(self._ops, os.path.dirname(dest))  # what killed writers left there
            t0 = time.monotonic()
            res = write_file(self._ops, self._io, st.tmp, snap.buffer.view, layout.covered_bytes,
                             lambda digest, blocks: tail_bytes(manifest_of(base_now(), layout, digest, blocks)),
                             chunk_bytes=self._chunk, odirect=choice.odirect, odirect_reason=choice.odirect_reason,
                             ready=progress.wait_for if progress is not None else None,
                             copying=progress.copying if progress is not None else None)
        except BaseException:
            st.discard()
            raise
        return st, res, t0

    def _publish(self, base: SaveRecord, st: Staged, res: WriteResult, t_call: float, write_s: float,
                 turn: Callable[[], None] | None = None) -> SaveRecord:
        local = self._is_local(st.dest)
        c0 = time.time()
        try:  # a prefetch's download lands in the burst buffer only under its directory's lock: load.prefetch
            if turn is not None and not local:  # final at its path once the files saved before it are
                turn()
            if not local:  # dated as final now, after theirs: written at once, its bytes may be older
                st.stamp()
            with dir_lock(os.path.dirname(st.dest), shared=True) if local else contextlib.nullcontext():
                st.commit()
        except BaseException as exc:
            self._fail("commit", exc, base, st.dest, st.dest, res.bytes, c0, st.renamed)
        commit_s = time.monotonic() - t_call
        self._emit("commit", st.dest, res.bytes, c0, base.tier)
        return replace(base, bytes=res.bytes, write_s=write_s, commit_s=commit_s,
                       durable_s=None if local else commit_s, local_durable_s=commit_s if local else None,
                       checksum=res.checksum, odirect=res.odirect, odirect_reason=res.odirect_reason)

    def _raise(self, exc: BaseException, base: SaveRecord, dest: str, renamed: bool = False) -> None:
        """Raise the failure of writing ``dest`` for ``base.path``, naming the drive written."""
        raise_as_write_error(exc, base.path, renamed, os.path.dirname(dest), self._is_local(dest))

    def _fail(self, phase: str, exc: BaseException, base: SaveRecord, dest: str, named: str, nbytes: int,
              start: float, renamed: bool = False) -> None:
        """Emit the failed ``phase`` event with the error the caller gets (a CheckpointWriteError,
        not the OSError inside it: metrics and reports count failures by its type), then raise it."""
        try:
            self._raise(exc, base, dest, renamed)
        except BaseException as raised:
            self._emit(phase, named, nbytes, start, base.tier, raised)
            raise

    def _is_local(self, dest: str) -> bool:
        """``dest`` is in the burst buffer (a drive of ``local_dir``)."""
        return any(is_within(normalize(dest), d) for d in self._local_dirs)

    def gds_write(self, layout: F.FileLayout, dest: str) -> Staged:
        """GPU -> temp file through kvikio, on the training thread."""
        self._ops.makedirs(os.path.dirname(dest))
        st = Staged(self._ops, dest, self._unlink_later)
        try:
            gds_write(st.tmp, layout)
        except BaseException:
            st.discard()
            raise
        return st

    def gds_finish(self, st: Staged, layout: F.FileLayout, base: SaveRecord, t_call: float,
                   turn: Callable[[], None] | None = None) -> SaveRecord:
        """Checksum by read-back, append the manifest, then publish like any other file."""
        try:
            res = finish_gds_file(self._ops, self._io, st.tmp, layout,
                                  lambda d: tail_bytes(manifest_of(base, layout, d)), self._chunk)
        except BaseException as exc:
            st.discard()
            self._raise(exc, base, st.dest)
        return self._publish(base, st, res, t_call, time.monotonic() - t_call, turn)
