"""The core internals the CLI uses, imported here and nowhere else under ``cli/``.

The core's modules are being regrouped into layers; when one moves, re-point its import here
and the subcommands keep working. Everything else the CLI needs comes from the stable public
names (``fastckpt``, ``fastckpt.errors``, ``fastckpt.events``, ``fastckpt.io.ops``,
``fastckpt.io.engine``).
"""

from __future__ import annotations

from ..commit import (  # discovery and the on-disk protocol's names
    GROUP_MANIFEST,
    LATEST,
    MARKER_DIR,
    SIDECAR,
    TAIL_BYTES,
    Found,
    is_tmp,
    read_file_manifest,
    read_group_manifest,
    scan,
)
from ..format import parse_tail  # a manifest from a file's last bytes (remote files)
from ..io.engine import checksum_file  # bounded-memory checksum of [0, covered)
from ..places import is_url, mirror_path, normalize
from ..remote import scan_remote
from ..replicate import TargetCache  # one Target per bucket
from ..targets import TargetNotFoundError
from ..tiers import gds_unavailable_reason

__all__ = [
    "GROUP_MANIFEST", "LATEST", "MARKER_DIR", "SIDECAR", "TAIL_BYTES", "Found", "is_tmp", "read_file_manifest",
    "read_group_manifest", "scan", "parse_tail", "checksum_file", "is_url", "mirror_path", "normalize",
    "scan_remote", "TargetCache", "TargetNotFoundError", "gds_unavailable_reason",
]
