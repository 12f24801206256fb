"""Scraping a fastckpt exporter over HTTP the way Prometheus does, for the metrics tests."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Exposition text -> {(sample name, sorted labels): value}; fails on a repeated series."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"series {key} appears twice"
            out[key] = s.value
    return out


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        return parse(resp.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The one sample named ``name`` whose labels include ``labels`` (None if absent)."""
    hits = [v for (n, lab), v in samples.items() if n == name and set(labels.items()) <= set(lab)]
    assert len(hits) <= 1, f"{name}{labels} matches {len(hits)} series"
    return hits[0] if hits else None


def names(samples: Samples) -> set[str]:
    return {n for n, _ in samples}
