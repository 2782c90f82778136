"""Every ```python block of the README and of docs/ runs as written, alone, twice.

Each block is a program of its own (its own imports, the data it uses made in it): it
runs in a fresh interpreter with a fresh cache root as ``$SHMCACHE_ROOT`` and an empty
working directory, then **again** in another fresh interpreter against the same root and
directory, as a reader who runs a copied snippet twice would (a put that repeats needs
``overwrite=True``). A traceback names the document and its line.

On the lines before a fence (blank lines between are fine), HTML comments can say:

- ``<!-- not-run: why -->``: the block is not meant to run (keep these few);
- ``<!-- needs: daemon -->``: ``shmcache serve`` runs on the root while the block runs;
- ``<!-- needs: gpu -->``: skipped without CUDA;
- ``<!-- requires: arrow -->``: the extra (or test package) the block imports, comma
  separated; skipped cleanly where it is not installed. A block that imports anything
  beyond the standard library, numpy and shmcache's core must name it (checked below);
- ``<!-- leaves: /dev/shm/NAME-{uid} -->``: a path outside the root that the block makes by
  an API's default (python-sharearray's ``/dev/shm``); removed after the runs where it did
  not exist before them, so that no test run leaves it on the machine.

Any other comment there is a mistake (a misspelt mark would silently change nothing).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest
from service_helpers import clean_env, running_daemon

from shmcache._disk.layout import ENV_ROOT

REPO = Path(__file__).resolve().parents[1]
ROOT_DOCS = ("README.md", "ARCHITECTURE.md", "BENCHMARKS.md", "SECURITY.md")
PYTHON = {"python", "py", "python3"}
NEEDS = {"daemon", "gpu"}
REQUIRES: dict[str, tuple[str, ...]] = {
    # extra (pyproject.toml) or test package -> the modules it brings
    "torch": ("torch",),
    "arrow": ("pyarrow", "pandas"),
    "hdf5": ("h5py",),
    "plot": ("matplotlib",),
    "service": ("fastapi", "uvicorn"),
    "s3": ("s3fs",),
    "pillow": ("PIL",),
    "safetensors": ("safetensors",),
    "ml_dtypes": ("ml_dtypes",),
    "datasets": ("datasets", "pyarrow"),
}
"""What ``<!-- requires: NAME -->`` may name, and the modules each makes importable."""
BASE_MODULES = {"numpy", "shmcache"}
"""What any block may import without a mark: shmcache's base install."""
SUBMODULE_NEEDS = {"shmcache.torch": "torch", "shmcache.service": "service"}

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>`{3,})\s*(?P<lang>[^\s`]*)")
_COMMENT = re.compile(r"^\s*<!--(?P<body>.*?)-->\s*$")
_MARK = re.compile(r"^\s*(?P<name>not-run|needs|requires|leaves)\s*:\s*(?P<value>.*?)\s*$")


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

    @property
    def requires(self) -> list[str]:
        return [name.strip() for name in self.marks.get("requires", "").split(",") if name.strip()]

    @property
    def where(self) -> str:
        path = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{path}:{self.line}"


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
                    f"{where}: before a python block, write <!-- not-run: why -->, <!-- needs: daemon -->, "
                    "<!-- needs: gpu -->, <!-- requires: EXTRA --> or <!-- leaves: PATH -->, not "
                    f"{lines[i].strip()}"
                )
            if mark["name"] == "needs" and mark["value"] not in NEEDS:
                raise ValueError(
                    f"{where}: unknown need {mark['value']!r} (known: {', '.join(sorted(NEEDS))})"
                )
            if mark["name"] == "requires":
                unknown = [n.strip() for n in mark["value"].split(",") if n.strip() not in REQUIRES]
                if unknown:
                    raise ValueError(f"{where}: unknown requirement {unknown} (known: {', '.join(REQUIRES)})")
            marks[mark["name"]] = mark["value"]
        i -= 1
    return marks


