"""A fastckpt tag that DeepSpeed's own engine saved again in place.

A run with ``"fastckpt": {"enabled": false}`` (or plain ``deepspeed.initialize``) that saves a
tag fastckpt committed before (a fixed tag such as ``last``) writes its files over the tag's with
``torch.save``, and leaves the tag's fastckpt manifest, which names files that are gone. The
loader then refuses every file as a plain file written over a committed one, and its advice
(restore the file, or load an earlier checkpoint) would lose the newest training, which those
files hold.

The tag is named as such, with the fix, not loaded as DeepSpeed's own automatically: the signs
below (every file the manifest names rewritten after it, each a whole zip without a fastckpt
manifest) also fit a tool that rewrote every file, or a copy that dropped the manifests, and
fastckpt cannot verify any of those bytes; the user, who knows which run saved it, decides.
"""

from __future__ import annotations

import json
import os
import zipfile

from fastckpt.commit.names import GROUP_MANIFEST, MARKER_DIR
from fastckpt.errors import CorruptCheckpointError
from fastckpt.format.manifest import TAIL_BYTES, manifest_in


def resaved_in_place(group: str) -> bool:
    """Every file the published manifest of the tag directory ``group`` names is there, was
    written after that manifest, and is a whole zip without a fastckpt manifest of its own (a
    damaged one counts as fastckpt's: a damaged fastckpt file, not a re-save)."""
    try:
        published = os.stat(os.path.join(group, GROUP_MANIFEST)).st_mtime_ns
        with open(os.path.join(group, GROUP_MANIFEST), "rb") as f:
            files = sorted(json.load(f).get("files") or {})
        return bool(files) and all(_rewritten(os.path.join(group, *rel.split("/")), published) for rel in files)
    except (OSError, ValueError, AttributeError):  # (a manifest that is no JSON object: the loader names it)
        return False


def _rewritten(path: str, published_ns: int) -> bool:
    if os.stat(path).st_mtime_ns < published_ns or not zipfile.is_zipfile(path):
        return False
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(max(0, size - TAIL_BYTES))
        tail = f.read()

        def head() -> bytes:
            f.seek(0)
            return f.read(4)

        try:
            return manifest_in(tail, size, path, head) is None
        except CorruptCheckpointError:
            return False


def resaved_error(home: str, group: str) -> CorruptCheckpointError:
    """The error naming the tag ``group`` under ``home`` as DeepSpeed's own re-save, and the fix."""
    return CorruptCheckpointError(
        f"checkpoint {group} was saved again in place by DeepSpeed's own engine after fastckpt committed it (a run "
        "with \"fastckpt\": {\"enabled\": false}, or plain deepspeed.initialize, saving the same tag): every file of "
        "the tag was rewritten since fastckpt's commit and none carries fastckpt's manifest, so fastckpt cannot "
        f"verify them against the tag's {GROUP_MANIFEST}, which names the files of the earlier save. Those files hold "
        "the later save's training: to load them as DeepSpeed's own checkpoint, unverified, remove "
        f"{os.path.join(group, GROUP_MANIFEST)} and {os.path.join(group, MARKER_DIR)} (both: with its markers left, "
        f"load_checkpoint({home!r}) takes the tag for a fastckpt save under way and passes over it), then load again. "
        f"Or load another tag: load_checkpoint({home!r}, tag=...)")
