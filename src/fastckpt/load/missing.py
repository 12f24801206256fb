"""What a load that found no file says: a directory (a group) is named as one, a missing bucket
as a wrong URL, and only a key that is truly absent is ``CheckpointNotFoundError``, which resume
code may take for "nothing saved there: start fresh"."""

from __future__ import annotations

import os

from ..commit.discovery import DCP_METADATA
from ..commit.foreign import DCP, dcp_how_to_load
from ..errors import CheckpointNotFoundError, ConfigError
from ..storage.types import BucketNotFoundError


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
