"""The scripts of examples/ run as a user runs them (a subprocess, the default root), at a
tiny size, and use only shmcache's public API."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from service_helpers import clean_env

from shmcache._disk.layout import ENV_ROOT

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TINY = {
    "grid_search.py": [
        "--rows",
        "1000",
        "--features",
        "16",
        "--steps",
        "3",
        "--experiments",
        "2",
        "--workers",
        "1",
    ],
    "train_images.py": ["--count", "16", "--steps", "2", "--workers", "1"],
    "train_tokens.py": ["--count", "20000", "--steps", "2", "--workers", "1"],
}
"""Every example, with the flags that make it tiny."""


def _run(name: str, root: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *TINY[name]],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=clean_env({ENV_ROOT: str(root)}),
        timeout=300,
        check=False,
    )


def test_every_example_has_a_tiny_run() -> None:
    assert sorted(path.name for path in EXAMPLES.glob("*.py")) == sorted(TINY)
    assert (EXAMPLES / "cluster" / "README.md").exists()


@pytest.mark.parametrize("name", sorted(TINY))
def test_examples_use_only_the_public_api(name: str) -> None:
    tree = ast.parse((EXAMPLES / name).read_text(encoding="utf-8"))
    modules = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    modules += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    private = [
        m for m in modules if m.startswith("shmcache") and any(p.startswith("_") for p in m.split("."))
    ]
    assert private == [], f"{name} imports private modules"
    assert "shmcache" in modules


@pytest.mark.slow
def test_grid_search_runs_experiments_on_one_cached_copy(root: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    for run in ("first", "second"):  # the second finds the data in the cache
        done = _run("grid_search.py", root, tmp_path)
        assert done.returncode == 0, f"{run} run\n{done.stdout}\n{done.stderr}"
        lines = done.stdout.splitlines()
        assert lines[0].startswith("dataset: (1000, 16) float32"), done.stdout
        assert len([line for line in lines if line.startswith("lr ")]) == 2, done.stdout
    assert (root / "entries" / "grid~" / "x").is_symlink()


@pytest.mark.slow
def test_train_images_decodes_blobs_in_workers(root: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("PIL")
    done = _run("train_images.py", root, tmp_path)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "16 images in 2 classes: ['blue', 'red']" in done.stdout
    assert "step 2: loss" in done.stdout


@pytest.mark.slow
def test_train_tokens_reads_windows_in_workers(root: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    done = _run("train_tokens.py", root, tmp_path)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "20,000 tokens, 312 windows per epoch" in done.stdout, done.stdout
    assert "step 2: loss" in done.stdout
