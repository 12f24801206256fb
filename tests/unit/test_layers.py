"""The package's layers import only downward, and nothing imports in a circle.

Folders are layers (docs/architecture.md): checkpointer -> save/, load/ -> commit/ ->
storage/ -> io/ -> format/; metrics/ (an event sink the Checkpointer starts) sits beside save/
and load/; the base modules (errors, urls, units, version, config, records, events, onesave,
monitor, inflight, and the observability helpers eventlog, replay, runstate, sysinfo, progress) sit below them all
and import no layer. report/, doctor/, cli/ and testing sit on top.
Imports under ``if TYPE_CHECKING:`` are for annotations only and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fastckpt

PKG = Path(fastckpt.__file__).parent
BASE = {"errors", "urls", "units", "version", "config", "records", "events", "onesave", "monitor", "inflight", "exits",
        "eventlog", "replay", "runstate", "sysinfo", "progress"}
RANK = {"format": 1, "io": 2, "storage": 3, "commit": 4, "save": 5, "load": 5, "metrics": 5, "checkpointer": 6,
        "__init__": 7, "testing": 7, "report": 7, "doctor": 7, "cli": 8, "__main__": 9}


def _module(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    return ".".join(("fastckpt", *rel.parts)).removesuffix(".__init__")


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _rank(module: str) -> int:
    layer = _layer(module)
    return 0 if layer in BASE else RANK[layer]


def _runtime_imports(path: Path) -> set[str]:
    """fastckpt modules ``path`` imports at run time (not under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    pkg = _module(path) if path.name == "__init__.py" else _module(path).rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if _is_module(f"{mod}.{a.name}")]
            names = subs if len(subs) == len(node.names) else [mod, *subs]  # `from . import x` names x
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out.update(n for n in names if _is_module(n))
    return {m for m in out if m.startswith("fastckpt") and m != "fastckpt.integrations"}


def _is_module(name: str) -> bool:
    path = PKG.parent / name.replace(".", "/")
    return name.startswith("fastckpt") and (path.with_suffix(".py").exists() or (path / "__init__.py").exists())


def _graph() -> dict[str, set[str]]:
    return {_module(p): _runtime_imports(p) for p in PKG.rglob("*.py")}


def test_no_layer_imports_a_higher_one() -> None:
    upward = []
    for mod, deps in _graph().items():
        for dep in deps:
            if dep == "fastckpt" and _layer(mod) in ("cli",):
                continue  # the CLI uses the public API
            if _rank(dep) > _rank(mod):
                upward.append(f"{mod} -> {dep}")
    assert upward == []


def test_save_and_load_are_independent() -> None:
    crossing = [f"{m} -> {d}" for m, deps in _graph().items() for d in deps
                if {_layer(m), _layer(d)} == {"save", "load"}]
    assert crossing == []


def test_no_import_cycles() -> None:
    graph = _graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep not in graph:
                continue
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert cycles == []


def test_modules_stay_small() -> None:
    big = {_module(p): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 360}
    assert big == {}
