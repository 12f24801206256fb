"""The report as one self-contained HTML page: the summary and the figure embedded as base64."""

from __future__ import annotations

import base64
import dataclasses
import html
import json

from .summary import Summary

_STYLE = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:80em}"
          "pre{background:#f6f6f6;padding:1em;white-space:pre-wrap}img{max-width:100%}")


def html_page(summary: Summary, png: bytes | None) -> str:
    """The page: title, text summary, the PNG inline (when drawn) and the JSON numbers."""
    parts = ["<!DOCTYPE html>", "<html><head><meta charset=\"utf-8\"><title>fastckpt report</title>",
             f"<style>{_STYLE}</style></head><body>", "<h1>fastckpt report</h1>",
             f"<p>{html.escape(', '.join(summary.logs))}</p>", f"<pre>{html.escape(summary.text())}</pre>"]
    if png is not None:
        b64 = base64.b64encode(png).decode("ascii")
        parts.append(f"<img alt=\"save phases, overhead and per-save times\" src=\"data:image/png;base64,{b64}\">")
    numbers = json.dumps(dataclasses.asdict(summary), indent=2, sort_keys=True)
    parts += ["<h2>Numbers</h2>", f"<pre id=\"summary-json\">{html.escape(numbers)}</pre>", "</body></html>"]
    return "\n".join(parts) + "\n"
