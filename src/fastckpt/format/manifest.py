"""The manifest every fastckpt file carries in its zip comment, and how to find it again.

A fastckpt file is a plain torch.save zip whose archive comment is ``{"fastckpt": manifest}``
(compact JSON): format version, the checksum of every byte before the comment-length field
(``covered``), sizes, rank and group, tier, timings and versions. One rename publishes the
file and its checksum together. A reader needs only the file's last ``TAIL_BYTES``.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Sequence

from ..errors import CorruptCheckpointError, UnsupportedObjectError
from .checksum import ALGO

FORMAT_VERSION = 1
MANIFEST_KEY = "fastckpt"
EOCD_SIG = b"PK\x05\x06"
EOCD_LEN = 22
MAX_COMMENT = 0xFFFF
TAIL_BYTES = MAX_COMMENT + EOCD_LEN  # the end-of-central-directory record plus the longest comment
TAIL_ROOM = MAX_COMMENT + 2  # room a file image needs after its covered bytes: length field + comment
#: Block digests listed in a file's manifest at most (16 hex digits each: 48,000 of the zip
#: comment's 65,535 bytes; files up to 46.9 GiB). Larger files list none: readers verify them whole.
MAX_LISTED_BLOCKS = 3000


def file_manifest(*, covered: int, digest: str, rank: int, group_name: str | None, group_rel: str | None,
                  tier: str, payload_bytes: int, blocked_s: float, fastckpt_version: str,
                  blocks: Sequence[int] = ()) -> dict:
    """The manifest of one file: what a reader verifies and what discovery orders by.

    ``blocks`` (the checksum's block digests, in file order) are listed as one hex string when
    they fit the zip comment, so a reader of part of the file can verify the blocks it reads
    (docs/format.md).
    """
    import torch  # here, not at import: the command line's readers (ls, verify) start without torch

    listed = {"blocks": "".join(f"{b:016x}" for b in blocks)} if 0 < len(blocks) <= MAX_LISTED_BLOCKS else {}
    return {"format": FORMAT_VERSION, "kind": "file", "covered": covered,
            "checksum": {"algo": ALGO, "value": digest, **listed}, "rank": rank,
            "group": group_name, "group_rel": group_rel, "tier": tier, "payload_bytes": payload_bytes,
            "written_at": time.time(), "blocked_s": round(blocked_s, 6),
            "versions": {"fastckpt": fastckpt_version, "torch": torch.__version__}}


def comment_bytes(manifest: dict) -> bytes:
    """The manifest as the zip comment (``{"fastckpt": manifest}`` in compact JSON)."""
    data = json.dumps({MANIFEST_KEY: manifest}, separators=(",", ":"), sort_keys=True).encode()
    if len(data) > MAX_COMMENT:
        raise UnsupportedObjectError(f"manifest of {len(data)} bytes exceeds the zip comment limit")
    return data


def tail_bytes(manifest: dict) -> bytes:
    """What follows a file's covered bytes: the comment-length field, then the comment."""
    body = comment_bytes(manifest)
    return struct.pack("<H", len(body)) + body


#: Pieces of every fastckpt manifest: a comment or trailer holding any of them is a fastckpt
#: file, and must parse as one, or it is corrupt (never a plain zip to load unverified).
_MARKERS = (b'{"' + MANIFEST_KEY.encode() + b'":', b'"' + ALGO.encode() + b'"', b'"covered":')


def _carries_manifest(data: bytes) -> bool:
    return any(m in data for m in _MARKERS)


def parse_tail(tail: bytes, file_size: int) -> dict | None:
    """Find the fastckpt manifest in the last bytes of a file; None for a foreign zip.

    A file whose comment (or, with a damaged end-of-directory record, whose last bytes) shows
    any piece of a fastckpt manifest is a fastckpt file: one damaged byte must not turn off its
    verification by making it look like a plain torch.save file.

    Raises:
        CorruptCheckpointError: a manifest is there but damaged, or does not parse.
    """
    idx = tail.rfind(EOCD_SIG)
    while idx >= 0:
        if idx + EOCD_LEN <= len(tail):
            (n,) = struct.unpack_from("<H", tail, idx + 20)
            if idx + EOCD_LEN + n == len(tail):
                comment = tail[idx + EOCD_LEN :]
                if comment.startswith(b'{"' + MANIFEST_KEY.encode() + b'":'):
                    try:
                        return json.loads(comment)[MANIFEST_KEY]
                    except (ValueError, KeyError) as exc:
                        raise CorruptCheckpointError(f"manifest in the zip comment does not parse: {exc}") from exc
                if _carries_manifest(comment):
                    raise CorruptCheckpointError("the zip comment holds a damaged fastckpt manifest")
                return None
        idx = tail.rfind(EOCD_SIG, 0, idx)
    if _carries_manifest(tail):
        raise CorruptCheckpointError("the zip trailer holding the fastckpt manifest is damaged")
    return None


def manifest_in(tail: bytes, size: int, where: str) -> dict | None:
    """The manifest in a file's last bytes (``tail``, of a ``size``-byte file at ``where``),
    checked for a covered range that fits the file; None for a plain zip.

    Raises:
        CorruptCheckpointError: naming ``where``: the trailer or the manifest is damaged.
    """
    try:
        manifest = parse_tail(tail, size)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from exc
    covered = manifest.get("covered") if manifest is not None else None
    if manifest is not None and (not isinstance(covered, int) or not 0 <= covered <= size):
        raise CorruptCheckpointError(f"{where}: its manifest covers {covered!r} bytes of a {size}-byte file")
    return manifest
