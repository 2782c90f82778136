"""Every ```python block of the docs runs as written.

The blocks of one document run in order in one fresh interpreter and one namespace (a
reader pasting them one after another), with a fresh cache root as ``$SHMCACHE_ROOT``
and an empty working directory, so each block makes the data it uses. A traceback names
the document and its line.

On the line before a fence (blank lines between are fine), an HTML comment can say:

- ``<!-- not-run: why -->``: the block is not meant to run (keep these few);
- ``<!-- needs: daemon -->``: ``shmcache serve`` runs on the root while the document's blocks run.

Any other comment there is a mistake (a misspelt mark would silently change nothing).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from service_helpers import clean_env, running_daemon

from shmcache._disk.layout import ENV_ROOT

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "ARCHITECTURE.md", "BENCHMARKS.md")
PYTHON = {"python", "py", "python3"}
NEEDS = {"daemon"}

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>`{3,})\s*(?P<lang>[^\s`]*)")
_COMMENT = re.compile(r"^\s*<!--(?P<body>.*?)-->\s*$")
_MARK = re.compile(r"^\s*(?P<name>not-run|needs)\s*:\s*(?P<value>.*?)\s*$")
_RUN = """\
import json, sys
namespace = {"__name__": "__main__"}
for path, line, code in json.load(sys.stdin):
    exec(compile("\\n" * (line - 1) + code, path, "exec"), namespace)
"""


@dataclass(frozen=True)
class Block:
    """One fenced python block: where its code starts (1-based) and the marks before it."""

    path: Path
    line: int
    code: str
    marks: dict[str, str] = field(default_factory=dict)

    @property
    def runs(self) -> bool:
        return "not-run" not in self.marks


def python_blocks(path: Path, text: str | None = None) -> list[Block]:
    """The python blocks of a markdown document, with their marks."""
    lines = (path.read_text(encoding="utf-8") if text is None else text).splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        ticks = opening["ticks"]
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks), len(lines))
        if opening["lang"].lower() in PYTHON:
            code = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
            blocks.append(Block(path, i + 2, code, _marks_before(path, lines, i)))
        i = end + 1
    return blocks


def _marks_before(path: Path, lines: list[str], fence: int) -> dict[str, str]:
    marks: dict[str, str] = {}
    i = fence - 1
    while i >= 0 and (not lines[i].strip() or _COMMENT.match(lines[i])):
        comment = _COMMENT.match(lines[i])
        if comment:
            mark = _MARK.match(comment["body"])
            where = f"{path.name}:{i + 1}"
            if mark is None or not mark["value"]:
                raise ValueError(
                    f"{where}: before a python block, write <!-- not-run: why --> or "
                    f"<!-- needs: daemon -->, not {lines[i].strip()}"
                )
            if mark["name"] == "needs" and mark["value"] not in NEEDS:
                raise ValueError(f"{where}: unknown need {mark['value']!r} (known: {', '.join(NEEDS)})")
            marks[mark["name"]] = mark["value"]
        i -= 1
    return marks


def _runnable(name: str) -> list[Block]:
    path = REPO / name
    return [b for b in python_blocks(path) if b.runs] if path.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in DOCS if _runnable(name)])
def test_python_blocks_run_in_order(name: str, root: Path, tmp_path: Path) -> None:
    blocks = _runnable(name)
    payload = json.dumps([[str(b.path), b.line, b.code] for b in blocks])
    needs_daemon = any(b.marks.get("needs") == "daemon" for b in blocks)
    if needs_daemon:
        pytest.importorskip("fastapi", reason="shmcache serve needs the service extra")
    with running_daemon(root) if needs_daemon else nullcontext():
        done = subprocess.run(
            [sys.executable, "-c", _RUN],
            input=payload,
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=clean_env({ENV_ROOT: str(root)}),
            timeout=300,
            check=False,
        )
    assert done.returncode == 0, f"{name}: a block failed\n{done.stdout}\n{done.stderr}"


def test_the_readme_has_python_blocks_and_few_exceptions() -> None:
    blocks = python_blocks(REPO / "README.md")
    assert len([b for b in blocks if b.runs]) >= 5
    skipped = [b for b in blocks if not b.runs]
    assert len(skipped) <= 2, [f"README.md:{b.line}: {b.marks['not-run']}" for b in skipped]


def test_the_collector_reads_fences_and_marks(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    text = textwrap.dedent("""\
        # Title

        ```python
        a = 1
        ```

        <!-- not-run: needs a GPU -->
        ```python
        import cuda_thing
        ```

        ```bash
        echo not python
        ```

        <!-- needs: daemon -->

        ````py
        b = a + 1
        ```
        still code
        ````

        - a list item:

          ```python
          c = 3
          ```
        """)
    blocks = python_blocks(doc, text)
    assert [(b.line, b.runs, b.marks) for b in blocks] == [
        (4, True, {}),
        (9, False, {"not-run": "needs a GPU"}),
        (19, True, {"needs": "daemon"}),
        (27, True, {}),
    ]
    assert blocks[2].code == "b = a + 1\n```\nstill code\n" and blocks[3].code == "c = 3\n"
    for bad in ("<!-- not-run -->", "<!-- notrun: x -->", "<!-- needs: gpu -->"):
        with pytest.raises(ValueError, match=re.escape("doc.md:1:")):
            python_blocks(doc, f"{bad}\n```python\nx = 1\n```\n")
