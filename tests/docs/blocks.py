"""The code blocks of README.md, docs/*.md and examples/*/README.md, found by Sybil's Markdown lexer.

Every fenced block either runs or says why not:

* a ```python block runs as a script, a ```bash (or ```sh) block as a ``bash -e -o pipefail``
  script, each in a fresh temporary directory (its working directory) and in its own process,
  as a user who pastes it into a file would run it (a Python block's process is forked from one
  that imported torch and fastckpt, with the block's environment: ``run``);
* a block on the line after ``<!-- skip: reason -->`` is not run, and the test is skipped with
  that reason (sample output, a GPU, several nodes, a Megatron-LM checkout...);
* any other block (untagged, ```text ...) without a skip marker fails: tag it and run it, or
  mark it.

A block that names an ``s3://`` URL runs against the test SeaweedFS server
(``tests/conftest_s3.py``): ``AWS_ENDPOINT_URL`` and the keys are in its environment, and the
buckets it names exist (a block says ``s3://bucket/...`` as a user would), emptied before the
first block of each page that names them: a page's later blocks see what its earlier ones
saved, as a reader going down the page would (a restore after a save).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from sybil import Document, Region, Sybil
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

from tests.integration._fork_server import ForkServer

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = {"python": "python", "bash": "bash", "sh": "bash"}
SKIP = re.compile(r"<!--\s*skip:\s*(?P<reason>.+?)\s*-->\s*$")
BUCKET = re.compile(r"s3://(?P<bucket>[a-z0-9][a-z0-9.-]{2,62})(?=[/\"'\s)]|$)")
TIMEOUT_S = 280  # under pytest-timeout's 300 s, so the block's own output is reported


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its info string's language, its text, the skip reason."""

    doc: str
    line: int
    language: str
    source: str
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def runner(self) -> str | None:
        return RUNNABLE.get(self.language)

    @property
    def buckets(self) -> list[str]:
        """S3 buckets the block names (created, empty, on the test server before it runs)."""
        return sorted({m["bucket"] for m in BUCKET.finditer(self.source)})


def _skip_reason(document: Document, start: int) -> str | None:
    before = document.text[:start].rstrip("\n").rsplit("\n", 1)[-1]
    m = SKIP.match(before.strip())
    return m["reason"] if m else None


def _blocks(document: Document) -> list[Region]:
    lexer = RawFencedCodeBlockLexer(info_pattern=re.compile(r"(?P<language>[^\n]*)$\n", re.MULTILINE))
    regions = []
    for region in lexer(document):
        line = document.text.count("\n", 0, region.start) + 1
        region.parsed = Block(os.path.relpath(document.path, ROOT), line, region.lexemes["language"].strip(),
                              str(region.lexemes["source"]), _skip_reason(document, region.start))
        region.evaluator = _not_evaluated_here
        regions.append(region)
    return regions


def _not_evaluated_here(example: object) -> None:
    raise NotImplementedError("blocks run through tests/docs/test_docs_blocks.py, not Sybil's evaluators")


SYBIL = Sybil(parsers=[_blocks], path=str(ROOT))


def doc_files() -> list[Path]:
    """The Markdown files whose blocks the suite runs."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*/README.md"))]


def all_blocks() -> list[Block]:
    return [ex.parsed for f in doc_files() for ex in SYBIL.parse(f).examples()]


def shims(bin_dir: Path) -> Path:
    """``python``, ``fastckpt`` and ``torchrun`` for blocks, all this interpreter (a copied
    virtual environment's console scripts may point at another interpreter)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    for name, cmd in (("python", f'"{py}"'), ("python3", f'"{py}"'), ("fastckpt", f'"{py}" -m fastckpt.cli'),
                      ("torchrun", f'"{py}" -m torch.distributed.run')):
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec {cmd} "$@"\n')
        path.chmod(0o755)
    return bin_dir


def run(block: Block, cwd: Path, env: dict[str, str], python: ForkServer) -> subprocess.CompletedProcess[str]:
    """Run ``block`` as a script in ``cwd``; stdout and stderr together in ``.stdout``. A Python
    block runs as ``python block.py`` would, forked from ``python``, a process that imported torch
    and fastckpt once (about 2 s of CPU a block on CI's 2 cores: the imports, not the block)."""
    if block.runner == "python":
        script = cwd / "block.py"
        script.write_text(block.source)
        done = python.run_script(str(script), str(cwd), env, TIMEOUT_S)
        return subprocess.CompletedProcess(done.args, done.returncode, done.stdout + done.stderr)
    script, argv = cwd / "block.sh", ["bash", "-e", "-o", "pipefail", "block.sh"]
    script.write_text(block.source)
    return subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=TIMEOUT_S, check=False)
