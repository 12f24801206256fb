"""The HTTP endpoint, in a training process (``metrics_port=``) or following logs (``serve-metrics``).

Several ranks on one node: each rank's Checkpointer serves on ``metrics_port + LOCAL_RANK``
(torchrun sets LOCAL_RANK; 0 when unset) with its own ``rank`` label, and only local rank 0
adds the node's storage-health series, so no series appears twice. Or run one
``fastckpt serve-metrics`` per node over all the ranks' event logs (docs/metrics.md).
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ..config import MAX_PORT, env_count
from ..errors import ConfigError
from ..eventlog import LogFollower, unique_paths
from ..events import Event
from ..monitor import Stats
from ..runstate import RankStatus, RunState
from .collectors import NodeHealth, StatusCollector, status_from_stats
from .sink import EventMetrics

log = logging.getLogger("fastckpt")


def local_rank() -> int:
    """This process's rank on its node (torchrun's LOCAL_RANK; 0 when unset).

    Raises:
        ConfigError: LOCAL_RANK is no whole number >= 0 (``env_count``), naming it.
    """
    return env_count("LOCAL_RANK", 0, 0, fix="unset it (each rank serves on metrics_port + LOCAL_RANK)")


class MetricsServer:
    """Serves one registry over HTTP on a daemon thread until ``close()``.

    Started while the interpreter shuts down (``sys.is_finalizing()``), it serves nothing and says so
    in a WARNING (``port`` and ``url`` are None): a thread started then never runs, and waiting for it
    would hold the process at exit for ever.

    Raises:
        ConfigError: the port is taken, or the address cannot be listened on (the message says
            which and what to do).
    """

    # what to do when the port is taken; a subclass run by hand says which flag to change
    in_use_fix = ("With several ranks per node each rank serves on metrics_port + LOCAL_RANK: choose a base port "
                  "with enough free ports above it, or run one `fastckpt serve-metrics` per node instead. Two "
                  "Checkpointers (two engines) in one process each serve: give only one a metrics_port, or each "
                  "its own")

    def __init__(self, registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> None:
        self._httpd, self._pid = None, os.getpid()
        self.port: int | None = None
        self.url: str | None = None
        if sys.is_finalizing():  # a __del__ or a garbage collection at exit, after the exit hooks ran: a thread
            # started now never runs, and Thread.start() waits for it forever, so the process would never exit
            log.warning("fastckpt: not serving Prometheus metrics on port %d: the exporter was started while the "
                        "interpreter shuts down (from a __del__ or a garbage collection at exit), when no new thread "
                        "can run. Start it before the script ends, or pass metrics_port=None there", port)
            return
        try:
            self._httpd, self._thread = start_http_server(port, addr, registry=registry)
        except OSError as exc:  # socket.gaierror too: an address that does not resolve
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"metrics port {port} is already in use on this node. {self.in_use_fix}") from exc
            raise ConfigError(f"cannot serve metrics on {addr}:{port} ({exc}): give an address of this node, "
                              "e.g. 0.0.0.0 (all) or 127.0.0.1, and a free port") from exc
        host = self._httpd.server_address[0]
        self.port = self._httpd.server_address[1]
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.url = f"http://{f'[{shown}]' if ':' in shown else shown}:{self.port}/metrics"  # an IPv6 address: [::1]
        log.info("fastckpt: Prometheus metrics at %s", self.url)

    def close(self) -> None:
        if self._httpd is None:  # never served (started at interpreter shutdown)
            return
        if os.getpid() != self._pid:  # a fork child's copy: shutdown() would wait for ever for the parent's thread
            self._httpd.server_close()
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


class CheckpointerExporter(MetricsServer):
    """A Checkpointer's exporter: an EventSink plus a reader of ``Checkpointer.stats()``."""

    def __init__(self, port: int, stats: Callable[[], Stats], rank: Callable[[], int],
                 local_dirs: Sequence[str], node: bool) -> None:
        registry = CollectorRegistry(auto_describe=False)
        self._sink = EventMetrics(registry)
        registry.register(StatusCollector(lambda: [status_from_stats(rank(), stats())]))
        if node:
            registry.register(NodeHealth(local_dirs, self._sink.target_dirs))
        super().__init__(registry, port)

    def emit(self, event: Event) -> None:
        self._sink.emit(event)


