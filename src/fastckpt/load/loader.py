"""``Checkpointer.load``: find the best copy, read it whole, verify it, deserialise it.

A save of the path in flight on the same Checkpointer is waited for first. Copies are then
tried in order: the burst-buffer copy in ``local_dir`` (when there is one, and it is of the same
save as the copy at the path, by the checksum in its manifest or, at a URL, its sidecar), then
the path itself. Each copy is read through its
home's ``Target`` (``storage.homes``): a file on a mounted file system in parallel through one
open descriptor (O_DIRECT where honoured), an object with parallel ranged reads; either way
the checksum of the covered bytes is computed while the bytes arrive. A copy that fails to read
or verify falls back to the next one with a warning. A file of a group is loaded only once its
group is published. With ``prefetch=True`` a remote file is first downloaded into the burst
buffer, so the next load is local.

A file without a fastckpt manifest (written by plain ``torch.save``, another checkpointer, or a
tool) loads unverified: reported at WARNING once per path and in the load's event, and refused
with ``verify=True``. Such a file that is empty, not a torch file, or truncated raises
``CorruptCheckpointError`` naming it and what is wrong.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import threading
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..commit.discovery import group_entry, require_complete_group
from ..commit.protocol import incomplete_group_error, read_group_manifest, read_sidecar
from ..errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    GroupChangedError,
    IncompleteCheckpointError,
    UnverifiableCheckpointError,
)
from ..io.engine import ImageFactory, ReadResult
from ..storage.homes import Homes, Location
from .deserialize import deserialize
from .image import ZIP_MAGIC, HeapImage, heap_image
from .into import in_place, place

log = logging.getLogger("fastckpt")
#: torch.save's pre-zip format: a pickle (protocol 2 by default; ``pickle_protocol=`` 3 to 5)
LEGACY_MAGIC = tuple(bytes([0x80, p]) for p in range(2, 6))
_warned: set[str] = set()  # paths loaded unverified that were reported already
_warned_lock = threading.Lock()
#: How long the check that the burst-buffer copy is of the save at an object-store home retries
#: a store that does not answer, before the local copy is loaded anyway (as without the check).
SAME_SAVE_CHECK_S = 5.0


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
    checksum: str | None = None  # the one its manifest records (verified): None when unverified


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
        self._pins = threading.local()  # .groups: group -> the manifest ``reading`` pinned (this thread's loads)

    @contextmanager
    def reading(self, group: str) -> Iterator[dict]:
        """``Checkpointer.reading``: pin the published manifest of ``group`` (normalised) for this
        thread's loads of its files; yields it. Nested for the same group: the outer pin holds.

        Raises:
            IncompleteCheckpointError: ``group`` has no published manifest.
        """
        pins: dict[str, dict] = self._pins.__dict__.setdefault("groups", {})
        if group in pins:
            yield pins[group]
            return
        place = self._homes.resolve(group).place()
        manifest = read_group_manifest(place)
        if manifest is None:
            raise incomplete_group_error(place, None)
        pins[group] = manifest
        try:
            yield manifest
        finally:
            del pins[group]

    def _check_pinned(self, path: str, got: Loaded) -> None:
        """A file of a group pinned by ``reading`` must be the one its pinned manifest names."""
        for group, manifest in getattr(self._pins, "groups", {}).items():
            if got.checksum is None or not path.startswith(group.rstrip("/") + "/"):
                continue
            entry = (manifest.get("files") or {}).get(path[len(group.rstrip("/")) + 1:])
            if entry is None or entry.get("checksum") != got.checksum:
                raise GroupChangedError(
                    f"{path} is not the file group {group} held when reading it began (committed at "
                    f"{manifest.get('committed_at')}, attempt {manifest.get('attempt')}): the group was saved again "
                    "and swapped in since, so the files loaded before are of the earlier save. Nothing was mixed: "
                    "load the group again (all its files, in a new reading()).")

    def load(self, path: str, opts: LoadOptions) -> Loaded:
        """Load ``path`` (normalised), preferring its verified burst-buffer copy.

        Raises:
            CorruptCheckpointError: the bytes do not match the recorded checksum (every copy),
                or an unverifiable file is damaged.
            UnverifiableCheckpointError: ``verify=True`` and the file has no manifest.
            ConfigError: ``path`` is a directory.
            IncompleteCheckpointError: the file's group was never committed.
            CheckpointNotFoundError: no copy of it exists (never saved there, or deleted since).
        """
        self._saving(path)  # a save of it in flight here is the newest: load that, not the copy before it
        home = self._homes.resolve(path)
        if home.target.mounted and os.path.isdir(path):
            raise ConfigError(f"{path} is a directory, not a checkpoint file: load a file inside it (a group's files "
                              f"load one at a time), or fastckpt.latest({path!r}) for the newest checkpoint under it")
        candidates, replaceable = self._candidates(path, home)
        if opts.prefetch and not home.target.mounted and replaceable:
            local = self._homes.resolve(self._local_path(path))  # type: ignore[arg-type]
            os.makedirs(os.path.dirname(local.url), exist_ok=True)
            home.target.download(home.key, local.url)
            got = self._read(local, opts, path, "remote (prefetched)")
            self._check_pinned(path, got)
            return got
        corrupt: CorruptCheckpointError | None = None  # an earlier copy's damage
        for i, (loc, where) in enumerate(candidates):
            try:
                got = self._read(loc, opts, loc.url, where)
                self._check_pinned(path, got)
                return got
            except (CorruptCheckpointError, OSError) as exc:
                if i + 1 == len(candidates):
                    missing = isinstance(exc, FileNotFoundError) and not isinstance(exc, IncompleteCheckpointError)
                    if missing and corrupt is not None:  # a damaged copy is no missing checkpoint: never "start fresh"
                        raise CorruptCheckpointError(
                            f"{path} does not exist (the save never reached it, or it was deleted since), and the only "
                            f"copy left is damaged: {corrupt}") from corrupt
                    if missing:
                        raise _not_found(path, candidates, exc) from exc
                    if corrupt is not None and exc is not corrupt:
                        exc.add_note(f"Its burst-buffer copy was unusable too: {corrupt}")
                    raise
                corrupt = exc if isinstance(exc, CorruptCheckpointError) else corrupt
                log.warning("fastckpt: %s unusable (%s); falling back to %s", loc.url, exc, candidates[i + 1][0].url)
        raise AssertionError("unreachable: the last candidate returns or raises")

    def _candidates(self, path: str, home: Location) -> tuple[list[tuple[Location, str]], bool]:
        """The copies to try, in order, and whether a prefetch may download ``path`` over its
        burst-buffer copy: there is none, or it is of an older save than the home's. A later one
        (its upload failed, or a crash cut it short) is not a checkpoint, but it is the only copy
        of that save: it stays."""
        where = "path" if home.target.mounted else "remote"
        local_name = self._local_path(path)
        if local_name is None or not os.path.exists(local_name):
            return [(home, where)], local_name is not None
        local = self._homes.resolve(local_name)
        other, older = self._other_save(local, home)
        if other:  # the local copy is of a save that never reached path, or another node saved since
            return [(home, where)], older
        return [(local, "local"), (home, where)], False

    def _other_save(self, local: Location, home: Location) -> tuple[bool, bool]:
        """Whether the copies hold different saves: both carry readable manifests with different
        checksums; and whether ours is then the older one. The home's manifest is read cheaply:
        from the file's tail on a mounted file system, else from its sidecar or its group's
        manifest (one small GET, retried for ``SAME_SAVE_CHECK_S`` at most): a home that cannot
        say which save it holds (missing, unreachable, damaged) leaves the local copy first, as
        the verified load then decides."""
        try:
            ours = local.target.read_manifest(local.key)
            if home.target.mounted:
                if not home.target.exists(home.key):
                    return False, False
                theirs = home.target.read_manifest(home.key)
                if theirs is None:
                    return True, False  # a file without a manifest replaced ours there (plain torch.save, DeepSpeed)
            else:
                theirs = read_sidecar(home, deadline_s=SAME_SAVE_CHECK_S) or self._in_group(home, ours)
        except (OSError, ValueError):  # unreadable: let the verified load decide
            return False, False
        if not (ours and theirs) or ours["checksum"]["value"] == theirs["checksum"]["value"]:
            return False, False
        return True, float(ours.get("written_at", 0.0)) <= float(theirs.get("written_at", 0.0))

    def _in_group(self, home: Location, ours: dict | None) -> dict | None:
        """For a group's file at a URL (no sidecar): the checksum its group's published manifest
        there gives it, as a manifest's ``checksum``; None when that cannot say."""
        found = group_entry(self._homes, home.url, ours) if ours else None
        entry = found[2] if found else None
        return {"checksum": {"value": entry["checksum"]}} if entry else None

    def _read(self, loc: Location, opts: LoadOptions, url: str, where: str) -> Loaded:
        res = loc.target.read_object(loc.key, chunk_bytes=self._chunk, mapped=opts.mmap, into=opts.image(loc.url))
        if res.manifest is None:
            if opts.verify:
                raise UnverifiableCheckpointError(
                    f"{loc.url} has no fastckpt manifest (a plain torch.save file?): nothing records what its bytes "
                    "should be. Load it with verify=False to accept it unverified.")
            obj = _unverified(res, loc.url, opts)  # a damaged one raises: no "loading unverified" then
            _warn_unverified(loc.url)
            return Loaded(opts.done(obj), url, res.size, where, verified=False)
        require_complete_group(self._homes, loc.url, res.manifest)
        want = res.manifest["checksum"]["value"]
        if res.checksum != want:
            raise CorruptCheckpointError(
                f"{loc.url} is corrupt: checksum {res.checksum} != {want} recorded when it was written. "
                "Restore from another copy or an earlier checkpoint (fastckpt.latest(...)).")
        obj = deserialize(res.buffer, res.size, opts.map_location, opts.weights_only, loc.url)
        return Loaded(opts.done(obj), url, res.size, where, checksum=want)


