"""Metrics computed when Prometheus scrapes: the ranks' status and the node's storage health."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .. import sysinfo
from ..monitor import Stats
from ..runstate import RankStatus
from .families import BY_NAME

#: SMART changes slowly and nvme-cli costs a process per device: read it at most this often.
SMART_EVERY_S = 60.0


def _family(name: str) -> GaugeMetricFamily | CounterMetricFamily:
    f = BY_NAME[name]
    cls = CounterMetricFamily if f.kind == "counter" else GaugeMetricFamily
    return cls(f.name, f.help, labels=list(f.labels))


class StatusCollector(Collector):
    """Each rank's overhead, alarm, pending saves, replication lag and RPO, read at scrape time.

    Args:
        read: returns the ranks' status now: from ``Checkpointer.stats()`` in process, or
            replayed from a followed log.
    """

    def __init__(self, read: Callable[[], list[RankStatus]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        fams = {n: _family(n) for n in (
            "fastckpt_overhead_ratio", "fastckpt_overhead_budget_ratio", "fastckpt_overhead_alarm",
            "fastckpt_overhead_alarms", "fastckpt_pending_saves", "fastckpt_replication_pending_saves",
            "fastckpt_replication_lag_seconds", "fastckpt_rpo_seconds")}
        for s in self._read():
            r = str(s.rank)
            fams["fastckpt_overhead_ratio"].add_metric([r, "run"], s.overhead)
            fams["fastckpt_overhead_ratio"].add_metric([r, "sliding"], s.window_overhead)
            fams["fastckpt_overhead_budget_ratio"].add_metric([r], s.budget)
            fams["fastckpt_overhead_alarm"].add_metric([r], 1.0 if s.over_budget else 0.0)
            fams["fastckpt_overhead_alarms"].add_metric([r], s.alarms)
            fams["fastckpt_pending_saves"].add_metric([r], s.pending)
            fams["fastckpt_replication_pending_saves"].add_metric([r], s.replication_pending)
            if s.replication_lag_s is not None:
                fams["fastckpt_replication_lag_seconds"].add_metric([r], s.replication_lag_s)
            if s.rpo_s is not None:
                fams["fastckpt_rpo_seconds"].add_metric([r], s.rpo_s)
        yield from fams.values()


def status_from_stats(rank: int, s: Stats) -> RankStatus:
    """A Checkpointer's ``stats()`` as a RankStatus."""
    return RankStatus(rank, s.overhead, s.window_overhead, s.overhead_budget, s.over_budget, s.alarms, s.pending,
                      s.replication_pending, s.replication_lag_s, s.rpo_s)


class NodeHealth(Collector):
    """Storage health of this node: NVMe SMART, I/O wait, free space of the burst buffer and of
    the POSIX targets saved to. A source that cannot be read here gets
    ``fastckpt_health_source_available{source=...} 0`` and no series of its own.

    Args:
        burst_buffer: the Checkpointer's ``local_dir`` directories, one per drive of a striped
            burst buffer (empty: no burst-buffer series). Each file system among them gets its
            series, once (two directories on one share it); a directory that is no directory here
            (not made yet) has none.
        targets: returns directories saved to recently (their filesystems are the targets).
        nvme: the nvme-cli executable.
    """

    def __init__(self, burst_buffer: Sequence[str], targets: Callable[[], Iterable[str]], nvme: str = "nvme") -> None:
        self._bb, self._targets, self._nvme = tuple(burst_buffer), targets, nvme
        self._lock = threading.Lock()
        self._smart: list[sysinfo.Smart] = []
        self._smart_at: float | None = None
        self._cpu_prev: tuple[float, float] | None = None

    def collect(self) -> Iterator[Metric]:
        avail = _family("fastckpt_health_source_available")
        yield from self._smart_families(avail)
        yield from self._iowait_families(avail)
        yield from self._space_families(avail)
        yield avail

    def _read_smart(self) -> list[sysinfo.Smart]:
        with self._lock:
            now = time.monotonic()
            if self._smart_at is None or now - self._smart_at >= SMART_EVERY_S:
                self._smart, self._smart_at = sysinfo.read_smart(self._nvme), now
            return self._smart

    def _smart_families(self, avail: GaugeMetricFamily) -> Iterator[Metric]:
        smart = self._read_smart()
        avail.add_metric(["nvme_smart"], 1.0 if smart else 0.0)
        waf = [s for s in smart if s.write_amplification is not None]
        avail.add_metric(["nvme_write_amplification"], 1.0 if waf else 0.0)
        if not smart:
            return
        fields = (("fastckpt_nvme_temperature_celsius", lambda s: s.temperature_c),
                  ("fastckpt_nvme_percentage_used_ratio",
                   lambda s: None if s.percentage_used is None else s.percentage_used / 100),
                  ("fastckpt_nvme_data_written_bytes", lambda s: s.data_written_bytes),
                  ("fastckpt_nvme_media_errors", lambda s: s.media_errors),
                  ("fastckpt_nvme_write_amplification_ratio", lambda s: s.write_amplification))
        for name, get in fields:
            fam = _family(name)
            for s in smart:
                if (v := get(s)) is not None:
                    fam.add_metric([s.device], v)
            if fam.samples:
                yield fam

    def _iowait_families(self, avail: GaugeMetricFamily) -> Iterator[Metric]:
        cpu = sysinfo.cpu_times()
        avail.add_metric(["iowait"], 0.0 if cpu is None else 1.0)
        if cpu is None:
            return
        total = _family("fastckpt_node_iowait_seconds")
        total.add_metric([], cpu[0])
        ratio = _family("fastckpt_node_iowait_ratio")
        with self._lock:
            prev, self._cpu_prev = self._cpu_prev or (0.0, 0.0), cpu
        d_all = cpu[1] - prev[1]
        ratio.add_metric([], (cpu[0] - prev[0]) / d_all if d_all > 0 else 0.0)
        yield total
        yield ratio

    def _space_families(self, avail: GaugeMetricFamily) -> Iterator[Metric]:
        free, size = _family("fastckpt_filesystem_free_bytes"), _family("fastckpt_filesystem_size_bytes")
        seen: set[tuple[str, str]] = set()
        # the burst buffer itself, not the parent its path climbs to: a local_dir not made yet, not
        # mounted in this container or misspelt would report that parent's (often /) free space
        roles = [("burst_buffer", [d for d in self._bb if os.path.isdir(d)])]
        roles.append(("target", list(self._targets())))
        for role, paths in roles:
            found = False
            for p in paths:
                sp = sysinfo.space(p)
                if sp is None or (role, sp.mountpoint) in seen:
                    found = found or sp is not None
                    continue
                found = True
                seen.add((role, sp.mountpoint))
                if sp.free is None or sp.size is None:  # a ramfs: no limit, unknown, never 0 bytes free
                    continue
                free.add_metric([role, sp.mountpoint], sp.free)
                size.add_metric([role, sp.mountpoint], sp.size)
            avail.add_metric([f"{role}_space"], 1.0 if found else 0.0)
        yield free
        yield size