def documents() -> list[Path]:
    """The README, the other top-level documents and every page under docs/."""
    return [REPO / name for name in ROOT_DOCS if (REPO / name).exists()] + sorted(
        (REPO / "docs").rglob("*.md")
    )


@cache
def all_blocks() -> tuple[Block, ...]:
    return tuple(block for path in documents() for block in python_blocks(path))


def _runnable() -> list[Block]:
    return [block for block in all_blocks() if block.runs]


def _imported_modules(code: str) -> set[str]:
    """Every module an import statement of ``code`` names (``a.b`` gives ``a`` and ``a.b``)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        modules = (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [node.module]
            if isinstance(node, ast.ImportFrom) and node.module and not node.level
            else []
        )
        for module in modules:
            parts = module.split(".")
            names.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return names


def missing_marks(block: Block) -> list[str]:
    """Modules ``block`` imports that neither the base install nor its ``requires`` mark provide."""
    provided = set(BASE_MODULES) | {m for name in block.requires for m in REQUIRES[name]}
    missing = []
    for module in sorted(_imported_modules(block.code)):
        top = module.split(".")[0]
        need = SUBMODULE_NEEDS.get(module)
        if need is not None and need not in block.requires:
            missing.append(f"{module} (requires: {need})")
        elif "." not in module and top not in provided and top not in sys.stdlib_module_names:
            missing.append(module)
    return missing


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.slow
@pytest.mark.parametrize("block", _runnable(), ids=lambda b: b.where)
def test_python_block_runs_twice_alone(block: Block, root: Path, tmp_path: Path) -> None:
    for name in block.requires:
        for module in REQUIRES[name]:
            pytest.importorskip(module, reason=f"{block.where} requires the {name!r} extra")
    if block.marks.get("needs") == "gpu" and not _cuda_available():
        pytest.skip(f"{block.where} needs a GPU")
    needs_daemon = block.marks.get("needs") == "daemon"
    if needs_daemon:
        pytest.importorskip("fastapi", reason="shmcache serve needs the service extra")
    code = "\n" * (block.line - 1) + block.code  # tracebacks give the document's line numbers
    run_block = f"exec(compile({code!r}, {str(block.path)!r}, 'exec')); print({_BLOCK_DONE!r}, flush=True)"
    left = Path(block.marks["leaves"].format(uid=os.geteuid())) if "leaves" in block.marks else None
    cleaned = None if left is None or left.exists() else left
    with running_daemon(root) if needs_daemon else nullcontext(), _removed_after(cleaned):
        for run in ("first", "second"):
            done = subprocess.run(
                [sys.executable, "-c", run_block],
                capture_output=True,
                text=True,
                cwd=tmp_path,
                env=clean_env({ENV_ROOT: str(root)}),
                timeout=300,
                check=False,
            )
            if _arrow_exit_abort(done):
                continue  # the block ran to its end; pyarrow aborted in interpreter teardown
            assert done.returncode == 0, f"{block.where}: the {run} run failed\n{done.stdout}\n{done.stderr}"
            assert done.stdout.endswith(_BLOCK_DONE + "\n"), done.stdout


_BLOCK_DONE = "<<the block ran to its end>>"


@contextmanager
def _removed_after(path: Path | None) -> Iterator[None]:
    try:
        yield
    finally:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)


def _arrow_exit_abort(done: subprocess.CompletedProcess[str]) -> bool:
    """pyarrow's known abort at interpreter exit (a joinable C++ pool thread destroyed in
    teardown; apache/arrow#34314, seen once in a loaded full run on a pandas/Parquet block)
    after the block printed that it ran to its end: not the block's failure. Any other exit
    status, or one before the end, fails the test."""
    return (
        done.returncode == -signal.SIGABRT
        and done.stdout.endswith(_BLOCK_DONE + "\n")
        and done.stderr.strip() == "terminate called without an active exception"
    )


def test_every_block_names_what_it_imports() -> None:
    unmarked = {block.where: missing_marks(block) for block in _runnable() if missing_marks(block)}
    assert unmarked == {}, "add <!-- requires: EXTRA --> before these blocks"


def test_the_readme_has_python_blocks_and_few_exceptions() -> None:
    blocks = python_blocks(REPO / "README.md")
    assert len([b for b in blocks if b.runs]) >= 4
    skipped = [b for b in blocks if not b.runs]
    assert len(skipped) <= 2, [f"{b.where}: {b.marks['not-run']}" for b in skipped]


def quick_start_installs(readme: str) -> set[str]:
    """The extras and packages the first ``pip install`` of the README's Quick start installs."""
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    line = next(line for line in section.splitlines() if "pip install" in line)
    words = shlex.split(line.split("pip install", 1)[1].split("&&", 1)[0])
    installed: set[str] = set()
    for word in words:
        extras = re.fullmatch(r"\.\[(?P<extras>[^\]]*)\]", word)
        if extras:
            installed.update(name.strip() for name in extras["extras"].split(","))
        elif not word.startswith("-"):
            installed.add(re.split(r"[<>=\[]", word)[0])
    return installed


