"""Every metric fastckpt exports: name, type, labels and meaning, defined once.

The exporter builds its metrics from this table, docs/metrics.md describes it, and the
dashboard test checks that ``examples/grafana/fastckpt.json`` queries only these names.
Names follow Prometheus' conventions: a ``fastckpt_`` prefix, base units in the name
(``_seconds``, ``_bytes``, ``_ratio``), ``_total`` on counters.
"""

from __future__ import annotations

from dataclasses import dataclass

RANK_TIER = ("rank", "tier")
#: Histogram buckets for phase durations: 1 ms to 10 min.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)


@dataclass(frozen=True)
class Family:
    """One metric family. ``kind`` is counter, gauge or histogram; ``node`` families describe the
    machine (exported once per node), the others one rank's Checkpointer."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...] = ()
    node: bool = False

    def samples(self) -> tuple[str, ...]:
        """The sample names a scrape shows for this family (prometheus-client's exposition)."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count", f"{self.name}_created")
        if self.kind == "counter":
            return (f"{self.name}_total", f"{self.name}_created")
        return (self.name,)


def _h(name: str, help: str) -> Family:
    return Family(name, "histogram", help, RANK_TIER)


FAMILIES: tuple[Family, ...] = (
    # from events: one rank's saves, by tier (a load's "tier" is where it read from)
    _h("fastckpt_save_blocked_seconds", "Time the training thread was blocked by a save (the snapshot phase; a "
                                         "lazy save's fence() wait too, as stats() counts it)."),
    _h("fastckpt_save_write_seconds", "Time to write and fsync a checkpoint file in its first location."),
    _h("fastckpt_save_commit_seconds", "Time to rename a written file into place and fsync its directory."),
    _h("fastckpt_save_durable_seconds", "Time from the save call until the file was durable at its path."),
    _h("fastckpt_group_commit_seconds", "Time of a group commit that published, from this rank's commit() to "
                                         "published (a failed one is counted in fastckpt_failures_total)."),
    _h("fastckpt_replicate_seconds", "Time to copy a committed burst-buffer file to its path and verify it."),
    _h("fastckpt_load_seconds", "Time of a load, from the call to the deserialised state (the RTO)."),
    Family("fastckpt_saves", "counter", "Saves (snapshots taken; the files of a one_save() block: one).",
           RANK_TIER),
    Family("fastckpt_saved_bytes", "counter", "Bytes of checkpoint files committed in their first location.",
           RANK_TIER),
    Family("fastckpt_replicated_bytes", "counter", "Bytes replicated from the burst buffer to their paths.",
           RANK_TIER),
    Family("fastckpt_loaded_bytes", "counter", "Bytes of checkpoint files loaded.", RANK_TIER),
    Family("fastckpt_failures", "counter", "Failed phases, by phase and exception type.",
           ("rank", "tier", "phase", "error")),
    Family("fastckpt_retries", "counter", "Transient storage errors retried, by exception type.",
           ("rank", "tier", "error")),
    Family("fastckpt_write_bandwidth_bytes_per_second", "gauge", "Bandwidth of the last file write.", RANK_TIER),
    Family("fastckpt_replicate_bandwidth_bytes_per_second", "gauge", "Bandwidth of the last replication.",
           RANK_TIER),
    Family("fastckpt_last_save_blocked_seconds", "gauge", "Blocked time of the last save (stall per checkpoint; "
           "a lazy save's with its fence() wait).", RANK_TIER),
    Family("fastckpt_last_save_timestamp_seconds", "gauge", "Unix time of the last save call.", RANK_TIER),
    # from the Checkpointer's stats() (or, for serve-metrics, replayed from its log)
    Family("fastckpt_overhead_ratio", "gauge", "Blocked time / wall time: window=run since the start, "
           "window=sliding over overhead_window_s.", ("rank", "window")),
    Family("fastckpt_overhead_budget_ratio", "gauge", "The overhead budget (overhead_budget).", ("rank",)),
    Family("fastckpt_overhead_alarm", "gauge", "1 if the overhead was above the budget at the last save's check, "
           "else 0 (the ratios are as of the scrape).", ("rank",)),
    Family("fastckpt_overhead_alarms", "counter", "Times the overhead crossed above the budget.", ("rank",)),
    Family("fastckpt_pending_saves", "gauge", "Saves, commits and replications not finished yet.", ("rank",)),
    Family("fastckpt_replication_pending_saves", "gauge", "Checkpoints waiting for or in replication.", ("rank",)),
    Family("fastckpt_replication_lag_seconds", "gauge", "Age of the oldest checkpoint waiting for replication "
           "(0 when none waits).", ("rank",)),
    Family("fastckpt_rpo_seconds", "gauge", "Training a node loss would cost now: seconds since the newest "
           "durable checkpoint's save: replicated with a burst buffer, else at its path; a group's files once the "
           "group is published (absent before the first one).", ("rank",)),
    # storage health of the node
    Family("fastckpt_health_source_available", "gauge", "1 when a storage-health source could be read, 0 when "
           "it is absent (its series are then absent, never zero).", ("source",), node=True),
    Family("fastckpt_nvme_temperature_celsius", "gauge", "NVMe composite temperature (SMART).", ("device",), True),
    Family("fastckpt_nvme_percentage_used_ratio", "gauge", "NVMe endurance used (SMART percentage used / 100; "
           "may exceed 1).", ("device",), True),
    Family("fastckpt_nvme_data_written_bytes", "counter", "Bytes the host wrote to the NVMe device (SMART data "
           "units written x 512000).", ("device",), True),
    Family("fastckpt_nvme_media_errors", "counter", "Unrecovered media errors (SMART).", ("device",), True),
    Family("fastckpt_nvme_write_amplification_ratio", "gauge", "Media writes / host writes, where the device "
           "reports media writes.", ("device",), True),
    Family("fastckpt_node_iowait_seconds", "counter", "CPU time spent waiting for I/O, all CPUs (/proc/stat).",
           (), True),
    Family("fastckpt_node_iowait_ratio", "gauge", "Share of CPU time in I/O wait since the previous scrape.",
           (), True),
    Family("fastckpt_filesystem_free_bytes", "gauge", "Free bytes (for unprivileged users) of the burst buffer's "
           "and of POSIX targets' filesystems (none for one that reports no size: a ramfs has no limit).",
           ("role", "mountpoint"), True),
    Family("fastckpt_filesystem_size_bytes", "gauge", "Size of those filesystems.", ("role", "mountpoint"), True),
)

BY_NAME = {f.name: f for f in FAMILIES}


def sample_names() -> frozenset[str]:
    """Every sample name the exporter can show."""
    return frozenset(n for f in FAMILIES for n in f.samples())
