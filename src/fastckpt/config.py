"""Every Checkpointer option, defined once: its type, its default and a one-line meaning.

``CheckpointerConfig`` is the single definition. ``Checkpointer`` takes exactly these fields as
its constructor arguments (``options_signature`` copies them onto it, so ``help(Checkpointer)``
and an IDE show each one), and the integrations (Lightning's ``FastCkptIO``, DeepSpeed's
``"fastckpt"`` config section) pass their options through to it unchanged. ``__post_init__``
validates and raises ``ConfigError`` naming the option and the fix; it never rewrites a field.

Environment variables: fastckpt reads none (when one is added, read it here and nowhere else).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Concatenate, ParamSpec, TypeVar

from .errors import ConfigError
from .units import MiB
from .urls import canonical

if TYPE_CHECKING:
    from torch.distributed import Store

    from .events import EventSink
    from .io.ops import FileOps
    from .monitor import OverheadReport

TIERS = ("auto", "gds", "nvme", "direct")
MAX_PORT = 65535  # the last TCP port: metrics_port + LOCAL_RANK must not pass it (metrics/exporter.py)
DEFAULT_RETRY_DEADLINE_S = 300.0
#: What an ``ops`` must do (io.ops.FileOps, which this base module may not import): its first methods.
OPS_METHODS = ("open", "pwrite", "preadv", "fsync", "close", "replace", "unlink", "makedirs")


def _opt(default: object, meaning: str) -> object:
    return field(default=default, metadata={"help": meaning})


def check_local_dir(d: str, name: str) -> None:
    """Refuse a burst-buffer directory ``d`` (``name``: how the caller calls it) that is a URL, or
    a URL that lost a slash or its colon (``s3:/b/bb``: ``os.path``'s folder ``./s3:``).

    Raises:
        ConfigError: naming ``d`` and the fix.
    """
    if "://" in d:
        raise ConfigError(f"{name} must be a node-local directory, not a URL (the burst buffer is node-local; "
                          "the URL is where checkpoints are saved)")
    try:
        canonical(d)
    except ConfigError:
        raise ConfigError(f"{name} looks like a URL without its '://', and would be a local folder here; the burst "
                          f"buffer is a node-local directory, never a URL: for a local folder of that name write "
                          f"'./{d}'") from None


@dataclass(frozen=True)
class CheckpointerConfig:
    """How a Checkpointer saves, replicates, loads and reports (docs/core.md, docs/burst-buffer.md)."""

    local_dir: str | os.PathLike | Sequence[str | os.PathLike] | None = _opt(
        None, "node-local burst buffer (NVMe): files land there first and are copied to their path in the "
              "background (nvme tier); a list of directories (one per drive) stripes files across them; None "
              "writes straight to the path (direct tier). URL paths (s3://...) need it.")
    tier: str = _opt("auto", "'auto', 'gds', 'nvme' or 'direct' (docs/tiers.md).")
    overhead_budget: float = _opt(0.02, "fraction of wall time saves may block before the alarm (0.02 = 2 %).")
    event_log: str | None = _opt(None, "JSONL file that receives one event per phase of every save and load "
                                       "(its directory is created).")
    _: KW_ONLY
    on_overhead_exceeded: Callable[[OverheadReport], None] | None = _opt(
        None, "called with an OverheadReport when the overhead crosses the budget.")
    overhead_window_s: float = _opt(3600.0, "length of the sliding window the overhead is also measured over.")
    when_busy: str = _opt("wait", "'wait' (block until a staging buffer is free) or 'skip' (drop the save "
                                  "with a warning) when every staging buffer is in use.")
    io_threads: int = _opt(4, "threads that write, read and copy file chunks in parallel.")
    chunk_bytes: int = _opt(64 * MiB, "bytes per parallel write/read (a multiple of 16 MiB).")
    odirect: bool = _opt(True, "write and read with O_DIRECT where the file system honours it.")
    overlap_write: bool = _opt(False, "CPU states: start writing while the snapshot still copies. Off by default: "
                                      "on the 2-core VM it lengthened the stall by 1.2-1.4x (the disk's reads of "
                                      "memory slow the copy) and was durable no sooner.")
    staging_buffers: int = _opt(1, "host copies of a checkpoint that saves may use at once (1-4): more lets a "
                                   "save start while the previous one still writes, at one copy of memory each.")
    commit_timeout_s: float = _opt(600.0, "how long a group commit waits for every rank.")
    rank: int | None = _opt(None, "this process's rank (default: torch.distributed's, else $RANK or 0).")
    world_size: int | None = _opt(None, "number of ranks (default: torch.distributed's, else $WORLD_SIZE or 1).")
    store: Store | None = _opt(None, "the torch.distributed Store (e.g. a TCPStore every rank reaches) that group "
                                     "commits coordinate through (default: the default process group's, once "
                                     "initialised; without one, marker files in the group's directory).")
    keep_local: int | None = _opt(None, "checkpoints to keep in local_dir once replicated, counting those earlier "
                                  "runs left there and the groups replication dropped for later steps (None: all).")
    keep_persistent: int | None = _opt(None, "checkpoints to keep at their durable home (None: all).")
    replicate_bandwidth_Bps: float | None = _opt(None, "cap on replication (and its verification) in bytes/s "
                                                       "(None: no cap).")
    replicate_policy: str = _opt("coalesce", "'coalesce' (replicate the newest, drop superseded queued "
                                             "checkpoints) or 'all'.")
    replicate_verify: str = _opt("checksum", "'checksum' (the store checks each part's checksum while "
                                             "uploading) or 'readback' (also read every replica back).")
    replicate_workers: int = _opt(2, "checkpoints replicated at once.")
    replicate_in_order: bool = _opt(False, "single files become final at their paths in the order of their save "
                                           "calls (each replica starts once the earlier ones ended): what readers "
                                           "of the newest file by mtime, e.g. Lightning, assume; a save written "
                                           "straight to its path (a full burst buffer) waits its turn too.")
    storage_options: dict | None = _opt(None, "fsspec options for URL homes (endpoint_url, key, secret, ...).")
    retry_deadline_s: float = _opt(DEFAULT_RETRY_DEADLINE_S, "how long one storage request keeps retrying "
                                                             "transient errors.")
    close_timeout_s: float | None = _opt(None, "how long close() waits for pending saves, then gives up on them "
                                               "(None: as long as it takes).")
    metrics_port: int | None = _opt(None, "serve Prometheus metrics on this port + LOCAL_RANK (0: any free port; "
                                          "docs/metrics.md; needs fastckpt[metrics]).")
    ops: FileOps | None = _opt(None, "the system-call seam (fastckpt.testing.FaultyOps injects faults).")
    sinks: tuple[EventSink, ...] = _opt((), "extra EventSinks that receive every event.")

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ConfigError(f"tier={self.tier!r} is not one of {', '.join(TIERS)}")
        if not _real(self.overhead_budget) or not 0 < self.overhead_budget < 1:
            raise ConfigError(f"overhead_budget={self.overhead_budget!r} must be a fraction in (0, 1), "
                              "e.g. 0.02 for 2 %")
        _seconds("overhead_window_s", self.overhead_window_s)
        if self.when_busy not in ("wait", "skip"):
            raise ConfigError(f"when_busy={self.when_busy!r} must be 'wait' (block until the staging buffer "
                              "is free) or 'skip' (drop this save with a warning)")
        _count("io_threads", self.io_threads, 1, 256)
        _count("staging_buffers", self.staging_buffers, 1, 4, " (each holds one copy of the state in host memory)")
        if not _whole(self.chunk_bytes) or self.chunk_bytes <= 0 or self.chunk_bytes % (16 * MiB):
            raise ConfigError(f"chunk_bytes={self.chunk_bytes!r} must be a positive multiple of 16 MiB"
                              + _bool_hint(self.chunk_bytes, "a number of bytes"))
        _seconds("commit_timeout_s", self.commit_timeout_s)
        for name in ("odirect", "overlap_write", "replicate_in_order"):
            if not isinstance(getattr(self, name), bool):  # "false" would be true
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.event_log is not None and (not isinstance(self.event_log, (str, os.PathLike))
                                           or not os.fspath(self.event_log).strip()):  # "" meant: no log, silently
            raise ConfigError(f"event_log={self.event_log!r} must be a file path (a str or a Path), or None for no log")
        if self.on_overhead_exceeded is not None and not callable(self.on_overhead_exceeded):
            raise ConfigError(f"on_overhead_exceeded={self.on_overhead_exceeded!r} must be a function that takes an "
                              "OverheadReport (called when the overhead crosses the budget), or None")
        check_storage_options(self.storage_options)
        self._check_seams()
        self._check_ranks()
        self._check_replication()

    def _check_seams(self) -> None:
        """``ops`` and ``sinks`` are used on background threads, long after construction: a wrong
        value raised an AttributeError or TypeError there, far from the call that passed it."""
        ops = self.ops
        lacking = [m for m in OPS_METHODS if ops is not None and not callable(getattr(ops, m, None))]
        if ops is not None and (lacking or isinstance(ops, type)):
            why = "is a class, not an instance" if isinstance(ops, type) else f"lacks {', '.join(lacking)}"
            raise ConfigError(f"ops={ops!r} {why}: give a fastckpt.io.ops.FileOps (fastckpt.testing.FaultyOps() "
                              "injects faults), or None for the plain system calls")
        sinks = self.sinks
        if not isinstance(sinks, (list, tuple)) or not all(
                callable(getattr(s, "emit", None)) and not isinstance(s, type) for s in sinks):
            raise ConfigError(f"sinks={sinks!r} must be a list or tuple of EventSinks (objects with an emit(event) "
                              "method, instances of their class), or () for none")

    def _check_ranks(self) -> None:
        if (self.rank is None) != (self.world_size is None):
            raise ConfigError("give both rank and world_size, or neither (they default to torch.distributed's)")
        if self.world_size is not None:
            _count("world_size", self.world_size, 1)
            _count("rank", self.rank, 0, self.world_size - 1, f" (world_size={self.world_size})", "this process's rank")
        lacking = [m for m in ("add", "append", "check", "compare_set", "delete_key", "get", "set", "wait")
                   if self.store is not None and not callable(getattr(self.store, m, None))]
        if lacking:
            raise ConfigError(f"store={self.store!r} lacks {', '.join(lacking)}: pass a torch.distributed Store "
                              "(TCPStore, or torch.distributed.distributed_c10d._get_default_store()), or None")

    def _check_replication(self) -> None:
        for name in ("keep_local", "keep_persistent"):
            if getattr(self, name) is not None:
                _count(name, getattr(self, name), 1, None, " (how many checkpoints to keep), or None to keep all")
        if self.keep_local is not None and self.local_dir is None:
            raise ConfigError("keep_local applies to the burst buffer: set local_dir too, or drop keep_local")
        if self.tier == "nvme" and self.local_dir is None:  # known now: not at the first save, after training ran
            raise ConfigError("tier='nvme' needs local_dir=<node-local directory> (the burst buffer it writes to "
                              "first): set local_dir, or use tier='auto'")
        if self.tier == "direct" and self.local_dir is not None:
            raise ConfigError("tier='direct' writes straight to the path: drop local_dir, or use tier='nvme'")
        bps = self.replicate_bandwidth_Bps
        if bps is not None and (isinstance(bps, bool) or not isinstance(bps, numbers.Real) or not bps > 0):
            raise ConfigError(f"replicate_bandwidth_Bps={bps!r} must be > 0 bytes/s, or None for no cap"
                              + _bool_hint(bps, "a number of bytes/s"))
        if self.replicate_policy not in ("coalesce", "all"):
            raise ConfigError(f"replicate_policy={self.replicate_policy!r} must be 'coalesce' (replicate the newest, "
                              "drop superseded queued ones) or 'all'")
        if self.replicate_verify not in ("checksum", "readback"):
            raise ConfigError(f"replicate_verify={self.replicate_verify!r} must be 'checksum' (the store checks each "
                              "part's checksum while uploading) or 'readback' (also read every replica back)")
        _count("replicate_workers", self.replicate_workers, 1, 64)
        _seconds("retry_deadline_s", self.retry_deadline_s)
        if self.close_timeout_s is not None:
            _seconds("close_timeout_s", self.close_timeout_s, zero=True, none=" or None to wait as long as it takes")
        port = self.metrics_port
        if port is not None and (type(port) is not int or not 0 <= port <= MAX_PORT):  # noqa: E721 (bool is no port)
            raise ConfigError(f"metrics_port={self.metrics_port!r} must be a TCP port from 1 to {MAX_PORT} (each rank "
                              "serves on metrics_port + LOCAL_RANK), 0 for any free port, or None for no exporter")
        self._check_local_dirs()

    def _check_local_dirs(self) -> None:
        if self.local_dir is None:
            return
        dirs = [self.local_dir] if isinstance(self.local_dir, (str, os.PathLike)) else self.local_dir
        if (not isinstance(dirs, Sequence) or not dirs
                or not all(isinstance(d, (str, os.PathLike)) and isinstance(os.fspath(d), str) and os.fspath(d)
                           for d in dirs)):
            raise ConfigError(f"local_dir={self.local_dir!r} must be a directory (a str or a Path) or a non-empty "
                              "list of directories (one per local drive)")
        for d in self.local_dirs:
            check_local_dir(d, f"local_dir={d!r}")
            if os.path.realpath(d) == os.sep:  # the copy of /a/b.pt is <local_dir>/a/b.pt: here, the file itself
                raise ConfigError(f"local_dir={d!r} is the root directory: each file's burst-buffer copy mirrors its "
                                  "path under local_dir, so it would be the file itself and nothing would be "
                                  "replicated. Point local_dir at a node-local directory (e.g. /local_nvme/ckpt), or "
                                  "drop it to save straight to the path")
        if len({os.path.abspath(d) for d in self.local_dirs}) != len(dirs):
            raise ConfigError(f"local_dir={self.local_dir!r} names a directory twice: give each drive once")

    def ranks(self) -> tuple[int, int]:
        """(rank, world_size): as given, else torch.distributed's once initialised, else $RANK and
        $WORLD_SIZE (0 and 1 without them), checked as rank= and world_size= are (``env_count``)."""
        if self.rank is not None:
            return self.rank, self.world_size  # type: ignore[return-value]  (given together: _check_ranks)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        world = env_count("WORLD_SIZE", 1, 1)
        unset = "" if os.environ.get("WORLD_SIZE", "").strip() else ", unset"
        return env_count("RANK", 0, 0, world - 1, f" ($WORLD_SIZE={world}{unset})"), world

    @property
    def local_dirs(self) -> tuple[str, ...]:
        """The burst-buffer directories (``local_dir`` as a tuple of str, a Path's too; empty without one)."""
        if self.local_dir is None:
            return ()
        dirs = (self.local_dir,) if isinstance(self.local_dir, (str, os.PathLike)) else self.local_dir
        return tuple(os.fspath(d) for d in dirs)


def option_names() -> tuple[str, ...]:
    """Every option's name, in definition order."""
    return tuple(f.name for f in dataclasses.fields(CheckpointerConfig))


def options_doc() -> str:
    """A Google-style ``Args:`` section listing every option with its default and meaning."""
    lines = ["Args:"]
    for f in dataclasses.fields(CheckpointerConfig):
        lines.append(f"    {f.name}: {f.metadata['help']} Default: {f.default!r}.")
    return "\n".join(lines)


P = ParamSpec("P")
T = TypeVar("T")


def options_signature(config: Callable[P, CheckpointerConfig]
                      ) -> Callable[[Callable[..., None]], Callable[Concatenate[T, P], None]]:
    """Give a constructor ``__init__(self, *args, **options)`` the config's exact signature.

    Type checkers see ``config``'s parameters (through ``ParamSpec``); ``help()`` and
    ``inspect.signature`` see them through ``__signature__``. The options stay defined once.
    """
    def decorate(init: Callable[..., None]) -> Callable[Concatenate[T, P], None]:
        params = list(inspect.signature(config).parameters.values())
        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        init.__signature__ = inspect.Signature([self_param, *params], return_annotation=None)  # type: ignore[attr-defined]
        return init  # type: ignore[return-value]

    return decorate


def check_storage_options(options: object) -> None:
    """``storage_options`` is a mapping of fsspec options, or None: a JSON string (what the
    command line's ``--storage-options`` takes) or a list failed at the first URL, in ``dict()``,
    naming neither the option nor the fix. The value is never repeated (it may hold secrets).

    Raises:
        ConfigError: naming the option and its type.
    """
    if options is not None and not isinstance(options, Mapping):
        hint = " (a JSON string? pass json.loads(...) of it)" if isinstance(options, (str, bytes)) else ""
        raise ConfigError(f"storage_options must be a dict of fsspec options (endpoint_url, key, secret, ...) or "
                          f"None, not a {type(options).__name__}{hint}")


def _seconds(name: str, v: object, zero: bool = False, none: str = "") -> None:
    """``v`` is a finite number of seconds, > 0 (>= 0 with ``zero``): never NaN, which every
    comparison lets through, nor infinity, which no timer takes."""
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and (v >= 0 if zero else v > 0)
    if not ok:
        raise ConfigError(f"{name}={v!r} must be a finite number of seconds {'>= 0' if zero else '> 0'}" + (
            f",{none}" if none else ""))


def _real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _whole(v: object) -> bool:
    """An int, numpy's too; never a bool, which Python counts as 1 or 0 (``keep_persistent=True``
    kept a single checkpoint, without a word)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _bool_hint(v: object, what: str) -> str:
    return f"; {v} is a bool (Python would take it as {int(v)}): give {what}" if isinstance(v, bool) else ""


def env_count(name: str, default: int, lo: int, hi: int | None = None, meaning: str = "",
              fix: str = "pass rank= and world_size= to the Checkpointer") -> int:
    """``$name`` (``default`` when unset or empty) checked as the option it stands for is: a
    launcher that exports RANK=1 but no WORLD_SIZE made rank 1 of a one-rank job, whose first
    commit waited ``commit_timeout_s`` for a rank 0 that cannot exist; RANK=abc a bare ValueError."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    v = int(raw) if re.fullmatch(r"[+-]?\d+", raw) else None
    if v is None or v < lo or (hi is not None and v > hi):
        span = f">= {lo}" if hi is None else f"from {lo} to {hi}"
        raise ConfigError(f"${name}={raw!r} in the environment must be a whole number {span}{meaning}: set it "
                          f"right in the launcher (torchrun sets RANK and WORLD_SIZE together), or {fix}")
    return v


def _count(name: str, v: object, lo: int, hi: int | None = None, meaning: str = "", what: str = "the count") -> None:
    """``v`` is a whole number (``_whole``) from ``lo`` to ``hi`` (None: no limit)."""
    if not _whole(v) or not lo <= v or (hi is not None and v > hi):  # type: ignore[operator]
        span = f">= {lo}" if hi is None else f"from {lo} to {hi}"
        raise ConfigError(f"{name}={v!r} must be a whole number {span}{meaning}" + _bool_hint(v, what))
