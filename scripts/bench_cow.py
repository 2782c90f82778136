#!/usr/bin/env python
"""Benchmark: copy-on-write memory growth of DataLoader workers, Python lists and dicts
vs the same data through shmcache.

A Dataset holds N file paths and N annotation records (``id``, ``image_id``, ``bbox``,
``category``, ``score``, ``area``, ``iscrowd``) and returns a cheap number per item
(length of the path plus two fields of the record), so the reads are not drowned by
DataLoader overhead. Two variants of the same Dataset class, each in its own
subprocess of one run (so neither inherits the other's heap):

- ``python``: a ``list`` of ``str`` and a ``dict`` from id to record ``dict``, built in
  the main process before the workers start. Under ``fork`` every item a worker reads
  has its reference count written, so each touched page is copied into the worker.
  (``gc.freeze()`` is deliberately not used: it only stops the cyclic GC's writes, not
  the reference counts.)
- ``shmcache``: the same lists put through ``shmcache.share`` (strings and records
  entries in a temporary root on /dev/shm) and dropped; the Dataset holds only the
  shared containers, which pickle by reference.

One epoch through a DataLoader (4 workers, shuffle, persistent workers) is sampled:
every few batches the main process reads ``/proc/PID/smaps`` of itself and of each
worker through shmcache's own reader (the numbers ``shmcache watch`` shows: USS =
Private_Clean + Private_Dirty; PSS; *own* = private anonymous memory, what a
copy-on-write leak grows). A second, unsampled epoch gives the steady-state throughput.
Targets are those of DESIGN.md / issue 3: shmcache per-worker growth of own memory
under 1% of the data's size; items/s at least 0.9x the Python version. Usage::

    python scripts/bench_cow.py [--quick] [--start-method fork|spawn|forkserver]
                                [--out DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from _benchlib import (
    MiB,
    Target,
    environment,
    markdown_table,
    print_targets,
    process_tree,
    pyplot,
    read_memory,
    save_figure,
    scratch_dir,
    write_report,
)
from torch.utils.data import DataLoader, Dataset

import shmcache

if TYPE_CHECKING:
    from shmcache._diagnose.procfs import Memory

USS_GROWTH_TARGET = 0.01
"""shmcache per-worker growth of own memory over an epoch: under 1% of the data's size."""
THROUGHPUT_TARGET = 0.9
"""shmcache items/s at least 0.9x the Python-list version."""
VARIANTS = ("python", "shmcache")
CATEGORIES = [
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
    "traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat",
    "dog", "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack",
]  # fmt: skip


@dataclass(frozen=True)
class Config:
    """Sizes of one run."""

    items: int
    """Paths, and records (one per path)."""
    batch_size: int = 64
    workers: int = 4
    start_method: str = "fork"
    samples: int = 60
    """Memory samples per epoch (plus the first and the last batch)."""


READ_SAMPLE = 200_000
"""Random items read in-process (no DataLoader) to time ``dataset[i]`` alone."""
FULL_ITEMS = 2_000_000
QUICK_ITEMS = 20_000  # proves the run, not the targets (fixed costs weigh more)
QUICK_WORKERS = 2
QUICK_SAMPLES = 15


# ---------------------------------------------------------------------- data


def make_paths(n: int) -> list[str]:
    """Deterministic image paths, ~70 ASCII characters each (a typical dataset index)."""
    return [
        f"/datasets/openimages/train/{i % 4096:04d}/{i:09d}_{(i * 2654435761) & 0xFFFFFFFF:08x}.jpg"
        for i in range(n)
    ]


def make_records(n: int) -> list[dict[str, Any]]:
    """Deterministic COCO-style annotation records, one per image."""
    rng = np.random.default_rng(0)
    boxes = np.round(rng.uniform(0, 640, size=(n, 4)), 2).tolist()
    scores = np.round(rng.uniform(0, 1, size=n), 4).tolist()
    cats = rng.integers(0, len(CATEGORIES), size=n).tolist()
    return [
        {
            "id": i,
            "image_id": i,
            "bbox": box,
            "category": CATEGORIES[cat],
            "score": score,
            "area": round(box[2] * box[3], 2),
            "iscrowd": 0,
        }
        for i, (box, score, cat) in enumerate(zip(boxes, scores, cats, strict=True))
    ]


class AnnotatedPaths(Dataset[float]):
    """The same Dataset for both variants: a path and its annotation per item."""

    def __init__(self, paths: Sequence[str], records: Mapping[int, Any] | Sequence[Any]) -> None:
        self.paths = paths
        self.records = records

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> float:
        path = self.paths[index]
        record = self.records[index]
        return len(path) + record["score"] + record["bbox"][2]  # type: ignore[no-any-return]


