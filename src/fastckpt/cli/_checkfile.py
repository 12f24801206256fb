"""One file of a checkpoint checked against what was committed (``fastckpt verify``): its bytes
read back in parallel through its target, checked again when its checkpoint is saved again
meanwhile; what is wrong, or None."""

from __future__ import annotations

import errno
from dataclasses import replace

from ..commit.membership import require_complete_group
from ..commit.names import framework_files
from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..format.checksum import checksum_bytes
from ..storage.homes import Homes
from ..storage.types import TargetNotFoundError
from ._discovery import RECHECKS, group_manifest
from ._files import NO_MANIFEST, FileSpec, as_landed, file_covered, file_manifest, single_file

MISSING = "missing"
REPLACED = f"saved again during each of {RECHECKS} checks"
NOT_A_FILE = "a directory stands where this file should be: move it away, then restore the file from a replica"


def file_size(h: Homes, spec: FileSpec) -> int | None:
    loc = h.resolve(spec.path)
    try:
        return loc.target.size(loc.key)
    except OSError:
        return None


def vanished(exc: OSError) -> bool:
    """A file (or the directory it was in) that is not there, also as the storage layer wraps it."""
    return isinstance(exc, FileNotFoundError) or exc.errno in (errno.ENOENT, errno.ENOTDIR)


def _unreadable(exc: OSError) -> str | None:
    """What a checkpoint's file that cannot be read is, when that is its own fault (not the
    storage's: those stop the check); None otherwise."""
    if vanished(exc):
        return MISSING
    return NOT_A_FILE if isinstance(exc, IsADirectoryError) or exc.errno == errno.EISDIR else None


def check_file(h: Homes, spec: FileSpec, on_bytes=None) -> str | None:  # noqa: ANN001
    """None when the file is intact; else what is wrong with it (read back in parallel through
    its target: O_DIRECT chunks on a file system, ranged reads at a URL).

    A file whose checkpoint was saved again while it was checked (its manifest, or its group's,
    now records another save than the one checked: the reads saw parts of both) is checked again,
    ``RECHECKS`` times at most, then ``REPLACED``: never reported damaged for that."""
    for _ in range(RECHECKS):
        why = _check(h, spec, on_bytes)
        if why is None or (now := _published(h, spec)) is None or now == spec:
            return why
        if isinstance(now, str):
            return now
        spec = now
    return REPLACED


def _published(h: Homes, spec: FileSpec) -> FileSpec | str | None:
    """``spec`` as its checkpoint's manifest records it now (``REPLACED``: its group was saved
    again without it); None when that cannot be read."""
    try:
        if spec.group is not None:
            m, rel = group_manifest(h.resolve(spec.group)), spec.path[len(spec.group.rstrip("/")) + 1:]
            if spec.whole:
                digest = framework_files(m).get(rel)
                return (REPLACED if m is not None else None) if digest is None else replace(spec, checksum=str(digest))
            entry = ((m or {}).get("files") or {}).get(rel)
            if entry is None:
                return REPLACED if m is not None else None
            return FileSpec(spec.path, int(entry["size"]), entry["checksum"], spec.group)
        m = file_manifest(h.resolve(spec.path))
        return single_file(spec.path, m) if m else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_whole(h: Homes, spec: FileSpec, on_bytes=None) -> str | None:  # noqa: ANN001
    """A framework's file of a group (``FRAMEWORK_FILES``): its whole bytes against the checksum
    the group's manifest records, as the framework's loader checks it."""
    loc = h.resolve(spec.path)
    try:
        data = loc.target.get_bytes(loc.key)
    except TargetNotFoundError:
        return "missing"
    except OSError as exc:
        return _unreadable(exc) or f"cannot be read: {exc}"
    if checksum_bytes(data) != spec.checksum:
        return (f"{len(data)} bytes whose checksum is not the one committed with the group (a framework wrote it "
                "again in place: a killed save into this checkpoint?)")
    if on_bytes:
        on_bytes(len(data))
    return None


def damaged_manifest(spec: FileSpec, exc: CorruptCheckpointError) -> str:
    """What a file whose own manifest (its last bytes) is damaged is, with the way forward."""
    what = str(exc).removeprefix(f"{spec.path}: ")
    kept = f"its checkpoint {spec.group} committed it" if spec.group is not None else "it was written"
    return (f"its own manifest (in its last bytes) is damaged: {what}; {kept} whole, so it changed since: copy it "
            "again from a good copy (the burst buffer's, a replica), or restore an earlier checkpoint")


def _check(h: Homes, spec: FileSpec, on_bytes=None) -> str | None:  # noqa: ANN001
    if spec.whole:
        return check_whole(h, spec, on_bytes)
    try:
        size, covered, own = file_covered(h, spec)
    except OSError as exc:
        if (why := _unreadable(exc)) is not None:
            return why
        raise
    except CorruptCheckpointError as exc:  # no manifest in its tail: cut short, if it is not the committed size
        got = file_size(h, spec)
        if got is not None and not spec.fits(got):
            return f"{got} bytes, but {spec.size} were committed"
        return str(exc) if str(exc).endswith(NO_MANIFEST) else damaged_manifest(spec, exc)
    spec = as_landed(h, spec, own)  # its object landed, its sidecar did not follow: judged as a load judges it
    want = own["checksum"]["value"]
    if spec.group is not None and spec.checksum not in (None, want) and own.get("group"):
        try:  # another save's file over the group's own (moved or copied here): said as a load says it
            require_complete_group(h, spec.path, own)
        except (CorruptCheckpointError, IncompleteCheckpointError) as exc:
            return str(exc).removeprefix(f"{spec.path} ")
    if not spec.fits(size):
        return f"{size} bytes, but {spec.size} were committed"
    if spec.checksum is not None and want != spec.checksum:
        return f"its manifest records checksum {want}, the checkpoint's manifest {spec.checksum}"
    if spec.group is None and own.get("group"):  # a group's file named alone: it loads as its group allows
        try:
            require_complete_group(h, spec.path, own)
        except (CorruptCheckpointError, IncompleteCheckpointError) as exc:
            return str(exc).removeprefix(f"{spec.path} ")
    loc = h.resolve(spec.path)
    try:
        loc.target.verify(loc.key, size, want, covered)
    except CorruptCheckpointError as exc:
        return str(exc).removeprefix(f"{loc.url}: ")
    except OSError as exc:  # deleted while it was read
        if (why := _unreadable(exc)) is not None:
            return why
        raise
    if on_bytes:
        on_bytes(size)
    return None