def _warn_unverified(url: str) -> None:
    with _warned_lock:
        first = url not in _warned
        _warned.add(url)
    if first:
        log.warning("fastckpt: %s has no fastckpt manifest (written by plain torch.save or another tool?): loading "
                    "it unverified; load(..., verify=True) refuses such files", url)


def _unverified(res: ReadResult, url: str, opts: LoadOptions) -> object:
    """A file without a manifest: only its own structure can say it is damaged."""
    buf = res.buffer
    head = buf.fetch(0, 4) if isinstance(buf, HeapImage) else bytes(memoryview(buf)[: min(4, res.size)])
    if res.size == 0:
        raise CorruptCheckpointError(f"{url} is empty (0 bytes): it was truncated or never written. Load an "
                                     "earlier checkpoint (fastckpt.latest(...)).")
    if head != ZIP_MAGIC and not head.startswith(LEGACY_MAGIC):
        raise CorruptCheckpointError(f"{url} is not a torch.save file (it starts with {head!r}, not a zip or "
                                     "pickle header): damaged, or not a checkpoint.")
    try:
        return deserialize(res.buffer, res.size, opts.map_location, opts.weights_only, url)
    except pickle.UnpicklingError:
        raise  # weights_only refused an object: not damage (the error says how to opt in)
    except (RuntimeError, EOFError, KeyError, ValueError, zipfile.BadZipFile, pickle.PickleError) as exc:
        raise CorruptCheckpointError(f"{url} is truncated or damaged: torch cannot read it ({exc}). Load an "
                                     "earlier checkpoint (fastckpt.latest(...)).") from exc


def _not_found(path: str, candidates: list, exc: OSError) -> CheckpointNotFoundError:
    local = f" (nor its burst-buffer copy {candidates[0][0].url})" if len(candidates) > 1 else ""
    home = candidates[-1][0]
    said = "" if home.target.mounted else f" The store said: {exc}"
    return CheckpointNotFoundError(
        f"{path} does not exist{local}: it was never saved there, or it was deleted since (retention: "
        "keep_persistent, keep_local; or remove()). A checkpoint latest() named a while ago may be gone: "
        f"fastckpt.latest(<its directory>) names the newest complete one now.{said}")