# ---------------------------------------------------------------------- memory


def worker_pids(iterator: object) -> list[int]:
    """PIDs of the DataLoader's workers (from the iterator; this process's children as a fallback)."""
    workers = getattr(iterator, "_workers", None)
    if workers:
        return [int(w.pid) for w in workers]
    return process_tree(os.getpid())[1:]


@dataclass
class Trace:
    """Memory samples over one epoch: step (batch index) -> bytes, per process."""

    steps: list[int] = field(default_factory=list)
    main: list[Memory] = field(default_factory=list)
    workers: dict[int, list[Memory]] = field(default_factory=dict)

    def sample(self, step: int, pids: Sequence[int], cache_root: str | None) -> None:
        memories = [read_memory(pid, cache_root) for pid in pids]
        main = read_memory(os.getpid(), cache_root)
        if main is None or any(m is None for m in memories):
            return  # a worker exited: skip rather than record a partial row
        self.steps.append(step)
        self.main.append(main)
        for pid, memory in zip(pids, memories, strict=True):
            assert memory is not None
            self.workers.setdefault(pid, []).append(memory)


# ---------------------------------------------------------------------- one variant


def run_variant(variant: str, config: Config, root: str) -> dict[str, Any]:
    """Build the data, run the sampled epoch and the timed epoch; return what was seen."""
    torch.set_num_threads(1)
    # 4 workers on a 2-core machine is the point of the exercise, not a mistake to warn about.
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    gc.collect()
    before = read_memory(os.getpid())
    assert before is not None
    started = time.perf_counter()
    paths = make_paths(config.items)
    records = make_records(config.items)
    built_s = time.perf_counter() - started
    result: dict[str, Any] = {"variant": variant, "build_s": built_s}

    dataset: AnnotatedPaths
    cache_root: str | None = None
    if variant == "python":
        result["payload_bytes"] = sum(len(p.encode()) for p in paths) + sum(
            len(json.dumps(r, separators=(",", ":")).encode()) for r in records
        )
        by_id = {record["id"]: record for record in records}
        del records
        dataset = AnnotatedPaths(paths, by_id)
        gc.collect()
        after = read_memory(os.getpid())
        assert after is not None
        result["data_bytes"] = after.uss - before.uss
        result["data_what"] = "Python objects (main's USS growth while building)"
    else:
        started = time.perf_counter()
        shared_paths = shmcache.share("bench/paths", paths, root=root)
        shared_records = shmcache.share("bench/records", records, root=root)
        result["put_s"] = time.perf_counter() - started
        del paths, records
        gc.collect()
        dataset = AnnotatedPaths(shared_paths, shared_records)
        store = shmcache.get_store(root)
        cache_root = os.path.realpath(store.root)
        result["data_bytes"] = sum(store.info(k).size for k in ("bench/paths", "bench/records"))
        result["data_what"] = "shmcache entries (strings + records, indexes included)"
    assert dataset[1] == dataset[1] and len(dataset) == config.items

    loader = DataLoader(
        dataset,
        batch_size=config.batch_size,
        shuffle=True,
        num_workers=config.workers,
        persistent_workers=True,
        multiprocessing_context=config.start_method,
        generator=torch.Generator().manual_seed(0),
    )
    batches = len(loader)
    # Warm-up: the first prefetch round (each worker's first ``prefetch_factor`` batches),
    # while workers settle their allocators; under 0.1% of the items at full size.
    result["warmup_steps"] = min(batches - 1, config.workers * 2)
    every = max(1, batches // config.samples)
    trace = Trace()
    sampling_s = 0.0
    items = 0
    started = time.perf_counter()
    iterator = iter(loader)  # starts the workers (under spawn: pickles the Dataset to each)
    first_batch_at = started
    pids: list[int] = []
    for step, batch in enumerate(iterator):
        items += len(batch)
        if step == 0:
            first_batch_at = time.perf_counter()
            pids = worker_pids(iterator)
        if step % every == 0 or step == batches - 1 or (step < every and step & (step - 1) == 0):
            sample_started = time.perf_counter()
            trace.sample(step, pids, cache_root)
            sampling_s += time.perf_counter() - sample_started
    epoch1_end = time.perf_counter()
    items_after_first = items - min(config.batch_size, config.items)
    result["first_batch_s"] = first_batch_at - started
    result["epoch1_items_per_s"] = items_after_first / max(1e-9, epoch1_end - first_batch_at - sampling_s)
    result["sampling_s"] = sampling_s

    started = time.perf_counter()
    items2 = sum(len(batch) for batch in loader)  # same persistent workers, no sampling
    result["epoch2_items_per_s"] = items2 / (time.perf_counter() - started)
    shutdown = getattr(loader._iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()

    # The reads alone, in this process (after the workers are gone), to show where time goes.
    order = torch.randperm(config.items, generator=torch.Generator().manual_seed(1))
    indices = order[: min(config.items, READ_SAMPLE)].tolist()
    started = time.perf_counter()
    for index in indices:
        dataset[index]
    result["read_us_per_item"] = (time.perf_counter() - started) / len(indices) * 1e6

    result["trace"] = {
        "steps": trace.steps,
        "main": [asdict(m) for m in trace.main],
        "workers": {str(pid): [asdict(m) for m in ms] for pid, ms in trace.workers.items()},
    }
    return result


# ---------------------------------------------------------------------- summary


@dataclass
class Summary:
    """What the table shows for one variant."""

    variant: str
    data_bytes: int
    uss_end: float
    """Mean per-worker USS at the end of the epoch."""
    growth_mean: float
    """Mean over workers of USS(last sample) - USS(after warm-up)."""
    growth_worst: float
    peak_growth: float
    """Largest USS(any sample after warm-up) - USS(after warm-up) over all workers."""
    pss_total: int
    """PSS of main + workers at the last sample."""
    epoch1_items_per_s: float
    epoch2_items_per_s: float
    first_batch_s: float
    read_us_per_item: float
    """``dataset[i]`` alone, in-process (no DataLoader)."""

    own_peak_growth: float
    """``peak_growth`` of own memory (``Memory.own``: private anonymous memory, as
    ``shmcache watch`` counts it; pages of the cache's files are not in it)."""

    @property
    def growth_fraction(self) -> float:
        """Worst worker's growth of its own memory, at its peak (so a late dip cannot hide
        it), over the data size."""
        return self.own_peak_growth / self.data_bytes if self.data_bytes > 0 else float("nan")


def summarize(result: dict[str, Any]) -> Summary:
    trace = result["trace"]
    start = next(i for i, step in enumerate(trace["steps"]) if step >= result["warmup_steps"])
    workers = [[m["uss"] for m in ms[start:]] for ms in trace["workers"].values()]
    growths = [ms[-1] - ms[0] for ms in workers]
    peaks = [max(ms) - ms[0] for ms in workers]
    owns = [[m["own"] for m in ms[start:]] for ms in trace["workers"].values()]
    pss_total = trace["main"][-1]["pss"] + sum(ms[-1]["pss"] for ms in trace["workers"].values())
    return Summary(
        variant=result["variant"],
        data_bytes=result["data_bytes"],
        uss_end=sum(ms[-1] for ms in workers) / len(workers),
        growth_mean=sum(growths) / len(growths),
        growth_worst=max(growths),
        peak_growth=max(peaks),
        pss_total=pss_total,
        epoch1_items_per_s=result["epoch1_items_per_s"],
        epoch2_items_per_s=result["epoch2_items_per_s"],
        first_batch_s=result["first_batch_s"],
        read_us_per_item=result["read_us_per_item"],
        own_peak_growth=max(max(ms) - ms[0] for ms in owns),
    )


def _mib(n: float) -> str:
    return f"{n / MiB:,.1f} MiB"


def _ratio(a: float, b: float, floor: float = 0.0) -> str:
    """``a / b``, or n/a where ``b`` is not above ``floor`` (a ratio of noise to noise)."""
    return f"{a / b:.3f}x" if b > floor else "n/a"


def render(summaries: dict[str, Summary], config: Config) -> str:
    """The markdown table: one row per variant, then shmcache / python."""
    header = [
        "variant",
        "data in memory",
        "per-worker USS at end",
        "per-worker USS growth (mean / worst)",
        "peak growth",
        "peak growth of own memory, % of data",
        f"total PSS (main + {config.workers} workers)",
        "items/s epoch 1 (CoW faults)",
        "items/s epoch 2 (steady)",
        "first batch",
        "`dataset[i]` alone (time)",
    ]
    rows: list[list[object]] = [
        [
            s.variant,
            _mib(s.data_bytes),
            _mib(s.uss_end),
            f"{_mib(s.growth_mean)} / {_mib(s.growth_worst)}",
            _mib(s.peak_growth),
            f"{_mib(s.own_peak_growth)} = {100 * s.growth_fraction:.2f}%",
            _mib(s.pss_total),
            f"{s.epoch1_items_per_s:,.0f}",
            f"{s.epoch2_items_per_s:,.0f}",
            f"{s.first_batch_s:.2f} s",
            f"{s.read_us_per_item:.2f} µs",
        ]
        for s in summaries.values()
    ]
    base, shared = summaries["python"], summaries["shmcache"]
    rows.append(
        [
            "**shmcache / python**",
            _ratio(shared.data_bytes, base.data_bytes),
            _ratio(shared.uss_end, base.uss_end),
            f"{_ratio(shared.growth_mean, base.growth_mean, MiB)} "
            f"/ {_ratio(shared.growth_worst, base.growth_worst, MiB)}",
            _ratio(shared.peak_growth, base.peak_growth, MiB),
            _ratio(shared.own_peak_growth, base.own_peak_growth, MiB),
            _ratio(shared.pss_total, base.pss_total),
            _ratio(shared.epoch1_items_per_s, base.epoch1_items_per_s),
            _ratio(shared.epoch2_items_per_s, base.epoch2_items_per_s),
            _ratio(shared.first_batch_s, base.first_batch_s),
            _ratio(shared.read_us_per_item, base.read_us_per_item),
        ]
    )
    return markdown_table(header, rows, "l" + "r" * (len(header) - 1))


def targets(summaries: dict[str, Summary], config: Config) -> list[Target]:
    """The DESIGN.md targets this run checks, and the PSS ratio for information."""
    base, shared = summaries["python"], summaries["shmcache"]
    method, workers = config.start_method, config.workers
    growth = shared.growth_fraction
    steady = shared.epoch2_items_per_s / base.epoch2_items_per_s
    pss = shared.pss_total / base.pss_total
    return [
        Target(
            f"per-worker USS growth over an epoch < {100 * USS_GROWTH_TARGET:.0f}% of the data "
            f"({workers} workers)",
            f"{method}: strings + records, shmcache (python lists/dicts: "
            f"{100 * base.growth_fraction:.0f}%)",
            growth,
            f"{100 * growth:.2f}%",
            growth < USS_GROWTH_TARGET,
            f"worst worker at its peak, own memory: {_mib(shared.own_peak_growth)} "
            f"of {_mib(shared.data_bytes)}",
        ),
        Target(
            f"(bench_cow) items/s >= {THROUGHPUT_TARGET}x python lists/dicts, steady epoch",
            f"{method}: strings + records",
            steady,
            f"{steady:.2f}x",
            steady >= THROUGHPUT_TARGET,
            f"epoch 1: {shared.epoch1_items_per_s / base.epoch1_items_per_s:.3f}x",
        ),
        Target(
            f"(information) total PSS main + {workers} workers vs python lists/dicts",
            f"{method}: strings + records",
            pss,
            f"{pss:.2f}x",
            None,
        ),
    ]


def plot(results: dict[str, dict[str, Any]], config: Config, out_dir: Path) -> Path | None:
    """Per-worker USS and total PSS over the sampled epoch, both variants on one figure."""
    plt = pyplot()
    if plt is None:
        return None
    colors = {"python": "tab:red", "shmcache": "tab:blue"}
    fig, (ax_uss, ax_pss) = plt.subplots(1, 2, figsize=(13, 5))
    for variant, result in results.items():
        trace = result["trace"]
        items = [step * config.batch_size for step in trace["steps"]]
        for n, memories in enumerate(trace["workers"].values()):
            ax_uss.plot(
                items,
                [m["uss"] / MiB for m in memories],
                color=colors[variant],
                alpha=0.8,
                linestyle="-" if variant == "python" else "--",
                label=f"{variant} worker" if n == 0 else None,
            )
        totals = [
            main["pss"] + sum(ms[i]["pss"] for ms in trace["workers"].values())
            for i, main in enumerate(trace["main"])
        ]
        ax_pss.plot(items, [t / MiB for t in totals], color=colors[variant], label=variant)
    ax_uss.set_title(f"Per-worker USS over one epoch ({config.workers} workers, {config.start_method})")
    ax_uss.set_xlabel("items delivered")
    ax_uss.set_ylabel("USS (MiB)")
    ax_uss.legend()
    ax_pss.set_title(f"Total PSS, main + {config.workers} workers")
    ax_pss.set_xlabel("items delivered")
    ax_pss.set_ylabel("PSS (MiB)")
    ax_pss.legend()
    for ax in (ax_uss, ax_pss):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    fig.suptitle(f"{config.items:,} paths + {config.items:,} records: Python list/dict vs shmcache")
    fig.tight_layout()
    return save_figure(fig, out_dir, f"bench_cow_{config.start_method}_{config.items}.png", dpi=110)


# ---------------------------------------------------------------------- driver


def _run_in_subprocess(variant: str, config: Config, root: Path, scratch: Path) -> dict[str, Any]:
    """Run one variant in a fresh interpreter, so its workers inherit only its own heap."""
    result_path = scratch / f"{variant}.json"
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--run-variant",
        variant,
        "--config-json",
        json.dumps(asdict(config)),
        "--root",
        str(root),
        "--result",
        str(result_path),
    ]
    subprocess.run(command, check=True)
    with open(result_path) as fp:
        result: dict[str, Any] = json.load(fp)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--quick", action="store_true",
        help=f"CI size ({QUICK_ITEMS:,} items, {QUICK_WORKERS} workers, {QUICK_SAMPLES} samples)",
    )
    parser.add_argument("--items", type=int, help=f"paths and records (default {FULL_ITEMS:,})")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, help=f"default 4 (--quick {QUICK_WORKERS})")
    parser.add_argument("--start-method", choices=("fork", "spawn", "forkserver"), default="fork")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="directory of the PNG")
    parser.add_argument("--json", type=str, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--run-variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--config-json", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.run_variant:  # child: one variant
        config = Config(**json.loads(args.config_json))
        result = run_variant(args.run_variant, config, args.root)
        with open(args.result, "w") as fp:
            json.dump(result, fp)
        return 0

    config = Config(
        items=args.items or (QUICK_ITEMS if args.quick else FULL_ITEMS),
        batch_size=args.batch_size,
        workers=args.workers or (QUICK_WORKERS if args.quick else 4),
        start_method=args.start_method,
        samples=QUICK_SAMPLES if args.quick else Config.samples,
    )
    started = time.perf_counter()
    with scratch_dir("shmcache-bench-cow-") as root, scratch_dir("bench-cow-", on_shm=False) as scratch:
        results = {variant: _run_in_subprocess(variant, config, root, scratch) for variant in VARIANTS}
    elapsed = time.perf_counter() - started

    summaries = {variant: summarize(result) for variant, result in results.items()}
    payload = results["python"]["payload_bytes"]
    env = environment()
    print(
        f"# bench_cow ({'quick' if args.quick else 'full'}): python {env['python']}, "
        f"torch {env['torch']}, numpy {env['numpy']}, {env['cpus']} CPUs, "
        f"start method {config.start_method}"
    )
    print(
        f"{config.items:,} paths + {config.items:,} records; payload {_mib(payload)} "
        f"(UTF-8 paths + compact JSON records); one sampled epoch + one timed epoch, "
        f"batch {config.batch_size}, {config.workers} persistent workers, shuffle\n"
        f"python: {_mib(results['python']['data_bytes'])} of {results['python']['data_what']}; "
        f"shmcache: {_mib(results['shmcache']['data_bytes'])} of {results['shmcache']['data_what']} "
        f"(share took {results['shmcache']['put_s']:.1f} s)\n"
        "USS = Private_Clean + Private_Dirty, PSS, and own memory = private anonymous memory "
        "(heap and copied pages; what `shmcache watch` judges), all from /proc/PID/smaps. "
        "Growth = last sample - the sample after warm-up (the first prefetch round); peak = "
        "highest sample - that one; a negative growth is a worker releasing start-up allocations. "
        "Early in the epoch a shmcache worker's USS includes tmpfs pages of the cache that only "
        "it has mapped yet (fault-around maps 64 KiB per fault): not copies, they turn shared as "
        "other processes map them; own memory, which the target checks, never counts them.\n"
        "gc.freeze() is not used for the python variant: it only spares the cyclic GC's writes; "
        "reference counts still copy every page that is read.\n"
    )
    print(render(summaries, config))
    print()
    checked = targets(summaries, config)
    print_targets(checked)
    png = plot(results, config, args.out)
    if png is not None:
        print(f"\nplot: {png}")
    print(f"({elapsed:.1f} s)")
    write_report(
        args.json,
        "bench_cow",
        quick=args.quick,
        config=asdict(config),
        results=results,
        targets=checked,
        elapsed_s=elapsed,
        plots=[png] if png else [],
        extra={
            "payload_bytes": payload,
            "summaries": {
                v: asdict(s) | {"growth_fraction": s.growth_fraction} for v, s in summaries.items()
            },
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
