"""The checksum every fastckpt file carries.

xxh3_64 over fixed 16 MiB blocks of the file, then xxh3_64 of the concatenated 8-byte
little-endian block digests. Blocks hash independently, so writers and readers hash in the
same worker threads that move the bytes (xxhash releases the GIL), and the result does not
depend on how the I/O was chunked, only on the bytes.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

ALGO = "xxh3_64-tree-16MiB"
BLOCK_BYTES = 16 << 20


def block_digest(block: memoryview | bytes) -> int:
    """Digest of one block (at most BLOCK_BYTES, the last block of a file may be shorter)."""
    return xxhash.xxh3_64_intdigest(block)


def combine(block_digests: Iterable[int]) -> str:
    """File checksum from the block digests, in file order, as 16 hex digits."""
    joined = b"".join(d.to_bytes(8, "little") for d in block_digests)
    return xxhash.xxh3_64_hexdigest(joined)


def checksum_bytes(data: memoryview | bytes) -> str:
    """Checksum of a whole in-memory file image."""
    mv = memoryview(data).cast("B")
    return combine(block_digest(mv[off : off + BLOCK_BYTES]) for off in range(0, len(mv), BLOCK_BYTES))


def file_checksum(blocks: Iterable[memoryview | bytes]) -> str:
    """Checksum from an iterator of consecutive BLOCK_BYTES blocks (the last may be shorter)."""
    return combine(block_digest(b) for b in blocks)
