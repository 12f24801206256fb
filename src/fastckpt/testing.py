"""Fault injection for tests: a FileOps that fails chosen system calls, and gates that pause them.

Pass a ``FaultyOps`` to ``Checkpointer(ops=...)`` to prove that a failure at any step of a save
(ENOSPC, EIO, short writes, permission denied, failed fsync/rename) surfaces once and never
damages the previous checkpoint::

    ops = FaultyOps()
    with Checkpointer(ops=ops) as ck:
        ck.save(state_v1, path).wait()
        ops.inject(Fault("pwrite", errno.ENOSPC))
        with pytest.raises(CheckpointWriteError):
            ck.save(state_v2, path).wait()
    ops.assert_all_reached()      # every configured fault really fired

Counting: each ``Fault`` counts the calls of its ``op`` whose path matches, from the moment it
was configured, and fires on the ``nth`` one, once. ``write_small`` (manifests, markers,
pointers) is itself built from ``open``/``pwrite``/``fsync``, so those calls count for faults on
those ops too. ``fsync``, ``pwrite``, ``preadv``, ``ftruncate`` and ``map_private`` match against the path their
descriptor was opened with; ``replace`` matches if either its source or its destination does. A
temp file (``io.atomic.tmp_name``) matches as the path it becomes, too.

Pausing: ``gate(op, ...)`` returns a ``Gate`` that holds every matching call (on whatever thread
makes it) until ``Gate.open()``; ``Gate.wait_entered()`` lets a test know a call reached it. An
``on_call(op, path)`` callback sees every call before it runs. Both are for deterministic tests
of concurrency (``when_busy``, mutation after save), never ``time.sleep``.

All methods are thread-safe: pwrite, preadv and fsync run on I/O worker threads.

Killing: ``as_if_killed(ck)`` takes a Checkpointer's process as dead while the test goes on in
this one, so that a new Checkpointer of the same rank (the restarted process) may save into the
groups the old one left open (docs/groups.md: one Checkpointer per group and rank in a process).
"""

from __future__ import annotations

import errno as _errno
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .commit import owners
from .io.atomic import final_path
from .io.ops import FileOps, Residency

__all__ = ["Fault", "FaultyOps", "Gate", "OPS", "as_if_killed"]

OPS = ("open", "pwrite", "preadv", "fsync", "ftruncate", "replace", "unlink", "rmdir", "fsync_dir", "makedirs",
       "write_small", "exchange", "link", "map_private", "utime",
       "scandir")


def as_if_killed(checkpointer: object) -> None:
    """``checkpointer`` (left open, as a killed process leaves it) no longer holds the groups it
    began: a new Checkpointer of the same rank in this process may save into them (``commit/owners.py``)."""
    owners.release(checkpointer._coordinator)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Fault:
    """Fail the ``nth`` call of ``op`` whose path matches.

    Args:
        op: one of ``OPS``.
        error: the errno to raise (``errno.ENOSPC``...). None only together with ``short``.
        nth: which matching call fails (1 = the first one after the fault was configured).
        path_contains: only calls whose path contains this string count (None: every call).
        path_startswith: only calls whose path starts with this string count (None: every
            call). Useful to tell a burst-buffer copy (whose path contains the final path)
            from the final file.
        short: pwrite only: write just the first ``short`` bytes once and return that count
            (a short write that makes progress); 0 writes nothing and returns 0 (no progress).
    """

    op: str
    error: int | None = None
    nth: int = 1
    path_contains: str | None = None
    path_startswith: str | None = None
    short: int | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"Fault op={self.op!r} is not one of {', '.join(OPS)}")
        if (self.error is None) == (self.short is None):
            raise ValueError(f"Fault({self.op!r}) needs exactly one of error=<errno> or short=<bytes>")
        if self.short is not None and (self.op != "pwrite" or self.short < 0):
            raise ValueError("short=<bytes >= 0> applies to op='pwrite' only")
        if self.nth < 1:
            raise ValueError(f"Fault nth={self.nth} must be >= 1 (1 = the first matching call)")

    def matches(self, op: str, paths: tuple[str, ...]) -> bool:
        if op != self.op:
            return False
        return any((self.path_contains is None or self.path_contains in p)
                   and (self.path_startswith is None or p.startswith(self.path_startswith)) for p in paths)

    def describe(self) -> str:
        what = f"error={_errno.errorcode.get(self.error, self.error)}" if self.error is not None \
            else f"short={self.short}"
        where = "".join(f", {k}={v!r}" for k, v in (("path_contains", self.path_contains),
                                                    ("path_startswith", self.path_startswith)) if v)
        return f"Fault({self.op!r}, {what}, nth={self.nth}{where})"


