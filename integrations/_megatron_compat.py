"""The core internals the Megatron integration uses, imported here and nowhere else.

Everything else comes from fastckpt's stable names. When the core's modules move, re-point
these imports and nothing more.
"""

from __future__ import annotations

from fastckpt.checksum import BLOCK_BYTES, block_digest, combine
from fastckpt.commit import GROUP_MANIFEST, incomplete_group_error, publish_bytes, read_group_manifest
from fastckpt.format import parse_tail
from fastckpt.places import is_url, normalize

__all__ = [
    "BLOCK_BYTES", "GROUP_MANIFEST", "block_digest", "combine", "incomplete_group_error", "is_url", "normalize",
    "parse_tail", "publish_bytes", "read_group_manifest",
]
