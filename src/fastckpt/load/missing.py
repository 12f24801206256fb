"""What a load that found no file says: a directory (a group) is named as one, a missing bucket
as a wrong URL, and only a key that is truly absent is ``CheckpointNotFoundError``, which resume
code may take for "nothing saved there: start fresh". A file a published group names that is
missing or damaged was lost after its commit: the error says so, with advice that leads away
from that group (``lost_in_group``)."""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Iterator

from ..commit.discovery import DCP_METADATA
from ..commit.foreign import DCP, dcp_how_to_load, torch_zip
from ..commit.membership import naming_group
from ..errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from ..storage.homes import Homes, Location
from ..storage.types import BucketNotFoundError
from .fallback import home_group


def nothing_to_load() -> ConfigError:
    """``load(None)``: what ``latest()`` returns before any checkpoint is complete (the README's resume pattern)."""
    return ConfigError("load(None): no checkpoint to load. fastckpt.latest() returns None when the directory holds "
                       "no complete checkpoint yet (a save still being written or uploaded is not complete: wait() "
                       "for it first); start from scratch in that case")


def a_directory(path: str, dcp: bool = False, local: bool = False) -> ConfigError:
    """``dcp`` (``local``: looked up here, on a file system): it holds DCP's ``.metadata``, and
    latest() of it names it again, so the advice to call that would go in a circle: say what loads it."""
    if dcp or (local and os.path.isfile(os.path.join(path, DCP_METADATA))):
        return ConfigError(f"{path} is a checkpoint written by {DCP} (a directory holding {DCP_METADATA}), not a "
                           f"torch.save file: {dcp_how_to_load(path)}")
    return ConfigError(f"{path} is a directory, not a checkpoint file: load a file inside it (a group's files "
                       f"load one at a time), or fastckpt.latest({path!r}) for the newest checkpoint under it")


def not_found(path: str, candidates: list, exc: OSError) -> OSError | ConfigError:
    """CheckpointNotFoundError, unless the bucket is missing, or the key is a prefix holding files
    (a group latest() named): a directory, as on a file system, never "deleted since"."""
    local = "".join(f" (nor its burst-buffer copy {loc.url})" for loc, where in candidates if where == "local")
    home = next(loc for loc, where in candidates if where != "local")
    if not home.target.mounted:  # a store answers 404 to a HEAD in a missing bucket as to a missing key
        try:  # one request; its error names the bucket
            if home.key and (keys := home.target.list(f"{home.key}/", max_depth=0)):
                return a_directory(path, f"{home.key}/{DCP_METADATA}" in keys)
        except BucketNotFoundError as missing:  # a wrong URL, never "nothing saved there yet, start fresh"
            return missing
        except OSError:  # it cannot tell: the key's absence stands
            pass
    said = "" if home.target.mounted else f" The store said: {exc}"
    return CheckpointNotFoundError(
        f"{path} does not exist{local}: it was never saved there, or it was deleted since (retention: "
        "keep_persistent, keep_local; or remove()). A checkpoint latest() named a while ago may be gone: "
        f"fastckpt.latest(<its directory>) names the newest complete one now.{said}")


@contextlib.contextmanager
def lost_in_group(homes: Homes, path: str) -> Iterator[None]:
    """A load of ``path`` that raises ``CheckpointNotFoundError`` or ``CorruptCheckpointError``
    for a file that a published group names raises instead what ``lost_after_commit`` says."""
    try:
        yield
    except (CheckpointNotFoundError, CorruptCheckpointError) as exc:
        lost = lost_after_commit(homes, path, exc)
        if lost is None:
            raise
        for note in getattr(exc, "__notes__", ()):  # what the load said of the other copies (the burst buffer's)
            lost.add_note(note)
        raise lost from exc


def lost_after_commit(homes: Homes, path: str, exc: BaseException) -> BaseException | None:
    """The error for ``path``, missing or damaged (``exc``), when a published group names it: it
    was lost or damaged after the commit. ``fastckpt.latest()`` reads the pointer and manifests,
    not every file (two or three reads however large the group), so it names that group again:
    the advice to call it would send a resume back here. None when no published group names it."""
    try:
        found = naming_group(homes, path, home_group)
    except (OSError, ValueError):  # the manifest cannot be read now: the load's own error stands
        return None
    if found is None:
        return None
    size, parent = found.entry.get("size"), posixpath.dirname(found.dir)
    loc = homes.resolve(path)
    try:
        now: int | None = loc.target.size(loc.key)
        own, damaged = _own_manifest(loc)
        plain = own is None and damaged is None and torch_zip(loc.target, loc.key) is not None
    except FileNotFoundError:
        now, own, damaged, plain = None, None, None, False
    except OSError:
        return None
    if own is not None and (own.get("checksum") or {}).get("value") != found.entry.get("checksum"):
        return None  # another file stands there (moved or copied over it): the load's own error says which
    if plain:
        return None  # a whole plain torch.save file stands there: the load's own error (``load.named``) says so
    if now is None:
        what = (f"does not exist, though the committed group {found.dir} names it ({size} bytes): it was lost after "
                "its commit")
    elif now != size:
        what = (f"holds {now} of the {size} bytes its committed group {found.dir} recorded: it was cut short or "
                "changed after its commit")
    elif damaged is not None:
        what = (f"has a damaged manifest of its own (in its last bytes: {damaged}), though it is the {size} bytes "
                f"its committed group {found.dir} recorded: it changed after its commit")
    else:
        what = (f"is damaged (the error it was raised from says how), though it is the {size} bytes its committed "
                f"group {found.dir} recorded: it changed after its commit")
    cli = "" if now == size else (f"`fastckpt latest {parent}` on the command line passes over a checkpoint with "
                                  "a missing or short file and names the one before it; ")
    cls = type(exc) if isinstance(exc, (CheckpointNotFoundError, CorruptCheckpointError)) else CorruptCheckpointError
    return cls(f"{path} {what}, so the group cannot be loaded whole. latest() still names that group while "
               "it is the newest (it reads the pointer and the manifests, not every file). Restore the file from "
               f"another copy (a replica, the burst buffer of the node that saved it), or resume from the checkpoint "
               f"before it: {cli}moving {found.dir} out of {parent} makes latest({parent!r}) name it too.")


def _own_manifest(loc: Location) -> tuple[dict | None, str | None]:
    """The manifest in the file's own tail (None when it has none), and what is wrong with it
    when it has a damaged one (cut short, or bytes changed: never a plain file, though a
    fastckpt file is a torch.save zip too)."""
    try:
        return loc.target.read_manifest(loc.key), None
    except (CorruptCheckpointError, ValueError) as exc:
        return None, str(exc).removeprefix(f"{loc.url}: ")
