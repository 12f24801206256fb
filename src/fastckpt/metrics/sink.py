"""Events -> metrics: an EventSink that updates the per-rank histograms, counters and gauges."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..eventlog import error_type
from ..events import Event
from ..replay import Counted, SaveCounter
from ..runstate import RankStatus, RunState
from .families import BY_NAME, SECONDS_BUCKETS, Family

#: How many save directories are remembered for the free-space series of POSIX targets.
MAX_TARGET_DIRS = 16


def build(family: Family, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
    """A prometheus-client metric for ``family`` in ``registry``."""
    if family.kind == "histogram":
        return Histogram(family.name, family.help, family.labels, registry=registry, buckets=SECONDS_BUCKETS)
    cls = Counter if family.kind == "counter" else Gauge
    return cls(family.name, family.help, family.labels, registry=registry)


class EventMetrics:
    """Receives every event (any thread) and updates the metrics; keeps the run's state for
    the durable time of each save and, for a followed log, the ranks' status. Saves are counted by
    ``replay.SaveCounter``, the rule the log's overhead replay counts them by (so as ``stats()``
    does): ``fastckpt_saves_total`` when one is counted, its blocked time observed once it is final
    (a lazy save's with its fence's wait; a ``one_save()`` block with lazy files: once each has its
    ``fence`` event).

    Args:
        registry: where the metrics live (one per exporter: never the global registry).
        run: the RunState replaying the events (its budget and window matter for a log).
    """

    NAMES = ("fastckpt_save_blocked_seconds", "fastckpt_save_write_seconds", "fastckpt_save_commit_seconds",
             "fastckpt_save_durable_seconds", "fastckpt_group_commit_seconds", "fastckpt_replicate_seconds",
             "fastckpt_load_seconds", "fastckpt_saves", "fastckpt_saved_bytes", "fastckpt_replicated_bytes",
             "fastckpt_loaded_bytes", "fastckpt_failures", "fastckpt_retries",
             "fastckpt_write_bandwidth_bytes_per_second", "fastckpt_replicate_bandwidth_bytes_per_second",
             "fastckpt_last_save_blocked_seconds", "fastckpt_last_save_timestamp_seconds")

    def __init__(self, registry: CollectorRegistry, run: RunState | None = None) -> None:
        self._lock = threading.Lock()
        self._run = run or RunState(keep_done=0)
        self._m = {n: build(BY_NAME[n], registry) for n in self.NAMES}
        self._dirs: OrderedDict[str, None] = OrderedDict()
        self._counter = SaveCounter()

    def emit(self, event: Event) -> None:
        with self._lock:
            self._observe(event)
            for done in self._run.feed(event):
                if done.durable_s is not None:
                    self._m["fastckpt_save_durable_seconds"].labels(str(done.rank), done.tier).observe(done.durable_s)

    def status(self, now: float) -> list[RankStatus]:
        """The ranks' status replayed from the events (for an exporter that follows a log)."""
        with self._lock:
            return self._run.status(now)

    def target_dirs(self) -> list[str]:
        """Directories of the recent saves to POSIX paths (for their filesystems' free space)."""
        with self._lock:
            return list(self._dirs)

    def _observe(self, ev: Event) -> None:
        m, rank, dur = self._m, str(ev.rank), ev.duration_s
        if ev.error is not None:
            name = "fastckpt_retries" if ev.name == "retry" else "fastckpt_failures"
            labels = (rank, ev.tier, error_type(ev.error)) if ev.name == "retry" else \
                (rank, ev.tier, ev.name, error_type(ev.error))
            m[name].labels(*labels).inc()
            return
        lab = (rank, ev.tier)
        for c in self._counter.feed(ev):
            self._counted(c)
        if ev.name == "snapshot":
            self._remember(ev.path)
        elif ev.name == "write":
            m["fastckpt_save_write_seconds"].labels(*lab).observe(dur)
            if dur > 0:
                m["fastckpt_write_bandwidth_bytes_per_second"].labels(*lab).set(ev.bytes / dur)
        elif ev.name == "commit" and ev.detail == "group":
            m["fastckpt_group_commit_seconds"].labels(*lab).observe(dur)
        elif ev.name == "commit":
            m["fastckpt_save_commit_seconds"].labels(*lab).observe(dur)
            m["fastckpt_saved_bytes"].labels(*lab).inc(ev.bytes)
        elif ev.name == "replicate":
            m["fastckpt_replicate_seconds"].labels(*lab).observe(dur)
            m["fastckpt_replicated_bytes"].labels(*lab).inc(ev.bytes)
            if dur > 0:
                m["fastckpt_replicate_bandwidth_bytes_per_second"].labels(*lab).set(ev.bytes / dur)
        elif ev.name == "load":
            m["fastckpt_load_seconds"].labels(*lab).observe(dur)
            m["fastckpt_loaded_bytes"].labels(*lab).inc(ev.bytes)

    def _counted(self, c: Counted) -> None:
        """A save counted (``new``), and its blocked time, once final (observed once)."""
        m, lab = self._m, (str(c.rank), c.tier)
        if c.new:
            m["fastckpt_saves"].labels(*lab).inc()
        if c.final:
            m["fastckpt_save_blocked_seconds"].labels(*lab).observe(c.blocked_s)
            m["fastckpt_last_save_blocked_seconds"].labels(*lab).set(c.blocked_s)
            m["fastckpt_last_save_timestamp_seconds"].labels(*lab).set(c.start)

    def _remember(self, path: str) -> None:
        if "://" in path:
            return
        d = os.path.dirname(path)
        self._dirs.pop(d, None)
        self._dirs[d] = None
        while len(self._dirs) > MAX_TARGET_DIRS:
            self._dirs.popitem(last=False)