class Gate:
    """Holds every matching call until ``open()``; created by ``FaultyOps.gate``."""

    def __init__(self, op: str, path_contains: str | None) -> None:
        self.op = op
        self.path_contains = path_contains
        self._entered = threading.Event()
        self._open = threading.Event()

    def _maybe_hold(self, op: str, paths: tuple[str, ...]) -> None:
        if op != self.op or self._open.is_set():
            return
        if self.path_contains is not None and not any(self.path_contains in p for p in paths):
            return
        self._entered.set()
        if not self._open.wait(timeout=120):  # a test that forgot to open the gate must not hang CI
            raise TimeoutError(f"gate on {self.op!r} was never opened")

    def wait_entered(self, timeout: float = 30.0) -> bool:
        """True once some call has reached the gate (False after ``timeout`` seconds)."""
        return self._entered.wait(timeout)

    def open(self) -> None:
        """Release held calls; later calls pass straight through."""
        self._open.set()


class FaultyOps(FileOps):
    """A FileOps that injects configured faults (see the module docstring).

    Args:
        faults: faults active from the start (more can be added with ``inject``).
        on_call: called as ``on_call(op, path)`` before every call, on the calling thread.
    """

    def __init__(self, faults: list[Fault] | tuple[Fault, ...] = (),
                 on_call: Callable[[str, str], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._counts: list[int] = []
        self._fired: list[tuple[Fault, str]] = []
        self._fd_paths: dict[int, str] = {}
        self._gates: list[Gate] = []
        self._calls: dict[str, int] = dict.fromkeys(OPS, 0)
        self.on_call = on_call
        self.inject(*faults)

    # ------------------------------------------------------------------ configuration
    def inject(self, *faults: Fault) -> None:
        """Add faults; each counts matching calls from now on."""
        for f in faults:
            if not isinstance(f, Fault):
                raise TypeError(f"expected Fault, got {type(f).__name__}")
        with self._lock:
            self._faults.extend(faults)
            self._counts.extend(0 for _ in faults)

    def gate(self, op: str, path_contains: str | None = None) -> Gate:
        """Pause every call of ``op`` (matching ``path_contains``) until the gate is opened."""
        if op not in OPS:
            raise ValueError(f"gate op={op!r} is not one of {', '.join(OPS)}")
        g = Gate(op, path_contains)
        with self._lock:
            self._gates.append(g)
        return g

    @property
    def fired(self) -> list[tuple[Fault, str]]:
        """The faults that fired so far, with the path of the call each one failed."""
        with self._lock:
            return list(self._fired)

    def calls(self, op: str) -> int:
        """How many calls of ``op`` were made (all paths)."""
        with self._lock:
            return self._calls[op]

    def assert_all_reached(self) -> None:
        """Raise AssertionError naming every configured fault that never fired."""
        with self._lock:
            fired = {id(f) for f, _ in self._fired}
            missed = [f.describe() for f in self._faults if id(f) not in fired]
        if missed:
            raise AssertionError(f"{len(missed)} injected fault(s) never reached: {'; '.join(missed)}")

    # ------------------------------------------------------------------ the hook
    def _check(self, op: str, *paths: str) -> Fault | None:
        """Count this call, run the hooks, and return the fault that fires on it (if any)."""
        hit: Fault | None = None
        paths += tuple(p for p in map(final_path, paths) if p is not None)  # a temp file matches as its name too
        with self._lock:
            self._calls[op] += 1
            for i, f in enumerate(self._faults):
                if not f.matches(op, paths):
                    continue
                self._counts[i] += 1
                if self._counts[i] == f.nth and hit is None:
                    hit = f
                    self._fired.append((f, paths[0] if paths else ""))
                elif self._counts[i] == f.nth:
                    self._counts[i] -= 1  # another fault fires on this call; this one waits its turn
            gates = list(self._gates)
        if self.on_call is not None:
            self.on_call(op, paths[0] if paths else "")
        for g in gates:
            g._maybe_hold(op, paths)
        return hit

    @staticmethod
    def _raise(fault: Fault, path: str) -> None:
        assert fault.error is not None  # noqa: S101 (Fault validates error xor short)
        raise OSError(fault.error, f"{os.strerror(fault.error)} (injected by {fault.describe()})", path)

    def _path_of(self, fd: int) -> str:
        with self._lock:
            return self._fd_paths.get(fd, f"<fd {fd}>")

    def _guard(self, op: str, *paths: str) -> Fault | None:
        """Count the call; raise its fault's error, or return a short-write fault to apply."""
        fault = self._check(op, *paths)
        if fault is not None and fault.short is None:
            self._raise(fault, paths[-1] if op == "replace" else paths[0])
        return fault

    # ------------------------------------------------------------------ FileOps
    def open(self, path: str, flags: int, mode: int = 0o644) -> int:
        self._guard("open", path)
        fd = super().open(path, flags, mode)
        with self._lock:
            self._fd_paths[fd] = path
        return fd

    def close(self, fd: int) -> None:
        with self._lock:
            self._fd_paths.pop(fd, None)
        super().close(fd)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        fault = self._guard("pwrite", self._path_of(fd))
        if fault is not None and fault.short is not None:
            if fault.short == 0:
                return 0
            return super().pwrite(fd, memoryview(data)[: min(fault.short, len(data))], offset)
        return super().pwrite(fd, data, offset)

    def preadv(self, fd: int, buf: memoryview | list[memoryview], offset: int) -> int:
        self._guard("preadv", self._path_of(fd))
        return super().preadv(fd, buf, offset)

    def preadv_cached(self, fd: int, buf: memoryview, offset: int, residency: Residency | None = None) -> int:
        self._guard("preadv", self._path_of(fd))
        return super().preadv_cached(fd, buf, offset, residency)

    def map_private(self, fd: int, size: int):  # noqa: ANN201 (an mmap.mmap)
        self._guard("map_private", self._path_of(fd))
        return super().map_private(fd, size)

    def reopen(self, fd: int, flags: int) -> int:
        new = super().reopen(fd, flags)
        with self._lock:
            self._fd_paths[new] = self._fd_paths.get(fd, f"<fd {fd}>")
        return new

    def fsync(self, fd: int) -> None:
        self._guard("fsync", self._path_of(fd))
        super().fsync(fd)

    def ftruncate(self, fd: int, size: int) -> None:
        self._guard("ftruncate", self._path_of(fd))
        super().ftruncate(fd, size)

    def scandir(self, path: str) -> list[os.DirEntry]:
        self._guard("scandir", path)
        return super().scandir(path)

    def replace(self, src: str, dst: str) -> None:
        self._guard("replace", src, dst)
        super().replace(src, dst)

    def exchange(self, a: str, b: str) -> None:
        self._guard("exchange", a, b)
        super().exchange(a, b)

    def link(self, src: str, dst: str) -> None:
        self._guard("link", src, dst)
        super().link(src, dst)

    def utime(self, path: str, ns: int) -> None:
        self._guard("utime", path)
        super().utime(path, ns)

    def unlink(self, path: str) -> None:
        self._guard("unlink", path)
        super().unlink(path)

    def rmdir(self, path: str) -> None:
        self._guard("rmdir", path)
        super().rmdir(path)

    def makedirs(self, path: str) -> None:
        self._guard("makedirs", path)
        super().makedirs(path)

    def fsync_dir(self, path: str) -> None:
        self._guard("fsync_dir", path)
        super().fsync_dir(path)

    def write_small(self, path: str, data: bytes) -> None:
        self._guard("write_small", path)
        super().write_small(path, data)
