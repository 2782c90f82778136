#!/usr/bin/env python
"""Benchmark: DataLoader throughput from the cache vs the same Dataset over in-process
numpy arrays, by number of workers; and per-row vs batched reads in-process.

Data: ``feats`` (N x 256 float32, 1 KiB per row) and ``labels`` (N int64); full N =
262,144 (256 MiB), ``--quick`` N = 8,192 (8 MiB). Four Datasets, two pairs that
differ only in where the arrays live:

- batched: ``shmcache.torch.CachedDataset("feats", "labels")`` with
  ``collate_fn=shmcache.torch.collate`` (one gather per array per batch) vs
  ``InProcessBatched``, the same gather code over in-process tensors;
- per row: ``RowPairs`` over ``shmcache.open_array`` arrays vs ``RowPairs`` over
  in-process ndarrays (``np.array(row)`` per item, torch's ``default_collate``).

Each run reads ``--items`` shuffled items (batch 256, fork workers, which inherit the
in-process arrays without a copy); throughput is counted from the first batch on (the
start-up is bench_spawn's business). Workers 0, 1, 2 and 4, the Datasets alternated in
order from one repeat to the next. Target (DESIGN.md): with 4 workers, the cache at
least 1.0x the in-process array. Usage::

    python scripts/bench_loader.py [--quick] [--repeats N] [--out DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import pickle
import sys
import time
import warnings
from array import array as c_array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _benchlib import (
    Samples,
    Target,
    alternated,
    environment,
    fmt_bytes,
    fmt_seconds,
    markdown_table,
    print_targets,
    pyplot,
    round_robin,
    save_figure,
    scratch_dir,
    time_per_op,
    write_report,
)
from torch.utils.data import DataLoader, Dataset, SubsetRandomSampler

import shmcache
import shmcache.torch
from shmcache._disk import huge_map
from shmcache.torch import GatheredBatch

THROUGHPUT_TARGET = 1.0
"""DataLoader throughput (4 workers) from the cache: at least 1.0x the in-process array."""
ROW_READ_TARGET = 0.9
FIRST_PASS_TARGET = 0.9
"""Issue 22: random batches (and rows) from a fresh CachedDataset vs an in-memory array."""
ROW_WIDTH = 256
PAIRS = {  # shmcache Dataset -> its in-process baseline
    "CachedDataset (batched)": "InProcessBatched (batched)",
    "RowPairs over open_array": "RowPairs over ndarray",
    "open_array": "ndarray",
}


@dataclass(frozen=True)
class Config:
    rows: int
    items: int
    """Items read per DataLoader run."""
    repeats: int
    workers: tuple[int, ...] = (0, 1, 2, 4)
    batch_size: int = 256
    start_method: str = "fork"
    read_items: int = 20_000
    """Items read in-process per timed loop (per-row vs batched)."""


FULL = Config(rows=262_144, items=262_144, repeats=3)
QUICK = Config(rows=8_192, items=8_192, repeats=1, read_items=2_000)


class RowPairs(Dataset[tuple[torch.Tensor, int]]):
    """``(feats[i], labels[i])`` as a tensor and an int; the same code for both storages."""

    def __init__(self, feats: np.ndarray, labels: np.ndarray) -> None:
        self.feats = feats
        self.labels = labels

    def __len__(self) -> int:
        return len(self.feats)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(np.array(self.feats[index])), int(self.labels[index])


class InProcessBatched(Dataset[Any]):
    """``CachedDataset``'s code over in-process tensors: the batched baseline."""

    def __init__(self, feats: np.ndarray, labels: np.ndarray) -> None:
        self._tensors = [torch.from_numpy(feats), torch.from_numpy(labels)]

    def __len__(self) -> int:
        return len(self._tensors[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(column[index] for column in self._tensors)

    def __getitems__(self, indices: Sequence[int]) -> GatheredBatch:
        # The indices as CachedDataset makes them (array("q"), not torch.as_tensor's parse of
        # each element): what remains between the two is the memory, not the Python.
        positions = torch.frombuffer(c_array("q", indices), dtype=torch.long)
        gathered = [column.index_select(0, positions) for column in self._tensors]
        return GatheredBatch(_LazyRows(gathered), tuple(gathered))  # as CachedDataset does


class _LazyRows(Sequence[Any]):
    """Samples of a gathered batch, made only if default_collate asks for them."""

    def __init__(self, gathered: list[torch.Tensor]) -> None:
        self._gathered = gathered

    def __len__(self) -> int:
        return len(self._gathered[0])

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return tuple(g[index] for g in self._gathered)


def make_datasets(store: shmcache.Store, root: str, config: Config) -> dict[str, tuple[Dataset[Any], Any]]:
    """Name -> (Dataset, collate_fn); the cache's entries are put here."""
    rng = np.random.default_rng(0)
    feats = rng.random((config.rows, ROW_WIDTH), dtype=np.float32)
    labels = rng.integers(0, 1000, config.rows, dtype=np.int64)
    store.put_array("loader/feats", feats)
    store.put_array("loader/labels", labels)
    return {
        "CachedDataset (batched)": (
            shmcache.torch.CachedDataset("loader/feats", "loader/labels", root=root),
            shmcache.torch.collate,
        ),
        "InProcessBatched (batched)": (InProcessBatched(feats, labels), shmcache.torch.collate),
        "RowPairs over open_array": (
            RowPairs(store.open_array("loader/feats"), store.open_array("loader/labels")),
            None,
        ),
        "RowPairs over ndarray": (RowPairs(feats, labels), None),
    }


def items_per_second(dataset: Dataset[Any], collate: Any, workers: int, config: Config, seed: int) -> float:
    """Shuffled ``config.items`` items through a fresh DataLoader; rate after the first batch."""
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randperm(config.rows, generator=generator)[: config.items].tolist()
    loader = DataLoader(
        dataset,
        batch_size=config.batch_size,
        sampler=SubsetRandomSampler(indices, generator=generator),
        num_workers=workers,
        collate_fn=collate,
        multiprocessing_context=config.start_method if workers else None,
    )
    iterator = iter(loader)
    next(iterator)
    items = 0
    started = time.perf_counter()
    for features, _labels in iterator:
        items += len(features)
    elapsed = time.perf_counter() - started
    del iterator
    return items / elapsed


def bench_loaders(
    datasets: dict[str, tuple[Dataset[Any], Any]], config: Config
) -> dict[int, dict[str, Samples]]:
    results: dict[int, dict[str, Samples]] = {}
    names = list(datasets)
    for workers in config.workers:
        results[workers] = {name: Samples() for name in names}
        for repeat in range(config.repeats):
            for name in alternated(names, repeat):
                dataset, collate = datasets[name]
                rate = items_per_second(dataset, collate, workers, config, seed=repeat)
                results[workers][name].add(rate)
    return results


def bench_reads(datasets: dict[str, tuple[Dataset[Any], Any]], config: Config) -> dict[str, Samples]:
    """Seconds per item read in-process: ``ds[i]`` one by one vs ``ds.__getitems__(batch)``,
    and the arrays alone: ``arr[i].copy()`` vs ``arr[batch]`` (one fancy index)."""
    rng = np.random.default_rng(1)
    indices = rng.integers(0, config.rows, config.read_items).tolist()
    batches = [indices[i : i + config.batch_size] for i in range(0, len(indices), config.batch_size)]
    loops: dict[str, Callable[[], float]] = {}
    count = len(indices)

    def per_row(read: Callable[[int], object]) -> Callable[[], float]:
        return time_per_op(lambda: [read(i) for i in indices], per_loop=count)

    def per_batch(read: Callable[[Any], object]) -> Callable[[], float]:
        return time_per_op(lambda: [read(b) for b in batches], per_loop=count)

    for name, (dataset, _) in datasets.items():
        loops[f"{name}: ds[i] per row"] = per_row(dataset.__getitem__)
        getitems = getattr(dataset, "__getitems__", None)
        if getitems is not None:
            loops[f"{name}: __getitems__ per batch"] = per_batch(getitems)
    cached: RowPairs = datasets["RowPairs over open_array"][0]  # type: ignore[assignment]
    plain: RowPairs = datasets["RowPairs over ndarray"][0]  # type: ignore[assignment]
    for name, array in (("open_array", cached.feats), ("ndarray", plain.feats)):
        loops[f"{name}: arr[i].copy() per row"] = per_row(functools.partial(_copy_row, array))
        loops[f"{name}: arr[batch] per batch"] = per_batch(array.__getitem__)
    for loop in loops.values():  # warm up: map, fault in
        loop()
    return round_robin(loops, max(5, config.repeats * 2), alternate=True)


def bench_first_pass(
    store: shmcache.Store, root: str, config: Config, huge_pages: bool = True
) -> tuple[dict[str, Samples], dict[str, float]]:
    """Seconds per item of one pass over a *fresh* dataset (issue 22 item 3), in-process:
    ``CachedDataset`` built (untimed), then its columns mapped on first use (a new mapping,
    as in each worker: timed) and read in random batches of 256 over every row (an epoch),
    or per row over ``read_items`` random rows, against ``InProcessBatched`` (in-memory
    tensors, pages mapped already) read the same way. Page faults of the fresh mapping, or
    mapping its pages in up front, are inside the timing. Timed as this thread's CPU time
    (page faults included: the kernel's work on our behalf): on a shared machine, wall time
    mostly measures who else runs.

    ``huge_pages`` (where ``_disk/huge_map`` is supported): also ``CachedDataset(...,
    huge_pages=True)`` over a copy of the entries (so that the plain rows keep their 4 KiB
    pages), each repeat a fresh unpickled one as a worker gets (its aligned mapping, and
    the ``MADV_COLLAPSE`` that finds the pages collapsed, timed). The first construction,
    which collapses the copy's pages, is timed apart: the second dict (wall and CPU
    seconds per GiB, then the same for a second construction)."""
    feats = store.open_array("loader/feats").copy()  # in-memory: anonymous (huge) pages
    labels = store.open_array("loader/labels").copy()
    in_memory = InProcessBatched(feats, labels)
    collapse: dict[str, float] = {}
    huge_template: shmcache.torch.CachedDataset | None = None
    if huge_pages and huge_map.supported():
        store.put_array("loader/huge/feats", feats)
        store.put_array("loader/huge/labels", labels)
        gib = (feats.nbytes + labels.nbytes) / (1 << 30)
        for turn in ("first", "again"):
            wall, cpu = time.perf_counter(), time.thread_time()
            huge_template = shmcache.torch.CachedDataset(
                "loader/huge/feats", "loader/huge/labels", root=root, huge_pages=True
            )
            collapse[f"{turn}: wall s per GiB"] = (time.perf_counter() - wall) / gib
            collapse[f"{turn}: CPU s per GiB"] = (time.thread_time() - cpu) / gib
        huge_pmd = _pmd_mapped_bytes(store.info("loader/huge/feats").version)
        collapse["feats mapped on huge pages, share"] = huge_pmd / feats.nbytes
    rng = np.random.default_rng(3)
    epoch = rng.permutation(config.rows).tolist()
    batches = [epoch[i : i + config.batch_size] for i in range(0, len(epoch), config.batch_size)]
    rows = rng.integers(0, config.rows, config.read_items).tolist()

    def batched(make: Callable[[], Any]) -> Callable[[], float]:
        def run() -> float:
            getitems = make().__getitems__
            started = time.thread_time()
            for batch in batches:
                getitems(batch)
            return (time.thread_time() - started) / len(epoch)

        return run

    def per_row(make: Callable[[], Any]) -> Callable[[], float]:
        def run() -> float:
            getitem = make().__getitem__
            started = time.thread_time()
            for i in rows:
                getitem(i)
            return (time.thread_time() - started) / len(rows)

        return run

    def fresh() -> shmcache.torch.CachedDataset:
        return shmcache.torch.CachedDataset("loader/feats", "loader/labels", root=root)

    def fresh_huge() -> shmcache.torch.CachedDataset:  # what a worker gets: no columns yet
        loaded: shmcache.torch.CachedDataset = pickle.loads(pickle.dumps(huge_template))
        return loaded

    loops = {
        "CachedDataset, fresh: batches of 256, one epoch": batched(fresh),
        "InProcessBatched: batches of 256, one epoch": batched(lambda: in_memory),
        "CachedDataset, fresh: ds[i] per row": per_row(fresh),
        "InProcessBatched: ds[i] per row": per_row(lambda: in_memory),
    }
    if huge_template is not None:
        loops["CachedDataset(huge_pages=True), fresh: batches of 256, one epoch"] = batched(fresh_huge)
        loops["CachedDataset(huge_pages=True), fresh: ds[i] per row"] = per_row(fresh_huge)
    results = {name: Samples() for name in loops}
    for repeat in range(max(5, config.repeats * 2)):
        for name in alternated(list(loops), repeat):
            results[name].add(loops[name]())
            gc.collect()  # the fresh dataset's mappings go before the next one
    huge_template = None  # its mappings go
    gc.collect()
    return results, collapse


def _pmd_mapped_bytes(version: str) -> int:
    """Bytes of this process's mappings of ``<version>/data.npy`` mapped with huge page
    entries (``/proc/self/smaps``)."""
    pmd, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if not first.endswith(":") or "-" in first:  # a mapping's first line
                inside = line.rstrip().endswith(f"/{version}/data.npy")
            elif inside and first in ("ShmemPmdMapped:", "FilePmdMapped:"):
                pmd += int(line.split()[1]) * 1024
    return pmd


def _copy_row(array: np.ndarray, index: int) -> np.ndarray:
    row: np.ndarray = array[index].copy()
    return row


def plot(results: dict[int, dict[str, Samples]], config: Config, out_dir: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    styles = {
        "CachedDataset (batched)": ("tab:blue", "-"),
        "InProcessBatched (batched)": ("tab:blue", "--"),
        "RowPairs over open_array": ("tab:red", "-"),
        "RowPairs over ndarray": ("tab:red", "--"),
    }
    workers = list(results)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in results[workers[0]]:
        samples = [results[w][name] for w in workers]
        medians = [s.median for s in samples]
        errors = [
            [m - s.min for m, s in zip(medians, samples, strict=True)],
            [s.max - m for m, s in zip(medians, samples, strict=True)],
        ]
        color, line = styles.get(name, ("gray", "-"))
        ax.errorbar(
            workers, medians, yerr=errors, color=color, linestyle=line, marker="o", capsize=3, label=name
        )
    ax.set_yscale("log")
    ax.set_xticks(workers)
    ax.set_xlabel(f"DataLoader workers ({config.start_method}; {os.cpu_count()} CPUs)")
    ax.set_ylabel("items/s (median, min-max)")
    ax.set_title(f"DataLoader throughput, batch {config.batch_size}: cache (solid) vs in-process (dashed)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, out_dir, "bench_loader.png", dpi=80)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="CI size (32 MiB, 32,768 items per run)")
    parser.add_argument("--repeats", type=int, help="repeats of every run")
    parser.add_argument("--items", type=int, help="items read per DataLoader run")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="directory of the PNG")
    parser.add_argument("--json", type=str, metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--no-huge-pages",
        dest="huge_pages",
        action="store_false",
        help="leave out the CachedDataset(huge_pages=True) rows of the first pass",
    )
    parser.add_argument(
        "--first-pass-only", action="store_true", help="only the fresh-dataset pass (issue 22 item 3)"
    )
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    overrides = {k: v for k, v in (("repeats", args.repeats), ("items", args.items)) if v}
    config = Config(**{**asdict(config), **overrides})
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)

    started = time.perf_counter()
    with scratch_dir("shmcache-bench-loader-") as scratch:
        root = str(scratch / "root")
        store = shmcache.Store(root)
        datasets = make_datasets(store, root, config)
        reads = {} if args.first_pass_only else bench_reads(datasets, config)
        first, collapse = bench_first_pass(store, root, config, huge_pages=args.huge_pages)
        loaders = {} if args.first_pass_only else bench_loaders(datasets, config)
        del datasets
    elapsed = time.perf_counter() - started

    env = environment()
    data_bytes = config.rows * (ROW_WIDTH * 4 + 8)
    print(
        f"# bench_loader ({'quick' if args.quick else 'full'}): {env['cpu']}, {env['cpus']} CPUs, "
        f"python {env['python']}, torch {torch.__version__}, numpy {env['numpy']}; "
        f"{config.rows:,} rows ({fmt_bytes(data_bytes)}), {config.items:,} shuffled items per run, "
        f"batch {config.batch_size}, {config.start_method} workers, {config.repeats} repeats\n"
    )
    rows: list[list[object]] = []
    targets: list[Target] = []
    for workers, by_name in loaders.items():
        for cached, baseline in PAIRS.items():
            if cached not in by_name:
                continue
            for name in (cached, baseline):
                s = by_name[name]
                ratio = s.median / by_name[baseline].median
                rows.append(
                    [
                        workers,
                        name,
                        f"{s.median:,.0f}",
                        f"{s.min:,.0f}",
                        f"{s.max:,.0f}",
                        "baseline" if name == baseline else f"{ratio:.2f}x",
                    ]
                )
            ratio = by_name[cached].median / by_name[baseline].median
            if workers == 4:
                targets.append(
                    Target(
                        target=f"DataLoader throughput (4 workers) >= {THROUGHPUT_TARGET}x in-process array",
                        row=f"{cached} vs {baseline}",
                        measured=ratio,
                        measured_text=f"{ratio:.2f}x ({by_name[cached].median:,.0f} vs "
                        f"{by_name[baseline].median:,.0f} items/s)",
                        ok=ratio >= THROUGHPUT_TARGET,
                    )
                )
    if loaders:
        print("DataLoader items/s:\n")
        print(markdown_table(["workers", "Dataset", "median", "min", "max", "vs in-process"], rows, "rlrrrr"))

    read_rows: list[list[object]] = []
    for name, s in reads.items():
        dataset_name, _, how = name.partition(": ")
        base_name = PAIRS.get(dataset_name)
        ratio_text = "baseline"
        if base_name is not None:
            base = reads[f"{base_name}: {how}"]
            speed = base.median / s.median
            ratio_text = f"{speed:.2f}x speed"
            if how == "ds[i] per row" and dataset_name.startswith("RowPairs"):  # the row-read target
                targets.append(
                    Target(
                        target=f"reading one row >= {ROW_READ_TARGET}x the speed of a plain ndarray",
                        row=f"Dataset row read in-process, {dataset_name} vs ndarray",
                        measured=speed,
                        measured_text=f"{speed:.2f}x ({fmt_seconds(s.median)} vs {fmt_seconds(base.median)})",
                        ok=speed >= ROW_READ_TARGET,
                    )
                )
        read_rows.append(
            [dataset_name, how, fmt_seconds(s.median), fmt_seconds(s.min), fmt_seconds(s.max), ratio_text]
        )
    if reads:
        print(f"\nIn-process reads, time per item ({config.read_items:,} random items per loop):\n")
        headers = ["Dataset", "read", "median", "min", "max", "vs in-process"]
        print(markdown_table(headers, read_rows, "llrrrr"))
    for name, batched_read, row_read in () if not reads else (
        (
            "CachedDataset",
            "CachedDataset (batched): __getitems__ per batch",
            "CachedDataset (batched): ds[i] per row",
        ),
        ("open_array", "open_array: arr[batch] per batch", "open_array: arr[i].copy() per row"),
    ):
        speedup = reads[row_read].median / reads[batched_read].median
        print(f"\n{name}: batched reads {speedup:.1f}x the speed of per-row reads, per item")
    first_rows: list[list[object]] = []
    for name, s in first.items():
        base_name = "InProcessBatched: " + name.partition(": ")[2]
        if name == base_name:
            times = [fmt_seconds(s.median), fmt_seconds(s.min), fmt_seconds(s.max)]
            first_rows.append([name, *times, "baseline"])
            continue
        base = first[base_name]
        speed, best = base.median / s.median, base.min / s.min
        times = [fmt_seconds(s.median), fmt_seconds(s.min), fmt_seconds(s.max)]
        first_rows.append([name, *times, f"{speed:.2f}x / {best:.2f}x"])
        targets.append(
            Target(
                target=f"a fresh CachedDataset in-process >= {FIRST_PASS_TARGET}x an in-memory array",
                row=name,
                measured=speed,
                measured_text=f"{speed:.2f}x median, {best:.2f}x min ({fmt_seconds(s.median)} vs "
                f"{fmt_seconds(base.median)} per item)",
                ok=speed >= FIRST_PASS_TARGET,
            )
        )
    print("\nA fresh dataset, one pass in-process, time per item (mapping and page faults included):\n")
    headers = ["read", "median", "min", "max", "speed vs in-memory (median / min)"]
    print(markdown_table(headers, first_rows, "lrrrr"))
    if collapse:
        print(
            "\nhuge_pages=True, the first dataset over an entry (MADV_COLLAPSE of its pages): "
            f"{collapse['first: wall s per GiB']:.2f} s per GiB wall, "
            f"{collapse['first: CPU s per GiB']:.2f} s CPU; a second one: "
            f"{collapse['again: wall s per GiB'] * 1e3:.1f} ms per GiB wall; feats mapped "
            f"{collapse['feats mapped on huge pages, share']:.0%} on huge pages"
        )
    elif args.huge_pages:
        print("\n(no huge_pages rows: MADV_COLLAPSE is not supported here, see docs/huge-pages.md)")
    print()
    print_targets(targets)
    png = plot(loaders, config, args.out) if loaders else None
    if png is not None:
        print(f"\nplot: {png}")
    print(f"({elapsed:.1f} s)")
    write_report(
        args.json,
        "bench_loader",
        quick=args.quick,
        config=asdict(config),
        results={
            "dataloader_items_per_s": {
                str(w): {n: s.summary() for n, s in bn.items()} for w, bn in loaders.items()
            },
            "read_s_per_item": {n: s.summary() for n, s in reads.items()},
            "first_pass_s_per_item": {n: s.summary() for n, s in first.items()},
            "huge_pages_collapse": collapse,
        },
        targets=targets,
        elapsed_s=elapsed,
        plots=[png] if png else [],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
