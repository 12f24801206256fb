"""Prometheus metrics for fastckpt (the optional extra ``fastckpt[metrics]``; docs/metrics.md).

``Checkpointer(metrics_port=9400)`` serves a rank's metrics in the training process;
``fastckpt serve-metrics --event-log events.jsonl --port 9400`` serves them from a running
job's event log. ``FAMILIES`` lists every metric.
"""

from __future__ import annotations

try:
    import prometheus_client  # noqa: F401
except ImportError as exc:  # the optional extra is not installed
    raise ModuleNotFoundError("fastckpt.metrics (metrics_port=, serve-metrics) needs prometheus-client: "
                              "pip install 'fastckpt[metrics]'", name=exc.name) from exc

from .exporter import CheckpointerExporter, LogExporter, MetricsServer, local_rank, start_exporter
from .families import FAMILIES, Family, sample_names

__all__ = ["FAMILIES", "CheckpointerExporter", "Family", "LogExporter", "MetricsServer", "local_rank",
           "sample_names", "start_exporter"]
