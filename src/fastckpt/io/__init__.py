"""The IO engine: aligned, chunked, parallel file writes and reads (and the GDS path)."""

from .ops import FileOps, PosixOps
from .engine import ReadResult, WriteResult, read_file, write_file

__all__ = ["FileOps", "PosixOps", "ReadResult", "WriteResult", "read_file", "write_file"]
