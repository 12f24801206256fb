"""A checkpoint's files as ``ls``, ``latest`` and ``verify`` check them: where each is, and the
size and checksum it was committed with (a group's manifest records both; a single file's
manifest, its own or its sidecar, records enough to derive them)."""

from __future__ import annotations

import errno
from dataclasses import dataclass

from ..commit.protocol import read_sidecar
from ..errors import CorruptCheckpointError
from ..format.manifest import committed_sizes, file_order
from ..load.published import landed_first
from ..storage.homes import Homes, Location
from ..storage.types import TargetNotFoundError

NO_MANIFEST = "has no fastckpt manifest: it cannot be verified"


@dataclass(frozen=True)
class FileSpec:
    """A file ``verify`` checks: where, and its size and checksum as committed (None: its own manifest has them)."""

    path: str
    size: int | None
    checksum: str | None
    group: str | None = None  # the group it is a file of (None: a single file)
    whole: bool = False  # a framework's file of the group: ``checksum`` is its whole bytes' (framework_files)
    legacy_size: int | None = None  # a single file's size had it been written before its manifest carried a sum
    order: float | None = None  # a single file's: when the save its manifest records was requested (``file_order``)

    def fits(self, size: int) -> bool:
        """Whether ``size`` is the file's committed size (any size, when none is recorded)."""
        return self.size is None or size in (self.size, self.legacy_size)


def single_file(path: str, manifest: dict) -> FileSpec:
    """The single file at ``path``, published with ``manifest``. At a URL the sidecar is all that
    says what the object must hold: an object cut short or grown since is caught by its size."""
    size, legacy = committed_sizes(manifest)
    return FileSpec(path, size, manifest["checksum"]["value"], legacy_size=legacy, order=file_order(manifest))


def as_landed(h: Homes, spec: FileSpec, own: dict | None = None) -> FileSpec:
    """A single file at a URL whose object holds a later save than its sidecar published (a save
    of the same URL killed, or failed, between its object and its sidecar): that save, as its own
    manifest (``own``, else read from the object's tail) records it, since a load takes the object
    (``load.published.landed_first``). Else ``spec``, also when the object's manifest cannot be read."""
    loc = h.resolve(spec.path)
    if spec.group is not None or spec.order is None or loc.target.mounted:
        return spec
    if own is None:
        try:
            own = loc.target.read_manifest(loc.key)
        except (OSError, ValueError):  # missing, not answering, or no manifest in its tail: as the sidecar says
            return spec
    if not own or own["checksum"]["value"] == spec.checksum or not landed_first(own, spec.order):
        return spec
    return single_file(spec.path, own)


def file_manifest(loc: Location) -> dict | None:
    """A single file's published manifest: its own (mounted file system) or its sidecar; its own
    too at a URL for a file copied in without its sidecar (aws s3 cp), or whose sidecar is damaged
    (it says nothing: the object is judged by itself, as a load and ``latest`` judge it)."""
    try:
        if not loc.target.mounted:
            try:
                side = read_sidecar(loc)
            except CorruptCheckpointError:
                side = None
            if side is not None:
                return side
        return loc.target.read_manifest(loc.key)
    except (TargetNotFoundError, FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except OSError as exc:  # the storage layer's error, wrapping one of those (a directory, a group being deleted)
        if exc.errno in (errno.ENOENT, errno.EISDIR, errno.ENOTDIR):
            return None
        raise


def file_covered(h: Homes, spec: FileSpec) -> tuple[int, int, dict]:
    """(size, covered, the file's own manifest) read from its tail.

    Raises:
        CorruptCheckpointError: the tail holds no fastckpt manifest, or a damaged one.
        FileNotFoundError: the file is missing (locally or at the URL).
    """
    loc = h.resolve(spec.path)
    size = loc.target.size(loc.key)
    m = loc.target.read_manifest(loc.key)
    if not m:
        raise CorruptCheckpointError(f"{spec.path} {NO_MANIFEST}")
    return size, int(m["covered"]), m


def gone(h: Homes, path: str) -> bool:
    """Whether nothing is left at ``path`` (a file, or a directory or prefix with nothing under it):
    a checkpoint removed (retention) since it was listed, not one that is there and unverifiable."""
    loc = h.resolve(path)
    under = loc.key.rstrip("/") + "/" if loc.key.strip("/") else ""  # under run/step-100/, not run/step-1000
    try:
        return not loc.target.exists(loc.key) and not loc.target.list(under, max_depth=1)
    except FileNotFoundError:
        return True
    except OSError:  # cannot tell: taken as there
        return False
