"""``shmcache demo``: put a dataset and read it from spawned workers, the whole idea in
one command (the Quick start of the README)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Annotated, Any

import typer

from .._store import Store
from .._units import human_bytes
from ..errors import ShmCacheError
from .common import fail, failures_exit_1
from .options import RootOption

__all__ = ["demo", "register"]

_WORKERS = 2


def register(app: typer.Typer) -> None:
    """Add ``demo`` to ``app``."""
    app.command()(demo)


def demo(
    root: RootOption = None,
    rows: Annotated[int, typer.Option(min=1, help="Rows of the demo feature matrix.")] = 100_000,
) -> None:
    """Put a demo dataset into the cache and read it from 2 spawned workers.

    The workers receive a pickled reference to the shared entry, not a copy.
    """
    import multiprocessing as mp

    import numpy as np

    features = np.random.default_rng(0).standard_normal((rows, 64), dtype=np.float32)
    with failures_exit_1():  # a full or foreign root, a team's: one line, as every command
        store = Store(root)
        info = store.put_array("demo/features", features, overwrite=True)
        size = human_bytes(info.nbytes)
        typer.echo(f"put demo/features: {info.shape} {info.dtype}, {size} in {store.root}")
        shared = store.open_array("demo/features")
        picked = (0, rows // 2, rows - 1)
        start = time.perf_counter()
        with mp.get_context("spawn").Pool(_WORKERS) as pool:
            sums = pool.map(_row_sum, [(shared, i) for i in picked])
    elapsed = time.perf_counter() - start
    expected = [float(features[i].sum()) for i in picked]
    typer.echo(f"{_WORKERS} spawn workers read rows through a pickled reference in {elapsed:.2f} s")
    if not np.allclose(sums, expected):
        raise fail(ShmCacheError(f"demo read back {sums}, expected {expected}"))
    typer.echo("ok: workers saw the same data.")
    cli = _invoked_as()
    typer.echo(f"next: {cli} ls; {cli} stats; {cli} evict demo/features")


def _invoked_as() -> str:
    """How to run this command again: ``shmcache`` where that is on PATH, else the path
    it was run by (``.venv/bin/shmcache`` from the README's quick start)."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) != "shmcache":
        return "shmcache" if shutil.which("shmcache") else f"{sys.executable} -m shmcache"
    on_path = shutil.which("shmcache")
    if on_path is not None and os.path.samefile(on_path, argv0):
        return "shmcache"
    relative = os.path.relpath(argv0)
    return argv0 if relative.startswith("..") else relative


def _row_sum(args: tuple[Any, int]) -> float:
    """In a spawned worker: the sum of one row of the (unpickled, shared) array."""
    array, row = args
    return float(array[row].sum())
