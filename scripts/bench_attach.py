#!/usr/bin/env python
"""Benchmark: opening a shmcache entry vs numpy's ways of opening the same ``.npy``, and
reading rows from what each returns.

Compares, in one run and on the same files in a temporary root on /dev/shm:

- cold ``open_array`` (first open of an entry in this process; many distinct entries),
  ``numpy.lib.format.open_memmap(mode="r")``, ``np.load(mmap_mode="r")`` and the floor,
  a raw ``os.open`` + ``mmap`` + ``np.frombuffer`` that already knows dtype and shape;
- warm ``open_array`` (already attached in this process);
- one row, ``arr[i]``, ``arr[i].copy()`` and ``np.array(arr[i])``, from the
  ``open_array`` result vs a plain in-process ndarray vs ``np.memmap``.

Each line is the time per operation over ``--repeats`` runs of a timed loop (median,
min, max), methods interleaved round-robin so drift on a noisy machine hits all alike.
Targets are those of DESIGN.md ("Performance targets"). Usage::

    python scripts/bench_attach.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import gc
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any
from unittest import mock

import numpy as np
import numpy.lib.format as npy_format
from _benchlib import (
    Target,
    environment,
    markdown_table,
    round_robin,
    scratch_base,
    scratch_dir,
    time_per_op,
    write_report,
)

import shmcache
from shmcache._disk.layout import ARRAY_FILE, ENV_ROOT, Layout
from shmcache._store.reading import forget_attachments

ROW_READ_TARGET = 1 / 0.9
"""Row reads at least 0.9x the speed of a plain ndarray: a time ratio of at most 1/0.9."""
COLD_TARGET_NS = 10_000.0
COLD_RATIO_TARGET = 0.3
WARM_TARGET_NS = 1_000.0


@dataclass(frozen=True)
class Config:
    """Sizes of one run."""

    entries: int
    """Distinct entries opened cold, once per method and repeat."""
    entry_shape: tuple[int, int]
    cold_repeats: int
    warm_number: int
    """Calls per timed warm loop."""
    warm_repeats: int
    rows: int
    row_width: int
    row_reads: int
    """Random rows read per timed loop."""
    row_repeats: int


FULL = Config(
    entries=1000,
    entry_shape=(64, 256),
    cold_repeats=21,
    warm_number=200_000,
    warm_repeats=15,
    rows=65_536,
    row_width=256,
    row_reads=2000,
    row_repeats=31,
)
QUICK = Config(
    entries=300,
    entry_shape=(64, 256),
    cold_repeats=7,
    warm_number=50_000,
    warm_repeats=7,
    rows=8192,
    row_width=256,
    row_reads=1000,
    row_repeats=11,
)


@dataclass
class Result:
    """Per-operation times (ns) of one method, one sample per repeat, and its verdict."""

    group: str
    name: str
    samples_ns: list[float]
    baseline: str | None = None
    ratio: float | None = None
    """Median time over the baseline's median time."""
    ratio_of_mins: float | None = None
    target: str = ""
    ok: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.samples_ns)

    @property
    def min(self) -> float:
        return min(self.samples_ns)

    @property
    def max(self) -> float:
        return max(self.samples_ns)


# ---------------------------------------------------------------------- timing


def _time_each(open_one: Callable[[str], object], items: Sequence[str]) -> float:
    """Mean ns per ``open_one(item)`` over ``items``; results stay alive until the clock
    stops, so unmapping them is not timed."""
    keep: list[object] = []
    append = keep.append
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter_ns()
        for item in items:
            append(open_one(item))
        elapsed = time.perf_counter_ns() - start
    finally:
        if gc_was_enabled:
            gc.enable()
    del keep
    return elapsed / len(items)


# ---------------------------------------------------------------------- openers


def _raw_opener(dtype: np.dtype, shape: tuple[int, ...], offset: int) -> Callable[[str], np.ndarray]:
    """SharedArray-style floor: ``os.open`` + ``mmap`` + ``np.frombuffer``, no header parsing."""
    count = int(np.prod(shape))

    def raw_open(path: str) -> np.ndarray:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            mapping = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return np.frombuffer(mapping, dtype, count, offset).reshape(shape)

    return raw_open


def _open_memmap(path: str) -> np.ndarray:
    return npy_format.open_memmap(path, mode="r")


def _np_load(path: str) -> np.ndarray:
    array: np.ndarray = np.load(path, mmap_mode="r")
    return array


# ---------------------------------------------------------------------- benchmarks


