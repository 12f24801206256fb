"""The system-call seam. Every byte fastckpt writes or reads goes through a FileOps.

Tests substitute a fault-injecting FileOps (``fastckpt.testing.FaultyOps``) to prove that
ENOSPC, EIO, short writes, fsync failures and failed renames never damage a checkpoint.
Methods are called from the training thread (commit, rename) and from I/O worker threads
(pwrite, pread, fsync); implementations must be thread-safe.
"""

from __future__ import annotations

import os


class FileOps:
    """Thin wrapper over the POSIX calls fastckpt uses (the default implementation)."""

    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        return os.open(path, flags, mode)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def preadv(self, fd: int, buf: memoryview, offset: int) -> int:
        return os.preadv(fd, [buf], offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def close(self, fd: int) -> None:
        os.close(fd)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_small(self, path: str, data: bytes) -> None:
        """Write a small file completely and fsync it (manifests, markers, pointers)."""
        fd = self.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            view = memoryview(data)
            off = 0
            while off < len(view):
                n = self.pwrite(fd, view[off:], off)
                if n <= 0:
                    raise OSError(5, f"short write ({n} bytes) to {path}")
                off += n
            self.fsync(fd)
        finally:
            self.close(fd)


PosixOps = FileOps
