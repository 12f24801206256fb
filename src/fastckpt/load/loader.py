"""``Checkpointer.load``: find the best copy, read it whole, verify it, deserialise it.

A save of the path in flight on the same Checkpointer is waited for first. Copies are then
tried in order: the burst-buffer copy in ``local_dir`` (when there is one, and it is of the same
save as the copy at the path, by the checksum in its manifest or, at a URL, its sidecar and the
object's own manifest: see ``load.verdict``), then the path itself. Each copy is read through its
home's ``Target`` (``storage.homes``): a file on a mounted file system in parallel through one
open descriptor (O_DIRECT where honoured), an object with parallel ranged reads; either way
the checksum of the covered bytes is computed while the bytes arrive. A copy that fails to read
or verify falls back to the next one with a warning. A single file read from its URL must also be
the save its sidecar published (``load.published``). A file of a group is loaded only once its
group is published. With ``prefetch=True`` a remote file is first downloaded into the burst
buffer, so the next load is local (never over a save that landed there meanwhile: ``load.prefetch``).

A file without a fastckpt manifest (plain ``torch.save``, another checkpointer, a tool) loads
unverified: reported at WARNING once per path and in the load's event, refused with ``verify=True``;
one that is damaged (empty, not a torch file, truncated: ``load.unverified``), or that a published
group records as a fastckpt file (``load.named``), raises ``CorruptCheckpointError`` naming it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..commit.membership import NotPublishedError
from ..errors import (
    ConfigError,
    CorruptCheckpointError,
    GroupChangedError,
    IncompleteCheckpointError,
    UnverifiableCheckpointError,
)
from ..io.atomic import discard, tmp_name
from ..io.engine import ImageFactory
from ..storage.homes import Homes, Location
from ..urls import is_url
from .deserialize import deserialize
from .fallback import OTHER_SAVE, SAME_SAVE_CHECK_S, check_group, home_entry, local_where, one_load, read_again, refused
from .image import heap_image
from .into import check_into, check_map_location, in_place, place
from .missing import a_directory, lost_in_group, not_found
from .named import check_named
from .pins import Pins
from .prefetch import NOTHING, local_identity, put
from .published import check_published
from .unverified import damage, load_unverified, warn_unverified
from .verdict import HOME_FIRST, OLDER, SAME, compare

log = logging.getLogger("fastckpt")


@dataclass(frozen=True)
class LoadOptions:
    """How to load: ``map_location`` and ``weights_only`` as torch.load takes them; ``prefetch``
    a remote file into the burst buffer first; ``verify``: refuse a file without a manifest;
    ``mmap``: map a file copy-on-write instead of reading it (an object store's is read); ``into``:
    tensors to fill in place (``load.into``)."""

    map_location: object = None
    weights_only: bool = True
    prefetch: bool = False
    verify: bool = False
    mmap: bool = False
    into: object = None

    def __post_init__(self) -> None:
        if self.into is not None and self.mmap:
            raise ConfigError("load(..., mmap=True, into=...): mmap=True maps the file's pages as the tensors, into= "
                              "reads the file into your tensors. Pass one of them.")
        if self.into is not None:
            check_into(self.into)
            check_map_location(self.map_location)

    def image(self, url: str) -> ImageFactory:
        """What the read of ``url`` fills: a heap image, with ``into``'s memory where the saved
        tensor can be read straight into it (not when ``map_location`` sends the storages elsewhere)."""
        if self.into is None or not in_place(self.map_location):
            return functools.partial(heap_image, where=url)
        return functools.partial(heap_image, into=self.into, weights_only=self.weights_only, where=url)

    def done(self, obj: object) -> object:
        return obj if self.into is None else place(self.into, obj)


@dataclass(frozen=True)
class Loaded:
    """What a load returned, where from (``where``: "local", "path", "remote" or "remote (prefetched)") and
    in how long (``rto_s``), for the load event and ``stats().last_restore_from``."""

    obj: object
    url: str
    size: int
    where: str
    verified: bool = True
    manifest: dict | None = None  # its own (its checksum verified): None when unverified
    rto_s: float = 0.0


class Loader:
    """Args:
        homes: resolves names to their targets.
        local_path: where the burst-buffer copy of a name lives (None without local_dir).
        chunk_bytes: bytes per parallel read.
        saving: waits for this Checkpointer's saves of a path in flight.
        emit: the Checkpointer's event emitter (each load's ``load`` event).
    """

    def __init__(self, homes: Homes, local_path: Callable[[str], str | None], chunk_bytes: int,
                 saving: Callable[[str], None], emit: Callable[..., None]) -> None:
        self._homes, self._local_path, self._chunk, self._emit = homes, local_path, chunk_bytes, emit
        self._saving = saving  # waits for this Checkpointer's saves of a path in flight (their write and upload)
        self._pins = Pins(homes)

    def reading(self, group: str) -> contextlib.AbstractContextManager[dict]:
        """``Checkpointer.reading`` (``load.pins``). This Checkpointer's save or commit of ``group`` in
        flight is waited for first: the pin is what it publishes, which its loads wait for anyway."""
        self._saving(group)
        return self._pins.reading(group)

    def _read_current(self, loc: Location, opts: LoadOptions, url: str, where: str, home: str) -> Loaded:
        """``_read``, checking a group's file against its group's manifest as published now (within
        ``reading``: only against the pinned one, ``Pins.check``). A file whose group published
        another attempt between the read of its bytes and that check (the tag re-saved and swapped
        in) is read once more; a group that changed again meanwhile raises ``GroupChangedError``."""
        if self._pins.pinned(home):
            return self._read(loc, opts, url, where, home, pinned=True)
        try:
            return self._read(loc, opts, url, where, home)
        except NotPublishedError as first:
            seen = first.seen
        read_again()
        try:
            return self._read(loc, opts, url, where, home)
        except NotPublishedError as again:
            if again.seen == seen:
                raise  # the same published group names another file there: one left by another attempt
            raise GroupChangedError(f"{loc.url}: its group was saved again twice while the file was read; load it "
                                    "again") from again

    def load(self, path: str, opts: LoadOptions) -> Loaded:
        """Load ``path`` (normalised), preferring its verified burst-buffer copy.

        Raises:
            CorruptCheckpointError: the bytes do not match the recorded checksum (every copy),
                or an unverifiable file is damaged.
            UnverifiableCheckpointError: ``verify=True`` and the file has no manifest.
            ConfigError: ``path`` is a directory.
            IncompleteCheckpointError: the file's group was never committed.
            CheckpointNotFoundError: no copy of it exists (never saved there, or deleted since).
            BucketNotFoundError: the URL's bucket does not exist (never a CheckpointNotFoundError).

        Either way it emits one ``load`` event: the copy read, its size and time, or the error raised (a failed
        load: the event log, ``fastckpt report`` and ``fastckpt_failures_total`` count it as a failed save), but
        for a ``GroupChangedError``, which asks to load the group again.
        """
        t0, w0 = time.monotonic(), time.time()
        try:
            with one_load(), lost_in_group(self._homes, path):  # the home's group manifest read once (load.fallback)
                got = replace(self._load(path, opts), rto_s=time.monotonic() - t0)
        except Exception as exc:  # not a Ctrl-C: no failed load; nor a group re-saved during a reading, which
            if not isinstance(exc, GroupChangedError):  # asks to load it again (DeepSpeed's loads do so themselves)
                self._emit("load", path, 0, w0, "remote" if is_url(path) else "path", exc)
            raise
        self._emit("load", got.url, got.size, w0, got.where,
                   detail=f"rto_s={got.rto_s:.6f}" + ("" if got.verified else " unverified"))
        return got

    def _load(self, path: str, opts: LoadOptions) -> Loaded:
        self._saving(path)  # a save of it in flight here is the newest: load that, not the copy before it
        home = self._homes.resolve(path)
        if home.target.mounted and os.path.isdir(path):
            raise a_directory(path, local=True)
        candidates, judged = self._candidates(path, home)
        if opts.prefetch and not home.target.mounted and judged is not None:
            got = self._prefetch(path, home, opts, judged)
            self._pins.check(path, got.manifest)
            return got
        corrupt: CorruptCheckpointError | None = None  # an earlier copy's damage
        earlier: BaseException | None = None  # an earlier copy's failure
        for i, (loc, where) in enumerate(candidates):
            if where == OTHER_SAVE:  # the home failed; the local copy is of another save (``load.fallback``)
                raise refused(earlier, path, loc)  # type: ignore[arg-type]
            try:
                got = self._read_current(loc, opts, loc.url, where, path)
                if where == "remote":  # the object's own manifest verified it: is it the save its sidecar published?
                    check_published(loc, got.manifest, SAME_SAVE_CHECK_S)
                self._pins.check(path, got.manifest)
                return got
            except (CorruptCheckpointError, OSError) as exc:
                if i + 1 == len(candidates):
                    if where == "local" and earlier is not None:  # the home was read first: its failure counts
                        earlier.add_note(f"Its burst-buffer copy {loc.url} was unusable too: {exc}")
                        raise earlier  # noqa: B904 (exc is its context)
                    missing = isinstance(exc, FileNotFoundError) and not isinstance(exc, IncompleteCheckpointError)
                    if missing and corrupt is not None:  # a damaged copy is no missing checkpoint: never "start fresh"
                        raise CorruptCheckpointError(
                            f"{path} does not exist (the save never reached it, or it was deleted since), and the only "
                            f"copy left is damaged: {corrupt}") from corrupt
                    if missing:
                        gone = not_found(path, candidates, exc)
                        if earlier is not None:  # e.g. the burst-buffer copy is of another attempt of its group
                            gone.add_note(f"Its burst-buffer copy was not used: {earlier}")
                        raise gone from exc
                    if corrupt is not None and exc is not corrupt:
                        exc.add_note(f"Its burst-buffer copy was unusable too: {corrupt}")
                    raise
                corrupt, earlier = exc if isinstance(exc, CorruptCheckpointError) else corrupt, exc
                nxt = candidates[i + 1]
                if nxt[1] != OTHER_SAVE:
                    log.warning("fastckpt: %s unusable (%s); falling back to %s", loc.url, exc, nxt[0].url)
        raise AssertionError("unreachable: the last candidate returns or raises")

    def _prefetch(self, path: str, home: Location, opts: LoadOptions, judged: tuple[int, ...]) -> Loaded:
        """Download ``path`` beside its burst-buffer copy, verify it, and put it in place of the copy
        judged (``load.prefetch``). A download that does not verify is removed (the next load would
        try it first), and the error names the URL."""
        local: str = self._local_path(path)  # type: ignore[assignment]
        os.makedirs(os.path.dirname(local), exist_ok=True)
        tmp = self._homes.resolve(tmp_name(local))
        try:
            try:
                home.target.download(home.key, tmp.url)
            except FileNotFoundError as exc:  # as a load without prefetch says it: nothing there to resume from
                raise not_found(path, [(home, "remote")], exc) from exc
            try:
                got = self._read_current(tmp, opts, path, "remote (prefetched)", path)
                check_published(home, got.manifest, SAME_SAVE_CHECK_S)
            except CorruptCheckpointError as exc:
                cls = UnverifiableCheckpointError if isinstance(exc, UnverifiableCheckpointError) else None
                raise (cls or CorruptCheckpointError)(f"{str(exc).replace(tmp.url, home.url)} (read from its download "
                                                      f"into the burst buffer, {tmp.url}, which was removed)") from exc
            return got if put(tmp.target.ops, tmp.url, local, judged) else replace(got, where="remote")
        finally:
            discard(tmp.target.ops, tmp.url)  # gone once renamed; else the download, or its second name

    def _candidates(self, path: str, home: Location) -> tuple[list[tuple[Location, str]], tuple[int, ...] | None]:
        """The copies to try, in order, and whether a prefetch may download ``path`` over its
        burst-buffer copy: there is none (``NOTHING``), or it is of an older save than the home's
        (or of none: it has no manifest), named by its ``identity`` (None: it may not, or it cannot be
        looked at: ``prefetch.local_identity``, then the home alone is tried). A later one
        (its upload failed, or a crash cut it short) is not a checkpoint, but it is the only copy of
        that save: it stays."""
        where = "path" if home.target.mounted else "remote"
        local_name = self._local_path(path)
        judged = local_identity(local_name, path) if local_name is not None else None  # None: unusable
        if judged is None or judged == NOTHING:
            return [(home, where)], judged
        local = self._homes.resolve(local_name)  # type: ignore[arg-type]
        verdict = compare(local, home, self._in_group)
        if verdict == HOME_FIRST:  # the home first; the local copy after it only if of the same save
            return [(home, where), (local, local_where(local, home, self._in_group))], None
        if verdict == SAME:
            return [(local, "local"), (home, where)], None
        return [(home, where)], judged if verdict == OLDER else None  # of a save that never reached path, or older

    def _in_group(self, home: Location, ours: dict | None) -> dict | None:
        """For a group's file at a URL (no sidecar): the checksum its group's published manifest
        there gives it, as a manifest's ``checksum``; None when that cannot say."""
        found = home_entry(self._homes, home.url, ours) if ours else None
        entry = found.entry if found else None
        return {"checksum": {"value": entry["checksum"]}} if entry else None

    def _read(self, loc: Location, opts: LoadOptions, url: str, where: str, home: str, pinned: bool = False) -> Loaded:
        res = loc.target.read_object(loc.key, chunk_bytes=self._chunk, mapped=opts.mmap, into=opts.image(loc.url))
        if res.manifest is None:
            check_named(self._homes, res, loc.url, home, self._pins.held())  # one its group records otherwise: damage
            if opts.verify:
                found = damage(res, loc.url)  # a checkpoint cut short is damaged, not a plain file to accept
                if found is not None:
                    raise found
                raise UnverifiableCheckpointError(
                    f"{loc.url} has no fastckpt manifest (a plain torch.save file, or a checkpoint that lost its "
                    "tail?): nothing records what its bytes should be. If it is a plain torch.save file you trust, "
                    "load it with verify=False to accept it unverified.")
            obj = load_unverified(res, loc.url, opts)  # a damaged one raises: no "loading unverified" then
            warn_unverified(loc.url)
            return Loaded(opts.done(obj), url, res.size, where, verified=False)
        if not pinned:  # within a reading, Pins.check judges it
            check_group(self._homes, loc.url, home, res.manifest)
        want = res.manifest["checksum"]["value"]
        if res.checksum != want:
            raise CorruptCheckpointError(
                f"{loc.url} is corrupt: checksum {res.checksum} != {want} recorded when it was written. "
                "Restore from another copy or an earlier checkpoint (fastckpt.latest(...)).")
        obj = deserialize(res.buffer, res.size, opts.map_location, opts.weights_only, loc.url)
        return Loaded(opts.done(obj), url, res.size, where, manifest=res.manifest)
