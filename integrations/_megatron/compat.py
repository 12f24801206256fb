"""The core internals the Megatron integration uses, imported here and nowhere else.

Everything else comes from fastckpt's stable names. When the core's modules move, re-point
these imports and nothing more.
"""

from __future__ import annotations

from fastckpt.commit import protocol as _protocol
from fastckpt.commit.names import FRAMEWORK_FILES, framework_files
from fastckpt.commit.order import group_order, holds
from fastckpt.commit.protocol import GROUP_MANIFEST
from fastckpt.errors import IncompleteCheckpointError
from fastckpt.exits import after_flush
from fastckpt.format.checksum import BLOCK_BYTES, block_digest, checksum_bytes, combine
from fastckpt.format.manifest import parse_tail
from fastckpt.io.atomic import publish_bytes, sweep_once
from fastckpt.storage.homes import Homes
from fastckpt.urls import is_url, normalize


def read_group_manifest(group: str) -> dict | None:
    """The group manifest of the directory ``group``, None when it is not published."""
    return _protocol.read_group_manifest(Homes().resolve(group).place())


def latest_name(directory: str) -> str | None:
    """What ``directory/latest`` (fastckpt's pointer, moved by every commit of a group in it)
    names, if that is a complete checkpoint."""
    return _protocol.pointed_name(Homes().resolve(directory).place())


def incomplete_group_error(group: str, world_size: int | None) -> IncompleteCheckpointError:
    """The error that names what a never-published group is missing."""
    return _protocol.incomplete_group_error(Homes().resolve(group).place(), world_size)


__all__ = [
    "BLOCK_BYTES", "FRAMEWORK_FILES", "GROUP_MANIFEST", "after_flush", "block_digest", "checksum_bytes", "combine",
    "framework_files", "group_order", "holds", "incomplete_group_error", "is_url", "latest_name", "normalize",
    "parse_tail", "publish_bytes", "read_group_manifest", "sweep_once",
]
