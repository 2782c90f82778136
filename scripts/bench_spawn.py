#!/usr/bin/env python
"""Benchmark: time to first batch of a DataLoader with 4 workers, by start method and
by what the Dataset holds.

For every start method (``spawn``, ``forkserver``, ``fork``) one fresh interpreter
builds the Datasets and, per dataset size (full: 64 and 512 MiB; ``--quick``: 4 and
16 MiB, 1 worker, of float32 rows, 1 KiB each), times ``next(iter(loader))`` for each variant of the
same Dataset class, in an order that alternates between repeats:

- ``path``: holds only the ``.npy``'s path and opens it lazily in each worker (the
  floor: what the workers cost when the Dataset pickles to nothing);
- ``shmcache``: holds ``shmcache.open_array(key)`` (pickles as a reference);
- ``CachedDataset``: ``shmcache.torch.CachedDataset(key)`` (pickles as its key);
- ``np.memmap``: holds ``np.load(path, mmap_mode="r")`` (pickled with all its data);
- ``ndarray``: holds an in-memory copy (pickled with all its data).

One untimed loader runs first in each interpreter, so a forkserver is already up (as it
is from the second DataLoader of a training run on). Targets (DESIGN.md): with
``spawn`` and ``forkserver``, shmcache's time to first batch at most 1.1x the path-only
floor, and flat as the dataset grows (large / small at most 1.1x). Usage::

    python scripts/bench_spawn.py [--quick] [--repeats N] [--methods spawn,forkserver,fork]
                                  [--out DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _benchlib import (
    MiB,
    Samples,
    Target,
    alternated,
    environment,
    fmt_seconds,
    markdown_table,
    print_targets,
    pyplot,
    save_figure,
    scratch_dir,
    write_report,
)

import shmcache

RATIO_TARGET = 1.1
"""shmcache time to first batch at most 1.1x the path-only floor; large/small at most 1.1x."""
ROW_WIDTH = 256  # float32: 1 KiB per row
VARIANTS = ("path", "shmcache", "CachedDataset", "np.memmap", "ndarray")
"""What the Dataset holds (the quick run: path and shmcache)."""
CHECKED_METHODS = ("spawn", "forkserver")


@dataclass(frozen=True)
class Config:
    sizes_mib: tuple[int, int]
    repeats: int
    variants: tuple[str, ...] = VARIANTS
    workers: int = 4
    batch_size: int = 64


FULL = Config(sizes_mib=(64, 512), repeats=3)
QUICK = Config(sizes_mib=(4, 16), repeats=1, variants=("path", "shmcache"), workers=1)


class Rows:
    """The same Dataset for every variant but ``path``: rows of ``self.data``."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        return torch.from_numpy(np.array(self.data[index]))


class PathRows(Rows):
    """Holds only a path; maps the ``.npy`` lazily in each process (the floor)."""

    def __init__(self, path: str, length: int) -> None:
        self.path = path
        self.length = length
        self._pid = -1

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        if self._pid != os.getpid():
            self.data = np.load(self.path, mmap_mode="r")
            self._pid = os.getpid()
        return super().__getitem__(index)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "length": self.length, "_pid": -1}


# ---------------------------------------------------------------------- child


def make_dataset(variant: str, key: str, path: str, root: str) -> Any:
    import shmcache.torch

    if variant == "path":
        return PathRows(path, len(np.load(path, mmap_mode="r")))
    if variant == "shmcache":
        return Rows(shmcache.open_array(key, root=root))
    if variant == "CachedDataset":
        return shmcache.torch.CachedDataset(key, root=root)
    if variant == "np.memmap":
        return Rows(np.load(path, mmap_mode="r"))
    if variant == "ndarray":
        return Rows(np.load(path))
    raise ValueError(variant)


def first_batch_seconds(dataset: Any, method: str, config: Config) -> float:
    from torch.utils.data import DataLoader

    loader = DataLoader(
        dataset,
        batch_size=config.batch_size,
        shuffle=False,
        num_workers=config.workers,
        multiprocessing_context=method,
    )
    started = time.perf_counter()
    iterator = iter(loader)
    batch = next(iterator)
    elapsed = time.perf_counter() - started
    assert len(batch) == config.batch_size
    del iterator  # shuts the workers down (not timed)
    return elapsed


