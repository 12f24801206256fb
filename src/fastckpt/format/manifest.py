"""The manifest every fastckpt file carries in its zip comment, and how to find it again.

A fastckpt file is a plain torch.save zip whose archive comment is ``{"fastckpt": manifest}``
(compact JSON): format version, the checksum of every byte before the comment-length field
(``covered``), sizes, rank and group, tier, timings and versions. One rename publishes the
file and its checksum together. A reader needs only the file's last ``TAIL_BYTES``.
"""

from __future__ import annotations

import json
import re
import struct
import time
from collections.abc import Callable, Sequence

from xxhash import xxh3_64_hexdigest

from ..errors import CorruptCheckpointError, UnsupportedObjectError
from ..version import __version__
from .checksum import ALGO, BLOCK_BYTES, combine

FORMAT_VERSION = 1
MANIFEST_KEY = "fastckpt"
_PREFIX = b'{"' + MANIFEST_KEY.encode() + b'":'  # how every fastckpt zip comment starts
EOCD_SIG = b"PK\x05\x06"
EOCD_LEN = 22
LOCAL_SIG = b"PK\x03\x04"  # how every zip (torch.save's, ours) starts
MAX_COMMENT = 0xFFFF
TAIL_BYTES = MAX_COMMENT + EOCD_LEN  # the end-of-central-directory record plus the longest comment
TAIL_ROOM = MAX_COMMENT + 2  # room a file image needs after its covered bytes: length field + comment
#: Block digests listed in a file's manifest at most (16 hex digits each: 48,000 of the zip
#: comment's 65,535 bytes; files up to 46.9 GiB). Larger files list none: readers verify them whole.
MAX_LISTED_BLOCKS = 3000
#: The format of group manifests that carry a ``digest`` (those of format 1 predate it).
GROUP_FORMAT = 2


def file_manifest(*, covered: int, digest: str, rank: int, group_name: str | None, group_rel: str | None,
                  tier: str, payload_bytes: int, blocked_s: float, fastckpt_version: str,
                  blocks: Sequence[int] = (), requested_at: float | None = None) -> dict:
    """The manifest of one file: what a reader verifies and what discovery orders by.

    ``blocks`` (the checksum's block digests, in file order) are listed as one hex string when
    they fit the zip comment, so a reader of part of the file can verify the blocks it reads
    (docs/format.md). ``requested_at``: the wall time of the ``save`` call (``file_order``).
    """
    import torch  # here, not at import: the command line's readers (ls, verify) start without torch

    listed = {"blocks": "".join(f"{b:016x}" for b in blocks)} if 0 < len(blocks) <= MAX_LISTED_BLOCKS else {}
    return {"format": FORMAT_VERSION, "kind": "file", "covered": covered,
            "checksum": {"algo": ALGO, "value": digest, **listed}, "rank": rank,
            "group": group_name, "group_rel": group_rel, "tier": tier, "payload_bytes": payload_bytes,
            "written_at": time.time(), "blocked_s": round(blocked_s, 6),
            "versions": {"fastckpt": fastckpt_version, "torch": torch.__version__},
            **({"requested_at": requested_at} if requested_at is not None else {})}


def file_order(manifest: dict) -> float:
    """When a single file was saved, for ordering (``latest``, its pointer): its ``save`` call,
    else (files saved before it was recorded) the end of its write. Saves overlap (writes to
    several burst-buffer drives at once), so the end of the write does not follow the calls."""
    for key in ("requested_at", "written_at"):
        if _number(v := manifest.get(key)):
            return float(v)
    return 0.0


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def comment_bytes(manifest: dict) -> bytes:
    """The manifest as the zip comment: ``{"fastckpt":M,"sum":D}`` (compact JSON), ``D`` the
    xxh3_64 of ``M``'s bytes. The checksum does not cover the comment (it is in it), so ``sum``
    makes any damage to the manifest corruption, not a changed field."""
    body = json.dumps(manifest, separators=(",", ":"), sort_keys=True).encode()
    data = _PREFIX + body + b',"sum":"' + xxh3_64_hexdigest(body).encode() + b'"}'
    if len(data) > MAX_COMMENT:
        raise UnsupportedObjectError(f"manifest of {len(data)} bytes exceeds the zip comment limit")
    return data


