"""What every subcommand shares: unit parsing (as click parameter types), human formatting,
JSON or rich-table output, a progress bar, and the exit codes.

Units: sizes and bandwidths are SI unless they say otherwise (GB = 1e9 bytes, GiB = 2**30);
a lower-case ``b`` (or ``bit``) means bits, whatever the prefix's case (``400Gb/s`` = ``400gbps`` =
50 GB/s), and a size in bits is refused. Exit codes: ``PASS`` (0), ``FAIL`` (1,
a target missed or a check failed); bad usage is click's own 2.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from ..units import fmt_bytes, sig

PASS, FAIL = 0, 1

_PREFIXES = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40, "PI": 2**50}
# a prefix in any case, then B (bytes) or b / bit / bits (bits, in any case but a lone B)
_UNIT = re.compile(r"([kmgtp]i?)?(b|bits?)", re.IGNORECASE)
_COUNT_UNITS = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
_DURATION_UNITS = {"ms": 1e-3, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_BANDWIDTH_FORMS = "e.g. bytes as 10GB/s, 10GBps or 2.5GiB/s; bits with a lower-case b as 400Gb/s, 400Gbps or 400Gbit/s"


def _finite(value: float, text: str, what: str) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is too large to be {what}: give a finite number")
    return value


def _unit(unit: str) -> tuple[float, bool] | None:
    """``GB`` -> (1e9, False); ``Gb``, ``gbit``, ``Gibit`` -> (bytes per unit, True); None when
    not a byte or bit unit (``G``, ``Gi``, ``x``)."""
    if unit == "":
        return 1.0, False
    m = _UNIT.fullmatch(unit)
    if m is None:
        return None
    bits = m.group(2) != "B"
    scale = _PREFIXES[(m.group(1) or "").upper()]
    return (scale / 8, True) if bits else (scale, False)


def parse_size(text: str) -> int:
    """``8MiB``, ``1.4TB``, ``4096`` -> bytes (SI for KB/MB/GB/TB, binary for KiB/MiB/GiB).

    Raises:
        ValueError: not a size, a bare ``K``/``M``/``G`` (ambiguous: say ``MB`` or ``MiB``), a
            size in bits (``8Gb``: say ``8GB`` or ``1GB``), or too large to be finite.
    """
    m = re.fullmatch(rf"\s*{_NUMBER}\s*([A-Za-z]*)\s*", str(text))
    unit = _unit(m.group(2)) if m else None
    if unit is not None and unit[1]:
        prefix = _UNIT.fullmatch(m.group(2)).group(1) or ""
        raise ValueError(f"{text!r} is in bits (a lower-case b): write the size in bytes with a capital B, "
                         f"e.g. {m.group(1)}{prefix[:1].upper()}{prefix[1:].lower()}B; "
                         f"{text.strip()} is {fmt_bytes(float(m.group(1)) * unit[0])}")
    if m is None or unit is None:
        raise ValueError(f"cannot read {text!r} as a size: write e.g. 8MiB, 1GiB, 1.4TB (GB = 1e9 bytes)")
    size = _finite(float(m.group(1)) * unit[0], text, "a size")
    if unit[0] == 1 and not size.is_integer():  # '1.4' was 1 byte: a lost unit, not a size
        raise ValueError(f"{text!r} is a fraction of a byte: give whole bytes, or a unit (e.g. {m.group(1)}GB, "
                         f"{m.group(1)}TB; a size with a unit is rounded to the nearest byte)")
    return int(round(size))


def parse_bandwidth(text: str) -> float:
    """``10GB/s``, ``2.5GiB/s`` (bytes); ``400Gb/s``, ``400gbps``, ``400Gbit/s`` (bits, a
    lower-case ``b``; the prefix in any case) -> bytes per second."""
    m = re.fullmatch(rf"\s*{_NUMBER}\s*([A-Za-z]*?)\s*(/s|ps)\s*", str(text))
    unit = _unit(m.group(2)) if m and (m.group(2) or m.group(3) == "/s") else None
    if m is None or unit is None:
        raise ValueError(f"cannot read {text!r} as a bandwidth: write {_BANDWIDTH_FORMS}")
    return _finite(float(m.group(1)) * unit[0], text, "a bandwidth")


def parse_duration(text: str) -> float:
    """``2h``, ``90m``, ``1h30m``, ``60s``, ``500ms``, ``1.5d`` or plain seconds -> seconds."""
    s = str(text).strip().replace(" ", "")
    if re.fullmatch(_NUMBER, s):
        return _finite(float(s), text, "a duration")
    parts = re.findall(rf"{_NUMBER}([a-z]+)", s)
    if not parts or "".join(n + u for n, u in parts) != s or any(u not in _DURATION_UNITS for _, u in parts):
        raise ValueError(f"cannot read {text!r} as a duration: write e.g. 2h, 90m, 1h30m, 60s, 500ms, 30d or plain "
                         "seconds (3600)")
    return _finite(sum(float(n) * _DURATION_UNITS[u] for n, u in parts), text, "a duration")


def parse_count(text: str) -> float:
    """``70B``, ``1.5T``, ``350M``, ``7e9`` -> a count (B and G are 1e9: parameters)."""
    m = re.fullmatch(rf"\s*{_NUMBER}\s*([A-Za-z]?)\s*", str(text))
    if m is None or m.group(2).upper() not in _COUNT_UNITS:
        raise ValueError(f"cannot read {text!r} as a count: write e.g. 70B, 7e9, 1.5T, 350M (K, M, B or G, T: "
                         "1e3, 1e6, 1e9, 1e12)")
    return _finite(float(m.group(1)) * _COUNT_UNITS[m.group(2).upper()], text, "a count")


class Parsed(click.ParamType):
    """A click parameter type over one of the parsers above (errors become exit code 2)."""

    def __init__(self, name: str, parse: Callable[[str], float], positive: bool = False) -> None:
        self.name = name
        self._parse = parse
        self._positive = positive

    def convert(self, value, param, ctx):  # noqa: ANN001, ANN201 (click's signature)
        if not isinstance(value, str):
            return value
        try:
            parsed = self._parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        if self._positive and not parsed > 0:
            self.fail(f"{value!r} must be more than 0", param, ctx)
        return parsed


class _FinitePositive(click.ParamType):
    """A plain number, finite and more than 0 (``inf``, ``nan``, ``1e400`` and ``0`` are refused)."""

    name = "number"

    def convert(self, value, param, ctx):  # noqa: ANN001, ANN201 (click's signature)
        try:
            number = float(value)
        except ValueError:
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number: give e.g. 30 or 0.5", param, ctx)
        if not number > 0:
            self.fail(f"{value!r} must be more than 0", param, ctx)
        return number


class FiniteRange(click.FloatRange):
    """``click.FloatRange`` that also refuses ``nan`` and ``inf`` (a range check lets ``nan``
    through, a ``nan`` threshold passes every comparison); each refusal names the form ``want``."""

    def __init__(self, *bounds: float, want: str, **open_ends: bool) -> None:
        super().__init__(*bounds, **open_ends)
        self.want = want

    def convert(self, value, param, ctx):  # noqa: ANN001, ANN201 (click's signature)
        try:
            number = float(value)
        except ValueError:
            self.fail(f"{value!r} is not a number: give {self.want}", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number: give {self.want}", param, ctx)
        try:
            return super().convert(number, param, ctx)
        except click.BadParameter as exc:  # out of range: click's words, then the form wanted
            self.fail(f"{exc.message.rstrip('.')}: give {self.want}", param, ctx)


# the most a count option takes: far above any real job, and small enough that every later
# sum, product and float conversion stays exact and finite (a 400-digit --gpus overflowed)
MAX_COUNT = 10**9


def count_range(low: int = 1, high: int = MAX_COUNT) -> click.IntRange:
    """An integer option from ``low`` to ``high`` (both included)."""
    return click.IntRange(low, high)


SIZE = Parsed("size", parse_size, positive=True)
SIZE_OR_ZERO = Parsed("size", parse_size)  # 0 turns something off (doctor --probe-size)
BANDWIDTH = Parsed("bandwidth", parse_bandwidth, positive=True)
DURATION = Parsed("duration", parse_duration, positive=True)
DURATION_OR_ZERO = Parsed("duration", parse_duration)  # a wait that may be none (drill --min-run)
FINITE_POSITIVE = _FinitePositive()
OVERHEAD_BUDGET = FiniteRange(0, 1, min_open=True, max_open=True, want="a fraction, e.g. 0.02 for 2 %")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError('must be a JSON object, e.g. \'{"endpoint_url": "http://127.0.0.1:8333"}\'')
    return value


class _Location(click.ParamType):
    """A directory path or a URL fsspec can open (``urls.check_url``): a malformed URL or an
    unknown scheme is a usage error naming it, not a traceback from the storage layer. An empty
    one (an unset shell variable) too: ``latest`` said " does not exist", ``verify`` checked the
    current directory. A local path loses its trailing '/' (``urls.trimmed``)."""

    name = "path_or_url"

    def convert(self, value, param, ctx):  # noqa: ANN001, ANN201 (click's signature)
        from ..errors import ConfigError
        from ..urls import check_url, empty, trimmed

        if empty(value):  # also a bare file://: it would be the working directory
            self.fail("the path is empty: give a directory or a URL (an unset shell variable expands to '', "
                      "and 'file://' alone names no path)", param, ctx)
        try:
            return trimmed(check_url(value))
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


def _storage_options(text: str) -> dict:
    """Inline JSON (``{...}``) or the path of a JSON file, in every command; the value is never
    repeated in an error (it holds secrets)."""
    if text.lstrip().startswith("{"):
        return _json_object(text)
    if not os.path.isfile(text):
        raise ValueError("give a JSON object ('{\"endpoint_url\": \"http://127.0.0.1:8333\"}') or the path of a "
                         "JSON file that holds one (the value is not repeated here: it may hold secrets)")
    try:
        with open(text, encoding="utf-8") as f:
            return _json_object(f.read())
    except OSError as exc:  # unreadable: not "not JSON" (its content was never seen)
        raise ValueError(f"{text} cannot be read ({exc.strerror}): make it readable to this user (owner/mode), "
                         "or pass the options inline") from exc
    except ValueError as exc:  # not JSON, not text
        raise ValueError(f"{text} is not a JSON file ({exc}); write e.g. "
                         '{"endpoint_url": "http://127.0.0.1:8333"}') from exc


LOCATION = _Location()
storage_options_option = click.option(
    "--storage-options", "storage_options", type=Parsed("json_or_file", _storage_options), default=None,
    help="fsspec options for URL targets: a JSON object (e.g. endpoint_url, key, secret) or a JSON file's path; "
         "never printed.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")


# ---------------------------------------------------------------------------- formatting
def fmt_rate(bps: float | None) -> str:
    return "-" if bps is None else fmt_bytes(bps) + "/s"


def fmt_seconds(s: float | None) -> str:
    """``140 s``, ``0.0547 s``, ``2 h``, ``1,400 h``: seconds below an hour, hours above."""
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "-"
    if s == math.inf:
        return "never"
    value, unit = (s / 3600, "h") if abs(s) >= 3600 else (s, "s")
    return f"{value:,.0f} {unit}" if abs(value) >= 100 else f"{value:.3g} {unit}"


def fmt_pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{sig(fraction * 100)} %"


# ---------------------------------------------------------------------------- output
def console() -> Console:
    """Stdout console for tables; wide when not a terminal so piped tables are not cut."""
    c = Console(highlight=False)
    if not c.is_terminal:
        c = Console(highlight=False, width=160)
    return c


def table(title: str | None, columns: list[str], rows: list[list[object]], right_from: int = 1,
          text: tuple[int, ...] = ()) -> Table:
    """A rich table; columns from ``right_from`` on are right-aligned (numbers), except the
    ``text`` ones. Title and cells are shown as written: they hold names users chose, and rich
    would read ``model[best].pt`` as a style (dropped) and ``x[/dim].pt`` as a closing tag
    (a MarkupError)."""
    t = Table(title=None if title is None else escape(title), title_justify="left", show_edge=False)
    for i, c in enumerate(columns):
        t.add_column(escape(c), justify="right" if i >= right_from and i not in text else "left")
    for r in rows:
        t.add_row(*("-" if v is None else escape(str(v)) for v in r))
    return t


def emit_json(data: dict) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def exit_with(passed: bool) -> None:
    """End the command: exit 0 when every check passed, 1 otherwise."""
    raise SystemExit(PASS if passed else FAIL)


def fail_with(message: str) -> None:
    """End the command with exit 1, ``message`` (the problem and the fix) on stderr."""
    click.echo(message, err=True)
    raise SystemExit(FAIL)


def not_a_dir(path: str) -> bool:
    """A local ``path`` that exists and is not a directory: no checkpoint directory or burst
    buffer can be made there (a URL's storage answers for itself)."""
    from ..urls import is_url, local_path

    return not is_url(path) and os.path.exists(local_path(path)) and not os.path.isdir(local_path(path))


def file_in_the_way(path: str) -> str | None:
    """The file that keeps a local ``path`` from being a directory: ``path`` itself, or the
    nearest existing ancestor when that is a file (``FILE/sub``: ``FILE``); None for a URL."""
    from ..errors import blocking_file
    from ..urls import is_url, local_path

    found = None if is_url(path) else blocking_file(local_path(path))
    return found if found is not None and os.path.exists(found) else None  # a link to nothing is no file


def must_exist(path: str) -> None:
    """Exit 1 naming a local ``path`` that does not exist (a URL's storage answers for itself)."""
    from ..urls import is_url, local_path

    if not is_url(path) and not os.path.exists(local_path(path)):
        fail_with(f"{path} does not exist: check the path (no checkpoint was saved there yet)")


class _Bar:
    def __init__(self, progress: Progress | None, task: int | None) -> None:
        self._p, self._task = progress, task

    def advance(self, n: float = 1) -> None:
        if self._p is not None:
            self._p.advance(self._task, n)

    def update(self, completed: float, description: str | None = None) -> None:
        if self._p is not None:
            kw = {"description": description} if description else {}
            self._p.update(self._task, completed=completed, **kw)


@contextmanager
def progress(description: str, total: float | None, enabled: bool = True) -> Iterator[_Bar]:
    """A progress bar on stderr (stdout stays clean for --json); silent when not a terminal."""
    err = Console(stderr=True)
    if not enabled or not err.is_terminal:
        yield _Bar(None, None)
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=err, transient=True) as p:
        yield _Bar(p, p.add_task(escape(description), total=total))  # it may name a --dir: shown as written


def warn(message: str) -> None:
    click.echo(message, err=True)
