"""examples/grafana/fastckpt.json parses and queries only metrics the exporter defines."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")
from fastckpt.metrics import FAMILIES, sample_names  # noqa: E402

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "fastckpt.json"
METRIC = re.compile(r"\bfastckpt_[a-z0-9_]+")
LABEL = re.compile(r"(?:by \(|{|,\s*)([a-z_]+)\s*(?:=~|!=|=|[,)])")


def _queries(dash: dict) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    out += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    return out


def test_dashboard_parses_and_uses_only_defined_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    used = {m for q in _queries(dash) for m in METRIC.findall(q)}
    assert used, "the dashboard queries no fastckpt metric"
    assert used - sample_names() == set()
    labels = {lab for f in FAMILIES for lab in f.labels} | {"le", "instance", "job"}
    for q in _queries(dash):
        assert set(LABEL.findall(q)) - labels == set(), q


def test_dashboard_has_the_operator_panels() -> None:
    dash = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"] for p in dash["panels"])
    for want in ("Stall per checkpoint", "overhead vs budget", "Replication lag", "Bandwidth", "SMART wear"):
        assert want.lower() in titles.lower(), titles
    overhead = next(p for p in dash["panels"] if "overhead vs budget" in p["title"].lower())
    steps = overhead["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["value"] for s in steps] == [None, 0.02]  # the 2 % line
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_the_metrics_page_lists_every_metric() -> None:
    page = (DASHBOARD.parents[2] / "docs" / "metrics.md").read_text()
    for f in FAMILIES:
        name = f.name + ("_total" if f.kind == "counter" else "")
        assert f"| `{name}` | {f.kind} |" in page, name