def start_exporter(port: int, stats: Callable[[], Stats], rank: Callable[[], int],
                   local_dirs: Sequence[str]) -> CheckpointerExporter:
    """Serve a Checkpointer's metrics on ``port + LOCAL_RANK`` (``port=0``: any free port);
    ``local_dirs``: its burst buffer's directories (every drive's free space).

    Raises:
        ConfigError: the port is taken, ``port + LOCAL_RANK`` is past the last TCP port, or $LOCAL_RANK is bad.
    """
    lr = local_rank()
    if port and port + lr > MAX_PORT:  # here, not in the config: LOCAL_RANK is read here
        raise ConfigError(f"metrics_port={port} with LOCAL_RANK={lr} would serve on port {port + lr}, past the last "
                          f"TCP port {MAX_PORT} (each rank serves on metrics_port + LOCAL_RANK): choose a metrics_port "
                          f"no higher than {MAX_PORT} minus the node's highest LOCAL_RANK ({MAX_PORT - lr} or lower "
                          "for this rank), or metrics_port=0 for any free port")
    return CheckpointerExporter(port + lr if port else 0, stats, rank, local_dirs, node=lr == 0)


class LogExporter(MetricsServer):
    """Follows event logs (one per rank, or several ranks' in one) and serves their metrics.

    ``poll()`` reads what was appended since the last call; every scrape polls first (so it
    sees each event written before it), and ``run()`` polls in between until stopped.
    Overhead, alarm, pending saves, lag and RPO are replayed from the logs (fastckpt.runstate).
    A log given twice (or through a symlink) is followed once; a line that is not an event is
    skipped, logged and counted in ``bad_lines``.

    Args:
        logs: the event logs to follow (they may not exist yet).
        port: TCP port (0: any free one).
        addr: the address to listen on.
        local_dirs: the node's burst-buffer directories, for their free space (none: not reported).
        budget: the overhead budget the alarm is replayed against (None: each job's, from its log).
        window_s: the sliding window of the overhead (None: each job's, from its log).
    """

    def __init__(self, logs: Sequence[str], port: int, addr: str = "0.0.0.0", *, local_dirs: Sequence[str] = (),
                 budget: float | None = None, window_s: float | None = None) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_PollFirst(self))  # registered first: collected before the families it feeds
        self._sink = EventMetrics(registry, RunState(budget, window_s, keep_done=256))
        registry.register(StatusCollector(lambda: self._sink.status(time.time())))
        registry.register(NodeHealth(local_dirs, self._sink.target_dirs))
        self._followers = [LogFollower(p) for p in unique_paths(logs)]
        self._lock = threading.Lock()  # scrapes (the server's threads) and run() both poll
        self.events = 0
        super().__init__(registry, port, addr)

    in_use_fix = "Choose another --port (0 picks a free one), or stop the exporter already serving on it"

    @property
    def bad_lines(self) -> int:
        """Complete lines of the logs that were not events (skipped)."""
        return sum(f.bad_lines for f in self._followers)

    def not_event_logs(self) -> list[str]:
        """Why each log read so far is no event log (``LogFollower.not_an_event_log``)."""
        return [why for f in self._followers if (why := f.not_an_event_log()) is not None]

    def status(self, now: float) -> list[RankStatus]:
        """The ranks' status replayed from the logs read so far."""
        return self._sink.status(now)

    def poll(self) -> int:
        """Read and export the events appended since the last poll; returns how many."""
        n = 0
        with self._lock:
            for f in self._followers:
                for ev in f.poll():
                    self._sink.emit(ev)
                    n += 1
            self.events += n
        return n

    def run(self, stop: threading.Event, poll_s: float = 1.0) -> None:
        """Poll every ``poll_s`` seconds until ``stop`` is set."""
        while True:
            self.poll()
            if stop.wait(poll_s):
                return


class _PollFirst(Collector):
    """Yields nothing: reads what the logs gained when a scrape starts (``LogExporter.poll``)."""

    def __init__(self, exporter: LogExporter) -> None:
        self._exporter = exporter

    def collect(self) -> Iterator[Metric]:
        self._exporter.poll()
        return iter(())
