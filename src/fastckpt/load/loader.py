"""``Checkpointer.load``: find the best copy, read it whole, verify it, deserialise it.

A save of the path in flight on the same Checkpointer is waited for first. Copies are then
tried in order: the burst-buffer copy in ``local_dir`` (when there is one, and it is of the same
save as the copy at the path, by the checksum in its manifest or, at a URL, its sidecar: see
``Loader._compare``), then the path itself. Each copy is read through its
home's ``Target`` (``storage.homes``): a file on a mounted file system in parallel through one
open descriptor (O_DIRECT where honoured), an object with parallel ranged reads; either way
the checksum of the covered bytes is computed while the bytes arrive. A copy that fails to read
or verify falls back to the next one with a warning. A single file read from its URL must also be
the save its sidecar published (``load.published``). A file of a group is loaded only once its
group is published. With ``prefetch=True`` a remote file is first downloaded into the burst
buffer, so the next load is local (never over a save that landed there meanwhile: ``load.prefetch``).

A file without a fastckpt manifest (written by plain ``torch.save``, another checkpointer, or a
tool) loads unverified: reported at WARNING once per path and in the load's event, and refused
with ``verify=True``. Such a file that is empty, not a torch file, truncated or otherwise
damaged raises ``CorruptCheckpointError`` naming it and what is wrong (``load.unverified``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..commit.foreign import torch_zip
from ..commit.membership import NotPublishedError
from ..errors import (
    ConfigError,
    CorruptCheckpointError,
    GroupChangedError,
    IncompleteCheckpointError,
    UnverifiableCheckpointError,
)
from ..format.manifest import file_order
from ..io.atomic import discard, tmp_name
from ..io.engine import ImageFactory
from ..storage.homes import Homes, Location
from ..storage.types import TargetNotFoundError, TargetUnavailableError
from .deserialize import deserialize
from .fallback import OTHER_SAVE, check_group, home_entry, local_where, one_load, read_again, refused
from .image import heap_image
from .into import check_into, check_map_location, in_place, place
from .missing import a_directory, not_found
from .pins import Pins
from .prefetch import NOTHING, identity, put
from .published import check_published, home_sidecar
from .unverified import damage, load_unverified, warn_unverified

log = logging.getLogger("fastckpt")
#: How long the check that the burst-buffer copy is of the save at an object-store home retries
#: a store that does not answer, before the local copy is loaded anyway (as without the check).
SAME_SAVE_CHECK_S = 5.0
#: How the burst-buffer copy relates to the home's (``Loader._compare``)
SAME, OTHER, OLDER, HOME_FIRST = "same", "other", "older", "home first"


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
    """What a load returned and where from (``where``: "local", "path", "remote" or
    "remote (prefetched)"), for the load event and ``stats().last_restore_from``."""

    obj: object
    url: str
    size: int
    where: str
    verified: bool = True
    manifest: dict | None = None  # its own (its checksum verified): None when unverified


class Loader:
    """Args:
        homes: resolves names to their targets.
        local_path: where the burst-buffer copy of a name lives (None without local_dir).
        chunk_bytes: bytes per parallel read.
    """

    def __init__(self, homes: Homes, local_path: Callable[[str], str | None], chunk_bytes: int,
                 saving: Callable[[str], None] = lambda path: None) -> None:
        self._homes, self._local_path, self._chunk = homes, local_path, chunk_bytes
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
            return self._read(loc, opts, url, where, home=None)
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
        """
        with one_load():  # the home's group manifest read once for this load (``load.fallback``)
            return self._load(path, opts)

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
        (or of none: it has no manifest), named by its ``identity`` (None: it may not). A later one
        (its upload failed, or a crash cut it short) is not a checkpoint, but it is the only copy of
        that save: it stays."""
        where = "path" if home.target.mounted else "remote"
        local_name = self._local_path(path)
        judged = identity(local_name) if local_name is not None else None
        if judged is None or judged == NOTHING:
            return [(home, where)], judged
        local = self._homes.resolve(local_name)  # type: ignore[arg-type]
        verdict = self._compare(local, home)
        if verdict == HOME_FIRST:  # the home first; the local copy after it only if of the same save
            return [(home, where), (local, local_where(local, home, self._in_group))], None
        if verdict == SAME:
            return [(local, "local"), (home, where)], None
        return [(home, where)], judged if verdict == OLDER else None  # of a save that never reached path, or older

    def _compare(self, local: Location, home: Location) -> str:
        """How the burst-buffer copy relates to the home's, read cheaply: on a mounted file system
        the home file's own manifest (``_file_manifest``), at a URL its sidecar or its group's
        manifest (one small GET, retried for ``SAME_SAVE_CHECK_S`` at most).

        ``SAME``: the same save (equal checksums), or a home that cannot say which save it holds
        (missing, unreachable, a damaged sidecar): the local copy first, as the verified load then
        decides. ``OTHER``: the home holds another save (a complete zip without a manifest on a
        file system: plain torch.save, DeepSpeed; one cut short or zeroed is ours, damaged:
        ``HOME_FIRST``); ``OLDER``: another, and ours is older (``file_order``), or
        ours has no manifest while the home's has (a plain file prefetched before the path was
        saved with fastckpt, or a copy cut short: no save's only copy), so a prefetch may replace
        it. ``HOME_FIRST``: see ``_file_manifest``.
        """
        try:
            ours = local.target.read_manifest(local.key)
        except (OSError, ValueError):  # a damaged local copy: the load falls back from it, with a warning
            return SAME
        try:
            if home.target.mounted:
                theirs = self._file_manifest(home)
                if isinstance(theirs, str):
                    return theirs
                if theirs is None:  # a complete plain zip replaced ours there (torch.save, DeepSpeed); else
                    return OTHER if torch_zip(home.target, home.key) is not None else HOME_FIRST  # ours, damaged
                if ours and theirs.get("group") and theirs["checksum"] != ours["checksum"] and \
                        self._in_group(home, theirs) == {"checksum": {"value": ours["checksum"]["value"]}}:
                    return SAME  # another of the group's files moved over the home's: ours is the one published
            else:
                theirs = home_sidecar(home, SAME_SAVE_CHECK_S) or self._in_group(home, ours)
                if theirs is None and ours is None:
                    return _plain_copies(local, home)
        except (OSError, ValueError):  # unreachable, or a damaged sidecar: the home cannot say
            return SAME
        if ours is None and theirs is not None:
            log.warning("fastckpt: burst-buffer copy %s unusable: it has no fastckpt manifest while %s has one (a "
                        "plain file prefetched before the path was saved with fastckpt, or a copy cut short); "
                        "loading %s", local.url, home.url, home.url)
            return OLDER
        if theirs is None or ours["checksum"]["value"] == theirs["checksum"]["value"]:
            return SAME
        return OLDER if file_order(ours) <= file_order(theirs) else OTHER

    def _file_manifest(self, home: Location) -> dict | None | str:
        """The manifest of the file at a mounted home (None: it has none), or ``SAME`` when the home
        cannot say (the file is missing, or the storage does not answer). The size and tail are read
        through one descriptor, so a save renamed over the file meanwhile gives the old or the new
        one; a read that fails anyway (EIO, a stale NFS handle after such a rename, a trailer torn or
        damaged) is tried once more, and then gives ``HOME_FIRST``: the file is there, and its load
        verifies itself, so it is read before the local copy, never skipped for it (which could be
        of an older save)."""
        failed: BaseException | None = None
        for _ in range(2):
            try:
                if not home.target.exists(home.key):
                    return SAME
                return home.target.read_manifest(home.key)
            except (TargetNotFoundError, TargetUnavailableError):  # deleted since, or not answering
                return SAME
            except (OSError, ValueError) as exc:
                failed = exc
        log.warning("fastckpt: cannot read which save %s holds (%s): loading it before the burst-buffer copy, "
                    "which is the fallback", home.url, failed)
        return HOME_FIRST

    def _in_group(self, home: Location, ours: dict | None) -> dict | None:
        """For a group's file at a URL (no sidecar): the checksum its group's published manifest
        there gives it, as a manifest's ``checksum``; None when that cannot say."""
        found = home_entry(self._homes, home.url, ours) if ours else None
        entry = found.entry if found else None
        return {"checksum": {"value": entry["checksum"]}} if entry else None

    def _read(self, loc: Location, opts: LoadOptions, url: str, where: str, home: str | None) -> Loaded:
        res = loc.target.read_object(loc.key, chunk_bytes=self._chunk, mapped=opts.mmap, into=opts.image(loc.url))
        if res.manifest is None:
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
        if home is not None:  # None: within a reading, Pins.check judges it
            check_group(self._homes, loc.url, home, res.manifest)
        want = res.manifest["checksum"]["value"]
        if res.checksum != want:
            raise CorruptCheckpointError(
                f"{loc.url} is corrupt: checksum {res.checksum} != {want} recorded when it was written. "
                "Restore from another copy or an earlier checkpoint (fastckpt.latest(...)).")
        obj = deserialize(res.buffer, res.size, opts.map_location, opts.weights_only, loc.url)
        return Loaded(opts.done(obj), url, res.size, where, manifest=res.manifest)


def _plain_copies(local: Location, home: Location) -> str:
    """``SAME`` or ``OLDER`` for two files without a manifest at a URL (a plain torch.save file and
    its download by a prefetch). No checksum exists and no ETag is kept locally, so what both sides
    have decides: the same size, and the home's written no later than the local copy (the
    download, written after what it copied). A store's clock ahead of this node's only makes a copy
    look older (the home is loaded: correct, slower); one behind by more than the time between the
    download and a re-save of the same size is the case this misses."""
    size, date = home.target.size(home.key), home.target.modified(home.key)
    mine = os.stat(local.url)
    return SAME if size == mine.st_size and date <= mine.st_mtime else OLDER