def tail_bytes(manifest: dict) -> bytes:
    """What follows a file's covered bytes: the comment-length field, then the comment."""
    body = comment_bytes(manifest)
    return struct.pack("<H", len(body)) + body


def committed_sizes(manifest: dict) -> tuple[int, int]:
    """The size of the file ``manifest`` was written into (its covered bytes, then ``tail_bytes``),
    and that of one written before the comment carried its ``sum`` (``,"sum":"D"`` shorter): a
    sidecar holds the manifest alone, so the size of the file it publishes follows from it."""
    size = int(manifest["covered"]) + len(tail_bytes(manifest))
    return size, size - len(b',"sum":""') - 16


#: Pieces of every fastckpt manifest: a comment or trailer holding any of them is a fastckpt
#: file, and must parse as one, or it is corrupt (never a plain zip to load unverified).
_MARKERS = (_PREFIX, b'"' + ALGO.encode() + b'"', b'"covered":')


def _carries_manifest(data: bytes) -> bool:
    return any(m in data for m in _MARKERS)


_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX_BLOCKS = re.compile(r"(?:[0-9a-f]{16})*")


def check_manifest(manifest: object) -> dict:
    """``manifest`` if it has the shape every reader relies on, else the damage it shows.

    The manifest is not covered by the checksum (it holds it), so one damaged byte can turn a
    key (``"checksum"`` into ``"checksul"``) or a value into something else and still parse:
    what readers index (``covered``, ``checksum.value``, the listed ``blocks``, ``group``,
    ``group_rel``) is checked here, where a manifest is parsed, so that damage is corruption
    and never a ``KeyError`` further on.

    Raises:
        CorruptCheckpointError: what is missing or malformed.
    """
    if not isinstance(manifest, dict):
        raise CorruptCheckpointError(f"it is a {type(manifest).__name__}, not an object")
    covered, digest = manifest.get("covered"), manifest.get("checksum")
    if not isinstance(covered, int) or isinstance(covered, bool) or covered < 0:
        raise CorruptCheckpointError(f"its covered byte count is {covered!r}")
    if not isinstance(digest, dict) or digest.get("algo") != ALGO or not isinstance(digest.get("value"), str) \
            or not _HEX16.fullmatch(digest["value"]):
        raise CorruptCheckpointError(f"its checksum is {digest!r:.200}, not a {ALGO} checksum")
    blocks = digest.get("blocks")
    if blocks is not None and (not isinstance(blocks, str) or not _HEX_BLOCKS.fullmatch(blocks)
                               or len(blocks) // 16 != -(-covered // BLOCK_BYTES)):
        raise CorruptCheckpointError(f"its block digests do not list the {-(-covered // BLOCK_BYTES)} "
                                     "blocks of its covered bytes")
    for key in ("group", "group_rel"):
        if not isinstance(manifest.get(key), (str, type(None))):
            raise CorruptCheckpointError(f"its {key} is {manifest[key]!r:.100}")
    if manifest.get("format") != FORMAT_VERSION or manifest.get("kind") != "file":
        raise CorruptCheckpointError(f"its format is {manifest.get('format')!r:.20} and its kind "
                                     f"{manifest.get('kind')!r:.20}, not {FORMAT_VERSION} and 'file'"
                                     + _later(manifest, FORMAT_VERSION))
    listed_blocks(manifest)
    return manifest


def _later(manifest: dict, known: int) -> str:
    """For a manifest whose format is a number after ``known``: that a newer fastckpt may have
    written it (told, not decided: a damaged digit reads the same), and what to do either way."""
    fmt = manifest.get("format")
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt <= known:
        return ""
    versions = manifest.get("versions")
    by = versions.get("fastckpt") if isinstance(versions, dict) else None
    by = f" (it names fastckpt {by:.40})" if isinstance(by, str) else ""
    return (f". A newer fastckpt may have written it{by}: this is fastckpt {__version__}, which reads format "
            f"{known} and older. If so, upgrade fastckpt where this runs to read it: until then latest() passes over "
            "it as over a damaged checkpoint, and a resume takes the one before")


def with_digest(manifest: dict) -> dict:
    """A group manifest with its ``digest``: the xxh3_64 of the rest as compact JSON. Damage that
    still parses (a digit of a file's checksum) is then corruption, not a manifest naming files
    of another attempt. Its values as JSON gives them back (keys as strings), so that the digest
    is the one a reader computes."""
    body = json.loads(json.dumps({**{k: v for k, v in manifest.items() if k != "digest"}, "format": GROUP_FORMAT}))
    return {**body, "digest": _group_digest(body)}


def _group_digest(body: dict) -> str:
    return xxh3_64_hexdigest(json.dumps({k: v for k, v in body.items() if k != "digest"}, sort_keys=True,
                                        separators=(",", ":")).encode())


def check_group_manifest(manifest: object) -> dict:
    """``manifest`` (a group's ``fastckpt-manifest.json``, parsed) if it has the shape readers
    rely on (``files``: each entry's ``checksum`` and ``size``; the times they order by, the
    world size), else the damage it shows: valid JSON of another shape is damage too, never an
    ``AttributeError`` in a reader.

    Raises:
        CorruptCheckpointError: what is missing or malformed.
    """
    if not isinstance(manifest, dict):
        raise CorruptCheckpointError(f"it is a {type(manifest).__name__}, not an object")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CorruptCheckpointError(f"its files are {files!r:.100}, not an object naming each file")
    for rel, info in files.items():
        if not isinstance(info, dict) or not isinstance(info.get("checksum"), str) \
                or not isinstance(info.get("size"), int) or isinstance(info.get("size"), bool) \
                or info["size"] < 0:
            raise CorruptCheckpointError(f"its entry for {rel!r:.100} is {info!r:.100}, not a size and checksum")
    if manifest.get("format", 1) not in (1, GROUP_FORMAT):
        raise CorruptCheckpointError(f"its format is {manifest.get('format')!r:.20}, not 1 or {GROUP_FORMAT}"
                                     + _later(manifest, GROUP_FORMAT))
    if "digest" not in manifest and manifest.get("format", 1) == GROUP_FORMAT:
        raise CorruptCheckpointError(f"its digest is missing, which every manifest of format {GROUP_FORMAT} has: it "
                                     "was damaged after it was written")
    if "digest" in manifest and manifest["digest"] != _group_digest(manifest):
        raise CorruptCheckpointError("its content does not match its digest: it was damaged after it was written")
    for key, ok in (("requested_at", _number), ("committed_at", _number),
                    ("world_size", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0)):
        if key in manifest and not ok(manifest[key]):
            raise CorruptCheckpointError(f"its {key} is {manifest[key]!r:.100}")
    return manifest


def listed_blocks(manifest: dict) -> list[int] | None:
    """The block digests a (checked) manifest lists, in file order; None when it lists none
    (a file over 46.9 GiB, ``MAX_LISTED_BLOCKS``).

    Raises:
        CorruptCheckpointError: they do not combine to the manifest's checksum (damaged).
    """
    listed = manifest["checksum"].get("blocks")
    if listed is None:
        return None
    digests = [int(listed[i : i + 16], 16) for i in range(0, len(listed), 16)]
    if combine(digests) != manifest["checksum"]["value"]:
        raise CorruptCheckpointError("the block digests in the manifest do not make up its checksum")
    return digests


def parse_tail(tail: bytes, file_size: int, head: Callable[[], bytes] | None = None) -> dict | None:
    """Find the fastckpt manifest in the last bytes of a file; None for a foreign zip.

    A file whose comment (or, with a damaged end-of-directory record, whose last bytes) shows
    any piece of a fastckpt manifest is a fastckpt file: one damaged byte must not turn off its
    verification by making it look like a plain torch.save file. Those last bytes count only in a
    file that starts as a zip does (``head`` reads its first 4 bytes when ``tail`` does not hold
    them): a text file quoting a manifest (a page of these docs) or a tar of a checkpoint is none.

    Raises:
        CorruptCheckpointError: a manifest is there but damaged: it does not parse, or lacks
            what readers need (``check_manifest``).
    """
    idx, off = tail.rfind(EOCD_SIG), None
    while idx >= 0:
        if idx + EOCD_LEN <= len(tail):
            (n,) = struct.unpack_from("<H", tail, idx + 20)
            if idx + EOCD_LEN + n == len(tail):
                comment = tail[idx + EOCD_LEN :]
                if comment.startswith(_PREFIX):
                    return _parsed(comment)
                if _carries_manifest(comment):
                    raise CorruptCheckpointError("the zip comment holds a damaged fastckpt manifest")
                if comment and not _text(comment) and _record(tail, idx, file_size):  # torch.save writes none
                    raise CorruptCheckpointError(f"its zip comment of {n} bytes is not text ({comment[:16]!r}...): "
                                                 "a fastckpt manifest that was overwritten")
                return None
            if off is None and _record(tail, idx, file_size):
                off = idx + EOCD_LEN + n - len(tail)
        idx = tail.rfind(EOCD_SIG, 0, idx)
    if (off is not None or _carries_manifest(tail)) and not _starts_as_zip(tail, file_size, head):
        return None  # no zip: a text file quoting a manifest, a tar holding a checkpoint
    if _carries_manifest(tail):
        raise CorruptCheckpointError("the zip trailer holding the fastckpt manifest is damaged")
    if off is not None:  # a real end record whose comment does not end where the file does
        raise CorruptCheckpointError(f"its end-of-directory record announces a zip comment {abs(off)} bytes "
                                     f"{'longer' if off > 0 else 'shorter'} than what follows it: the file was cut "
                                     "short, or its trailer is damaged")
    return None


def _starts_as_zip(tail: bytes, file_size: int, head: Callable[[], bytes] | None) -> bool:
    """Whether the file ``tail`` ends starts with a zip's first record (taken to, with no ``head``)."""
    if len(tail) >= file_size:
        return tail.startswith(LOCAL_SIG)
    return head is None or bytes(head()[:4]) == LOCAL_SIG


def _record(tail: bytes, idx: int, file_size: int) -> bool:
    """Whether the signature at ``tail[idx]`` starts a real end-of-directory record, not bytes of
    data that match it by chance: the central directory it names ends right before it, or a
    zip64 locator does (then its own fields may be 0xFFFFFFFF)."""
    size, offset = struct.unpack_from("<II", tail, idx + 12)
    return offset + size == file_size - len(tail) + idx or tail[max(0, idx - 20) : idx - 16] == b"PK\x06\x07"


def _text(data: bytes) -> bool:
    try:
        return all(c.isprintable() or c in "\t\n\r" for c in data.decode())
    except UnicodeDecodeError:
        return False


_SUM = re.compile(rb',"sum":"([0-9a-f]{16})"\}\Z')


def _parsed(comment: bytes) -> dict:
    """The manifest in a zip comment that starts as a fastckpt one (``parse_tail``); its ``sum``
    is checked (files written before there was one have none: then the comment holds only the
    manifest)."""
    if (m := _SUM.search(comment)) is not None \
            and xxh3_64_hexdigest(comment[len(_PREFIX) : m.start()]) != m.group(1).decode():
        raise CorruptCheckpointError("the manifest's bytes do not match its sum: damaged")
    try:
        whole = json.loads(comment)
        manifest = whole[MANIFEST_KEY]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"manifest in the zip comment does not parse: {exc}") from exc
    if set(whole) != ({MANIFEST_KEY, "sum"} if m is not None else {MANIFEST_KEY}):
        raise CorruptCheckpointError(f"the zip comment holds {sorted(whole)!r:.100} besides the manifest: damaged")
    try:
        return check_manifest(manifest)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"the manifest in the zip comment is damaged: {exc}") from exc


def manifest_in(tail: bytes, size: int, where: str, head: Callable[[], bytes] | None = None) -> dict | None:
    """The manifest in a file's last bytes (``tail``, of a ``size``-byte file at ``where``),
    checked for a covered range that fits the file; None for a plain zip.

    Raises:
        CorruptCheckpointError: naming ``where``: the trailer or the manifest is damaged.
    """
    try:
        manifest = parse_tail(tail, size, head)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from exc
    if manifest is not None and manifest["covered"] > size:
        raise CorruptCheckpointError(f"{where}: its manifest covers {manifest['covered']} bytes of a {size}-byte file")
    return manifest
