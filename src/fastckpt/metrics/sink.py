"""Events -> metrics: an EventSink that updates the per-rank histograms, counters and gauges."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..eventlog import error_type
from ..events import LAZY, Event
from ..replay import Blocks, BlockSave, LazySnapshots, fence_block
from ..runstate import RankStatus, RunState
from .families import BY_NAME, SECONDS_BUCKETS, Family

#: How many save directories are remembered for the free-space series of POSIX targets.
MAX_TARGET_DIRS = 16
#: How many ended one_save() blocks wait for the fence events of their lazy files.
MAX_FENCING_BLOCKS = 64


def build(family: Family, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
    """A prometheus-client metric for ``family`` in ``registry``."""
    if family.kind == "histogram":
        return Histogram(family.name, family.help, family.labels, registry=registry, buckets=SECONDS_BUCKETS)
    cls = Counter if family.kind == "counter" else Gauge
    return cls(family.name, family.help, family.labels, registry=registry)


class EventMetrics:
    """Receives every event (any thread) and updates the metrics; keeps the run's state for
    the durable time of each save and, for a followed log, the ranks' status. The files of a
    ``one_save()`` block are one save (``fastckpt.replay``): counted, their blocked time summed, at
    the block's ``one_save`` event. A lazy save is counted at its ``fence`` event, its blocked time
    the snapshot's and the fence's wait, as ``stats()`` counts it (a block with lazy files: once
    each has its fence event).

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
        self._blocks, self._unfenced = Blocks(), LazySnapshots()
        # blocks that ended with lazy files whose fence event has not come: counted once all have
        self._fencing: OrderedDict[tuple[int, str | None, str | None], tuple[tuple[str, str], BlockSave]] = \
            OrderedDict()

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
        if ev.name == "snapshot":
            self._remember(ev.path)
            if ev.block is not None:
                self._blocks.add(ev)  # counted when its block ends
            elif ev.detail == LAZY:  # counted at its fence event
                for old in self._unfenced.hold(ev):
                    self._saved((str(old.rank), old.tier), old.start, old.duration_s)
            else:
                self._saved(lab, ev.start, dur)
        elif ev.name == "one_save" and (block := self._blocks.close(ev)) is not None:
            self._block_saved((ev.rank, ev.session, ev.block), lab, block)
        elif ev.name == "fence":
            self._fenced(ev, lab)
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

    def _fenced(self, ev: Event, lab: tuple[str, str]) -> None:
        """A lazy save's ``fence`` event: the save is counted, with the fence's wait (``save.lazy``)."""
        if ev.block is not None and not self._blocks.fenced(ev) and \
                (held := self._fencing.pop((ev.rank, ev.session, ev.block), None)) is not None:
            self._block_saved((ev.rank, ev.session, ev.block), held[0], fence_block(held[1], ev))
        elif ev.block is None and (lazy := self._unfenced.fenced(ev)) is not None:
            self._saved(lab, lazy.start, lazy.duration_s + ev.duration_s)

    def _block_saved(self, key: tuple[int, str | None, str | None], lab: tuple[str, str], block: BlockSave) -> None:
        """A block that ended: counted, or held until its lazy files' fence events came."""
        if not block.lazy:
            return self._saved(lab, block.start, block.blocked_s)
        self._fencing[key] = (lab, block)
        while len(self._fencing) > MAX_FENCING_BLOCKS:  # a job killed before its fence: counted as it is
            lab, block = self._fencing.popitem(last=False)[1]
            self._saved(lab, block.start, block.blocked_s)

    def _saved(self, lab: tuple[str, str], start: float, blocked_s: float) -> None:
        m = self._m
        m["fastckpt_save_blocked_seconds"].labels(*lab).observe(blocked_s)
        m["fastckpt_saves"].labels(*lab).inc()
        m["fastckpt_last_save_blocked_seconds"].labels(*lab).set(blocked_s)
        m["fastckpt_last_save_timestamp_seconds"].labels(*lab).set(start)

    def _remember(self, path: str) -> None:
        if "://" in path:
            return
        d = os.path.dirname(path)
        self._dirs.pop(d, None)
        self._dirs[d] = None
        while len(self._dirs) > MAX_TARGET_DIRS:
            self._dirs.popitem(last=False)