def bench_cold(store: shmcache.Store, config: Config) -> list[Result]:
    warmup = [f"warmup/e{i:03d}" for i in range(20)]
    keys = [f"cold/e{i:05d}" for i in range(config.entries)]
    data = np.arange(np.prod(config.entry_shape), dtype=np.float32).reshape(config.entry_shape)
    for key in warmup + keys:
        store.put_array(key, data)
    layout = Layout(store.root)
    paths = {key: layout.object_file(store.info(key).version, ARRAY_FILE) for key in warmup + keys}
    header = npy_format.open_memmap(paths[keys[0]], mode="r")
    raw_open = _raw_opener(header.dtype, header.shape, header.offset)
    module_store = shmcache.get_store()  # what shmcache.open_array(key) uses (the root in ENV_ROOT)
    assert module_store.root == store.root

    by_key: dict[str, Callable[[str], object]] = {
        "Store.open_array (cold)": store.open_array,
        "shmcache.open_array (cold)": shmcache.open_array,
    }
    by_path: dict[str, Callable[[str], object]] = {
        "open_memmap(mode='r')": _open_memmap,
        "np.load(mmap_mode='r')": _np_load,
        "os.open+mmap+frombuffer (floor)": raw_open,
    }

    def forget() -> None:  # every open after this is cold again (both stores: one root)
        forget_attachments(store.root)

    for name, opener in by_key.items():  # correctness, then warm up code paths
        np.testing.assert_array_equal(opener(keys[0]), data, err_msg=name)
    for name, opener in by_path.items():
        np.testing.assert_array_equal(opener(paths[keys[0]]), data, err_msg=name)
    key_paths = [paths[k] for k in keys]
    methods: dict[str, Callable[[], float]] = {}
    for name, opener in by_key.items():
        methods[name] = functools.partial(_time_each, opener, keys)
    for name, opener in by_path.items():
        methods[name] = functools.partial(_time_each, opener, key_paths)
    forget()
    for opener in by_key.values():
        _time_each(opener, warmup)
    for opener in by_path.values():
        _time_each(opener, [paths[k] for k in warmup])

    samples = round_robin(methods, config.cold_repeats, before=forget)
    results = [Result("cold open", name, times.values) for name, times in samples.items()]
    _compare(results, "open_memmap(mode='r')")
    for result in results[:2]:
        ok_time = result.median <= COLD_TARGET_NS
        ok_ratio = result.ratio is not None and result.ratio <= COLD_RATIO_TARGET
        result.target = f"≤ {_fmt(COLD_TARGET_NS)} and ≤ {COLD_RATIO_TARGET}x"
        result.ok = ok_time and ok_ratio
    return results


def bench_warm(store: shmcache.Store, config: Config) -> list[Result]:
    key = "warm/entry"
    store.put_array(key, np.arange(1024, dtype=np.int64))
    root = str(store.root)
    namespace: dict[str, Any] = {
        "store_open": store.open_array,
        "open_array": shmcache.open_array,
        "key": key,
        "root": root,
    }
    statements = {
        "Store.open_array (warm)": "store_open(key)",
        f"shmcache.open_array (warm, ${ENV_ROOT})": "open_array(key)",
        "shmcache.open_array (warm, root=...)": "open_array(key, root=root)",
        "timeit loop overhead (`pass`)": "pass",
    }
    for stmt in statements.values():
        exec(stmt, dict(namespace))  # attach once: every timed call is warm
    methods = {
        name: time_per_op(stmt, number=config.warm_number, namespace=namespace, ns=True)
        for name, stmt in statements.items()
    }
    samples = round_robin(methods, config.warm_repeats)
    results = [Result("warm open", name, times.values) for name, times in samples.items()]
    for result in results[:3]:
        result.target = f"< {_fmt(WARM_TARGET_NS)}"
        result.ok = result.median < WARM_TARGET_NS
    return results