def run_method(method: str, config: Config, files: dict[str, dict[str, str]], root: str) -> dict[str, Any]:
    """In a fresh interpreter: every size x variant, ``repeats`` times, order alternated."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    results: dict[str, dict[str, list[float]]] = {}
    smallest = files[str(config.sizes_mib[0])]
    first_batch_seconds(PathRows(smallest["path"], 1024), method, config)  # start-up, untimed
    for size, entry in files.items():
        results[size] = {v: [] for v in config.variants}
        for repeat in range(config.repeats):
            for variant in alternated(config.variants, repeat):
                dataset = make_dataset(variant, entry["key"], entry["path"], root)
                results[size][variant].append(first_batch_seconds(dataset, method, config))
                del dataset
    return results


# ---------------------------------------------------------------------- parent


def plot(summary: dict[str, dict[str, dict[str, Samples]]], config: Config, out_dir: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    methods = list(summary)
    fig, axes = plt.subplots(1, len(methods), figsize=(4.2 * len(methods), 3.8), sharey=False)
    if len(methods) == 1:
        axes = [axes]
    width = 0.8 / len(config.sizes_mib)
    for ax, method in zip(axes, methods, strict=True):
        for n, size in enumerate(config.sizes_mib):
            medians = [summary[method][str(size)][v].median for v in config.variants]
            positions = [
                i + (n - (len(config.sizes_mib) - 1) / 2) * width for i in range(len(config.variants))
            ]
            ax.bar(positions, medians, width, label=f"{size} MiB")
        ax.set_xticks(range(len(config.variants)), config.variants, rotation=30, ha="right")
        ax.set_title(f"{method}")
        ax.set_ylabel("seconds to first batch")
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    fig.suptitle(f"Time to first batch, {config.workers} workers, by what the Dataset holds")
    fig.tight_layout()
    return save_figure(fig, out_dir, "bench_spawn.png", dpi=80)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="CI size (4 and 16 MiB, 1 worker)")
    parser.add_argument("--repeats", type=int, help="repeats of every measurement")
    parser.add_argument("--methods", default="spawn,forkserver,fork", help="start methods, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="directory of the PNG")
    parser.add_argument("--json", type=str, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--run-method", help=argparse.SUPPRESS)
    parser.add_argument("--child-args", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.run_method:  # child
        child = json.loads(args.child_args)
        fields = child["config"]
        config = Config(
            **{**fields, "sizes_mib": tuple(fields["sizes_mib"]), "variants": tuple(fields["variants"])}
        )
        result = run_method(args.run_method, config, child["files"], child["root"])
        with open(child["result"], "w") as fp:
            json.dump(result, fp)
        return 0

    config = QUICK if args.quick else FULL
    if args.repeats:
        config = replace(config, repeats=args.repeats)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    started = time.perf_counter()
    raw: dict[str, Any] = {}
    with scratch_dir("shmcache-bench-spawn-") as scratch:
        root = str(scratch / "root")
        store = shmcache.Store(root)
        files: dict[str, dict[str, str]] = {}
        rng = np.random.default_rng(0)
        for mib in config.sizes_mib:
            data = rng.random((mib * MiB // (ROW_WIDTH * 4), ROW_WIDTH), dtype=np.float32)
            key = f"spawn/rows{mib}"
            store.put_array(key, data)
            path = scratch / f"rows{mib}.npy"
            np.save(path, data)
            files[str(mib)] = {"key": key, "path": str(path)}
            del data
        for method in methods:
            result_path = scratch / f"{method}.json"
            child_args = {"config": asdict(config), "files": files, "root": root, "result": str(result_path)}
            command = [sys.executable, os.path.abspath(__file__), "--run-method", method]
            subprocess.run([*command, "--child-args", json.dumps(child_args)], check=True)
            with open(result_path) as fp:
                raw[method] = json.load(fp)
    elapsed = time.perf_counter() - started

    summary = {
        method: {
            size: {v: Samples(times) for v, times in by_variant.items()}
            for size, by_variant in by_size.items()
        }
        for method, by_size in raw.items()
    }
    env = environment()
    print(
        f"# bench_spawn ({'quick' if args.quick else 'full'}): {env['cpu']}, {env['cpus']} CPUs, "
        f"python {env['python']}, torch {torch.__version__}, numpy {env['numpy']}; "
        f"{config.workers} workers, batch {config.batch_size}, {config.repeats} repeats, "
        "seconds from iter(loader) to the first batch\n"
    )
    rows: list[list[object]] = []
    targets: list[Target] = []
    for method, by_size in summary.items():
        for size, by_variant in by_size.items():
            floor = by_variant["path"].median
            for variant, s in by_variant.items():
                ratio = s.median / floor
                rows.append(
                    [
                        method,
                        f"{size} MiB",
                        variant,
                        fmt_seconds(s.median),
                        fmt_seconds(s.min),
                        fmt_seconds(s.max),
                        "floor" if variant == "path" else f"{ratio:.2f}x",
                    ]
                )
        if method not in CHECKED_METHODS:
            continue
        small, large = str(config.sizes_mib[0]), str(config.sizes_mib[1])
        for variant in (v for v in ("shmcache", "CachedDataset") if v in config.variants):
            for size in (small, large):
                ratio = by_size[size][variant].median / by_size[size]["path"].median
                targets.append(
                    Target(
                        target=f"time to first batch <= {RATIO_TARGET}x the path-only floor",
                        row=f"{method}, {size} MiB, {variant} vs path",
                        measured=ratio,
                        measured_text=f"{ratio:.2f}x ({fmt_seconds(by_size[size][variant].median)} vs "
                        f"{fmt_seconds(by_size[size]['path'].median)})",
                        ok=ratio <= RATIO_TARGET,
                    )
                )
            growth = by_size[large][variant].median / by_size[small][variant].median
            memmap_text = ""  # the contrast, where measured (not in --quick)
            if "np.memmap" in by_size[small]:
                memmap_growth = by_size[large]["np.memmap"].median / by_size[small]["np.memmap"].median
                memmap_text = f" (np.memmap: {memmap_growth:.2f}x)"
            targets.append(
                Target(
                    target=f"time to first batch flat in size (<= {RATIO_TARGET}x)",
                    row=f"{method}, {variant}, {large} MiB / {small} MiB",
                    measured=growth,
                    measured_text=f"{growth:.2f}x{memmap_text}",
                    ok=growth <= RATIO_TARGET,
                )
            )
    print(
        markdown_table(
            ["start method", "size", "Dataset holds", "median", "min", "max", "vs path"], rows, "lllrrrr"
        )
    )
    print()
    print_targets(targets)
    png = plot(summary, config, args.out)
    if png is not None:
        print(f"\nplot: {png}")
    print(f"({elapsed:.1f} s)")
    write_report(
        args.json,
        "bench_spawn",
        quick=args.quick,
        config=asdict(config),
        results={
            m: {size: {v: s.summary() for v, s in bv.items()} for size, bv in bs.items()}
            for m, bs in summary.items()
        },
        targets=targets,
        elapsed_s=elapsed,
        plots=[png] if png else [],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
