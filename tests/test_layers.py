"""The layer picture of ARCHITECTURE.md, checked: no import cycle among the package's
modules, and no import (top-level, lazy, or type-only) pointing to a higher layer."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Where each installed package's modules live in the checkout (pyproject's package-dir).
PACKAGE_DIRS = {
    "shmcache": REPO / "shmcache",
    "shmcache.service": REPO / "service",
    "shmcache.client": REPO / "client",
}

# Lowest first; a module may import its own layer and the layers below it.
LAYERS: list[list[str]] = [
    ["shmcache.errors", "shmcache._units", "shmcache._error_table"],
    ["shmcache._disk"],
    ["shmcache._team"],
    ["shmcache._containers"],
    ["shmcache._store"],
    ["shmcache._control", "shmcache._api"],
    ["shmcache", "shmcache.torch", "shmcache._cuda", "shmcache.compat"],
    ["shmcache.client", "shmcache.service"],
    ["shmcache._diagnose"],
    ["shmcache._cli"],
    ["shmcache.cli", "shmcache.__main__"],
]


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _layer(module: str) -> int:
    best = (-1, -1)  # (length of the longest matching layer name, its layer)
    for rank, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best[0]:
                best = (len(name), rank)
    assert best[1] >= 0, f"{module} is in no layer of LAYERS: add it"
    return best[1]


def _imports(module: str) -> Iterator[str]:
    """Every module of the package that ``module`` imports, wherever the import statement is."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names] or [base]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != module and not module.startswith(target + "."):
                yield target  # importing one's own parent package is the package itself


GRAPH = {module: set(_imports(module)) for module in MODULES}


def test_every_module_is_in_a_layer() -> None:
    assert all(_layer(module) >= 0 for module in MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_points_up(module: str) -> None:
    upward = sorted(t for t in GRAPH[module] if _layer(t) > _layer(module))
    assert upward == [], f"{module} (layer {_layer(module)}) imports higher layers: {upward}"


def test_no_import_cycle() -> None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(MODULES):
        if module not in state:
            assert (cycle := visit(module)) is None, " -> ".join(cycle)