def bench_rows(store: shmcache.Store, config: Config) -> list[Result]:
    key = "rows/features"
    rng = np.random.default_rng(0)
    data = rng.standard_normal((config.rows, config.row_width), dtype=np.float32)
    store.put_array(key, data)
    shared = store.open_array(key)
    plain = np.array(shared)  # a private in-process copy: the baseline
    path = Layout(store.root).object_file(store.info(key).version, ARRAY_FILE)
    memmap = npy_format.open_memmap(path, mode="r")
    for array in (shared, plain, memmap):  # fault every page in before timing
        np.testing.assert_array_equal(array, data)
    indices = rng.integers(0, config.rows, size=config.row_reads).tolist()
    sources = {"open_array": shared, "plain ndarray": plain, "np.memmap": memmap}
    reads = {"arr[i]": "a[i]", "arr[i].copy()": "a[i].copy()", "np.array(arr[i])": "np.array(a[i])"}
    number = max(1, 2_000_000 // (config.row_reads * config.row_width))

    results: list[Result] = []
    for read, expr in reads.items():
        methods = {
            f"{read} from {source}": time_per_op(
                f"for i in idx: {expr}",
                number=number,
                per_loop=config.row_reads,
                namespace={"a": array, "idx": indices, "np": np},
                ns=True,
            )
            for source, array in sources.items()
        }
        samples = round_robin(methods, config.row_repeats)
        group = [Result("row read", name, times.values) for name, times in samples.items()]
        _compare(group, f"{read} from plain ndarray")
        group[0].target = f"≤ {ROW_READ_TARGET:.2f}x"
        group[0].ok = group[0].ratio is not None and group[0].ratio <= ROW_READ_TARGET
        results += group
    return results


def _compare(results: list[Result], baseline: str) -> None:
    base = next(r for r in results if r.name == baseline)
    for result in results:
        if result is base:
            continue
        result.baseline = baseline
        result.ratio = result.median / base.median
        result.ratio_of_mins = result.min / base.min


# ---------------------------------------------------------------------- report


def _fmt(ns: float) -> str:
    if ns < 1_000:
        return f"{ns:.0f} ns"
    if ns < 1_000_000:
        return f"{ns / 1_000:.2f} µs"
    return f"{ns / 1_000_000:.2f} ms"


def render(results: list[Result]) -> str:
    rows: list[list[object]] = []
    for r in results:
        versus = "baseline" if r.baseline is None and r.group != "warm open" else ""
        if r.ratio is not None and r.ratio_of_mins is not None:
            versus = f"{r.ratio:.2f}x / {r.ratio_of_mins:.2f}x {r.baseline}"
        mark = "" if r.ok is None else ("✓" if r.ok else "✗")
        rows.append([r.group, r.name, _fmt(r.median), _fmt(r.min), _fmt(r.max), versus, r.target, mark])
    header = ["group", "operation", "median", "min", "max", "vs baseline (median / min)", "target", "ok"]
    return markdown_table(header, rows, "llrrrllc")


def targets(results: list[Result]) -> list[Target]:
    """The DESIGN.md targets, one per checked result (what ``bench_all`` summarizes)."""
    checked: list[Target] = []
    for r in results:
        if r.ok is None:
            continue
        if r.group == "cold open":
            assert r.ratio is not None
            checked.append(
                Target(
                    f"cold open_array <= {COLD_TARGET_NS / 1000:g} µs "
                    f"and <= {COLD_RATIO_TARGET}x open_memmap",
                    r.name,
                    r.median,
                    f"{r.median / 1000:.2f} µs, {r.ratio:.2f}x open_memmap",
                    r.ok,
                )
            )
        elif r.group == "warm open":
            target = f"warm open_array < {WARM_TARGET_NS / 1000:g} µs"
            checked.append(Target(target, r.name, r.median, f"{r.median:.0f} ns", r.ok))
        else:
            assert r.ratio is not None
            speed = 1 / r.ratio
            checked.append(
                Target(
                    f"reading one row >= {1 / ROW_READ_TARGET:.1f}x the speed of a plain ndarray",
                    r.name,
                    speed,
                    f"{speed:.2f}x speed ({r.median:.0f} ns)",
                    r.ok,
                )
            )
    return checked


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="CI-size run (a few seconds)")
    parser.add_argument("--repeats", type=int, help="override the number of repeats of every loop")
    parser.add_argument("--json", type=str, metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    if args.repeats:
        config = replace(
            config, cold_repeats=args.repeats, warm_repeats=args.repeats, row_repeats=args.repeats
        )

    started = time.perf_counter()
    with scratch_dir("shmcache-bench-") as root, mock.patch.dict(os.environ, {ENV_ROOT: str(root)}):
        store = shmcache.Store(root)
        results = bench_cold(store, config) + bench_warm(store, config) + bench_rows(store, config)
    elapsed = time.perf_counter() - started

    env = environment() | {"root_fs": str(scratch_base())}
    print(
        f"# bench_attach ({'quick' if args.quick else 'full'}): python {env['python']}, "
        f"numpy {env['numpy']}, {env['cpus']} CPUs, root on {env['root_fs']}"
    )
    print(
        f"cold: {config.entries} distinct {config.entry_shape} float32 entries x {config.cold_repeats} "
        f"repeats; warm: {config.warm_number} calls x {config.warm_repeats}; rows: "
        f"{config.row_reads} random rows of {config.row_width} float32 x {config.row_repeats}; "
        "times per operation (loop overhead included)\n"
    )
    print(render(results))
    failed = [r.name for r in results if r.ok is False]
    met = sum(r.ok is True for r in results)
    missed = f"; missed: {', '.join(failed)}" if failed else ""
    print(f"\n{met}/{met + len(failed)} targets met in {elapsed:.1f} s{missed}")
    write_report(
        args.json,
        "bench_attach",
        quick=args.quick,
        config=asdict(config),
        results=[{**asdict(r), "median_ns": r.median, "min_ns": r.min, "max_ns": r.max} for r in results],
        targets=targets(results),
        elapsed_s=elapsed,
        environment_extra={"root_fs": env["root_fs"]},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
