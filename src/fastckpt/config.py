"""Options, validated once: a frozen dataclass per concern. Environment variables: none yet
(when one is added, read it here and nowhere else)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .errors import ConfigError
from .tiers import TIERS

MiB = 1 << 20


@dataclass(frozen=True)
class CheckpointerConfig:
    """How a Checkpointer saves. See ``Checkpointer`` for each field's meaning."""

    local_dir: str | None = None
    tier: str = "auto"
    overhead_budget: float = 0.02
    overhead_window_s: float = 3600.0
    event_log: str | None = None
    on_overhead_exceeded: Callable | None = None
    when_busy: str = "wait"
    io_threads: int = 4
    chunk_bytes: int = 64 * MiB
    odirect: bool = True
    overlap_write: bool = False
    staging_buffers: int = 1
    commit_timeout_s: float = 600.0
    rank: int | None = None
    world_size: int | None = None
    # replication to the durable home (docs/burst-buffer.md)
    keep_local: int | None = None
    keep_persistent: int | None = None
    replicate_bandwidth_Bps: float | None = None
    replicate_policy: str = "coalesce"
    replicate_verify: str = "checksum"
    replicate_workers: int = 2
    storage_options: dict | None = None
    retry_deadline_s: float = 300.0
    close_timeout_s: float | None = None
    # observability (docs/metrics.md)
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ConfigError(f"tier={self.tier!r} is not one of {', '.join(TIERS)}")
        if not 0 < self.overhead_budget < 1:
            raise ConfigError(f"overhead_budget={self.overhead_budget!r} must be a fraction in (0, 1), e.g. 0.02 for 2 %")
        if self.overhead_window_s <= 0:
            raise ConfigError("overhead_window_s must be > 0 seconds")
        if self.when_busy not in ("wait", "skip"):
            raise ConfigError(f"when_busy={self.when_busy!r} must be 'wait' (block until the staging buffer "
                              "is free) or 'skip' (drop this save with a warning)")
        if not 1 <= self.io_threads <= 256:
            raise ConfigError(f"io_threads={self.io_threads} must be between 1 and 256")
        if not isinstance(self.staging_buffers, int) or not 1 <= self.staging_buffers <= 4:
            raise ConfigError(f"staging_buffers={self.staging_buffers!r} must be a whole number from 1 to 4 (each "
                              "holds one copy of the state in host memory)")
        if self.chunk_bytes <= 0 or self.chunk_bytes % (16 * MiB):
            raise ConfigError(f"chunk_bytes={self.chunk_bytes} must be a positive multiple of 16 MiB")
        if self.commit_timeout_s <= 0:
            raise ConfigError("commit_timeout_s must be > 0 seconds")
        if (self.rank is None) != (self.world_size is None):
            raise ConfigError("give both rank and world_size, or neither (they default to torch.distributed's)")
        if self.world_size is not None and not 0 <= self.rank < self.world_size:  # type: ignore[operator]
            raise ConfigError(f"rank={self.rank} must be in [0, world_size={self.world_size})")
        for name in ("keep_local", "keep_persistent"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name}={v!r} must be a whole number >= 1 (how many checkpoints to keep), "
                                  "or None to keep all")
        if self.keep_local is not None and self.local_dir is None:
            raise ConfigError("keep_local applies to the burst buffer: set local_dir too, or drop keep_local")
        if self.replicate_bandwidth_Bps is not None and not self.replicate_bandwidth_Bps > 0:
            raise ConfigError(f"replicate_bandwidth_Bps={self.replicate_bandwidth_Bps!r} must be > 0 bytes/s, "
                              "or None for no cap")
        if self.replicate_policy not in ("coalesce", "all"):
            raise ConfigError(f"replicate_policy={self.replicate_policy!r} must be 'coalesce' (replicate the newest, "
                              "drop superseded queued ones) or 'all'")
        if self.replicate_verify not in ("checksum", "readback"):
            raise ConfigError(f"replicate_verify={self.replicate_verify!r} must be 'checksum' (the store checks each "
                              "part's checksum while uploading) or 'readback' (also read every replica back)")
        if not 1 <= self.replicate_workers <= 64:
            raise ConfigError(f"replicate_workers={self.replicate_workers} must be between 1 and 64")
        if self.retry_deadline_s <= 0:
            raise ConfigError("retry_deadline_s must be > 0 seconds")
        if self.close_timeout_s is not None and self.close_timeout_s < 0:
            raise ConfigError("close_timeout_s must be >= 0 seconds, or None to wait as long as it takes")
        port = self.metrics_port
        if port is not None and (type(port) is not int or not 0 <= port <= 65535):  # noqa: E721 (bool is no port)
            raise ConfigError(f"metrics_port={self.metrics_port!r} must be a TCP port from 1 to 65535 (each rank "
                              "serves on metrics_port + LOCAL_RANK), 0 for any free port, or None for no exporter")
        if self.local_dir is not None and "://" in self.local_dir:
            raise ConfigError(f"local_dir={self.local_dir!r} must be a node-local directory, not a URL")