def test_the_quick_start_installs_what_the_readme_blocks_need() -> None:
    installed = quick_start_installs((REPO / "README.md").read_text(encoding="utf-8"))
    needed = {name for block in python_blocks(REPO / "README.md") if block.runs for name in block.requires}
    needed |= (
        {"service"}
        if any(b.marks.get("needs") == "daemon" for b in python_blocks(REPO / "README.md"))
        else set()
    )
    assert needed - installed == set(), (
        f"the Quick start's pip install line lacks {sorted(needed - installed)}"
    )


def test_the_collector_reads_fences_and_marks(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    text = textwrap.dedent("""\
        # Title

        ```python
        a = 1
        ```

        <!-- not-run: needs a cluster -->
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

          <!-- requires: arrow, torch -->
          <!-- needs: gpu -->
          ```python
          import pandas, torch
          import shmcache.torch
          ```
        """)
    blocks = python_blocks(doc, text)
    assert [(b.line, b.runs, b.marks) for b in blocks] == [
        (4, True, {}),
        (9, False, {"not-run": "needs a cluster"}),
        (19, True, {"needs": "daemon"}),
        (29, True, {"requires": "arrow, torch", "needs": "gpu"}),
    ]
    assert blocks[2].code == "b = a + 1\n```\nstill code\n"
    assert blocks[3].code == "import pandas, torch\nimport shmcache.torch\n" and blocks[3].requires == [
        "arrow",
        "torch",
    ]
    assert missing_marks(blocks[3]) == []
    assert missing_marks(
        Block(doc, 1, "import os, numpy\nimport pandas\nfrom shmcache.torch import pin\n")
    ) == [
        "pandas",
        "shmcache.torch (requires: torch)",
    ]
    for bad in ("<!-- not-run -->", "<!-- notrun: x -->", "<!-- needs: tpu -->", "<!-- requires: arow -->"):
        with pytest.raises(ValueError, match=re.escape("doc.md:1:")):
            python_blocks(doc, f"{bad}\n```python\nx = 1\n```\n")


def test_the_quick_start_line_is_parsed() -> None:
    line = "python3 -m venv .venv && .venv/bin/pip install torch -e '.[service,arrow]' && x"
    readme = f"## Quick start\n\n```bash\n{line}\n```\n"
    assert quick_start_installs(readme) == {"torch", "service", "arrow"}


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_links_resolve() -> None:
    """README.md is not part of the site (whose build checks its own links): its relative links
    must name files of the repository, and its anchors headings of those files."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\((?!https?:)([^)#\s]*)(?:#([^)\s]+))?\)", readme)
    assert len(links) > 10
    for target, anchor in links:
        path = REPO / (target or "README.md")
        assert path.exists(), f"README.md links to {target}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.MULTILINE)
            assert anchor in {github_anchor(h) for h in headings}, f"no heading of {target} has #{anchor}"
