#!/usr/bin/env python
"""Benchmark: getting data into the cache (issue 11), each row against a baseline in the same run.

Rows (full size; ``--quick`` in brackets), methods alternated in order from one repeat to
the next, medians over ``--repeats``:

- ``put_array`` of 1 GiB float32 [64 MiB] vs ``np.save`` to /dev/shm (target >= 1.0x its speed);
- ``put_file`` of a 1 GiB ``.npy`` [64 MiB] vs ``cp`` to /dev/shm (>= 0.9x);
- ``put_file`` of a directory of 1,000 x 100 KiB ``.npy`` [100] vs ``cp -r`` (>= 0.9x;
  ``--dir-files 100000 --dir-file-bytes 1024``: 100,000 x 1 KiB, >= 0.5x, issue 22);
- ``put_blobs`` of 20,000 files of 4-200 KiB [500] vs ``cp -r`` (>= 0.9x; ``tar -cf`` shown);
- ``share()`` of 1M annotation dicts [50,000] vs ``pa.Table.from_pylist`` + an uncompressed
  Feather write (<= 0.6x its time, issue 22), the bytes each stores (<= 1.0x), ``table[i]``
  vs building the same fresh dict from Python values at random rows (<= 1.2x its time;
  ``list[i]`` shown), a DataLoader with 4 fork workers over each (>= 1.0x);
- ``import shmcache`` with numpy already imported (``python -X importtime``, the
  cumulative time of the ``shmcache`` line; median of subprocesses) vs ``import numpy``
  alone (target <= 20 ms), and a fresh process that imports shmcache and opens one entry
  vs one that runs ``np.load(mmap_mode="r")`` (whole-process time, <= 1.2x; issue 22).

Sources of file rows live on disk (the temp directory, page cache warm), targets on
/dev/shm; every put goes to a fresh key and every copy to a fresh path, removed outside
the timing. Speed ratios are baseline time over method time.

Rows are functions in ``ROWS`` (``Context -> Row``); add one there. Usage::

    python scripts/bench_ingest.py [--quick] [--repeats N] [--only name,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from _benchlib import (
    GiB,
    MiB,
    Samples,
    alternated,
    environment,
    fmt_bytes,
    fmt_seconds,
    make_annotations,
    make_blob_tree,
    scratch_base,
    scratch_dir,
    write_random_npy,
)
from _benchrows import Row, report_rows

import shmcache


@dataclass(frozen=True)
class Config:
    array_bytes: int
    npy_bytes: int
    dir_files: int
    dir_file_bytes: int
    import_runs: int
    repeats: int
    blob_files: int = 20_000
    annotations: int = 1_000_000
    item_reads: int = 200_000
    loader_items: int = 200_000


FULL = Config(
    array_bytes=GiB, npy_bytes=GiB, dir_files=1000, dir_file_bytes=100 * 1024, import_runs=21, repeats=5
)
QUICK = Config(
    array_bytes=64 * MiB,
    npy_bytes=64 * MiB,
    dir_files=100,
    dir_file_bytes=100 * 1024,
    import_runs=5,
    repeats=3,
    blob_files=500,
    annotations=50_000,
    item_reads=20_000,
    loader_items=20_000,
)


@dataclass
class Context:
    """What every row gets: the sizes, a source directory on disk, scratch space on
    /dev/shm, and one store (fresh keys per measurement)."""

    config: Config
    src: Path
    shm: Path
    store: shmcache.Store
    _count: int = 0
    sizes: dict[str, int] = field(default_factory=dict)
    """Bytes stored by the share() row, for the bytes row."""

    def fresh(self, stem: str) -> str:
        """A name never used before in this run (a key, or a path under ``shm``)."""
        self._count += 1
        return f"{stem}{self._count}"


def timed_pair(
    ctx: Context,
    baseline: Callable[[], Any],
    method: Callable[[], Any],
    after: Callable[[], None] = lambda: None,
) -> tuple[Samples, Samples]:
    """Alternate ``baseline`` and ``method`` for ``repeats`` rounds; ``after`` runs after
    each call, untimed (removing what it wrote)."""
    base, meth = Samples(), Samples()
    calls = {"baseline": (baseline, base), "method": (method, meth)}
    for repeat in range(ctx.config.repeats):
        for name in alternated(["baseline", "method"], repeat):
            call, samples = calls[name]
            started = time.perf_counter()
            call()
            samples.add(time.perf_counter() - started)
            after()
    return base, meth


def _evict_all(store: shmcache.Store) -> None:
    for info in store.list():
        store.evict(info.key)


def _clear(ctx: Context) -> None:
    _evict_all(ctx.store)
    for child in ctx.shm.iterdir():
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()


# ---------------------------------------------------------------------- rows


def row_put_array(ctx: Context) -> Row:
    array = np.random.default_rng(0).random(ctx.config.array_bytes // 4, dtype=np.float32)
    base, meth = timed_pair(
        ctx,
        lambda: np.save(ctx.shm / f"{ctx.fresh('a')}.npy", array),
        lambda: ctx.store.put_array(ctx.fresh("a"), array),
        after=lambda: _clear(ctx),
    )
    size = fmt_bytes(array.nbytes)
    return Row(
        f"put_array {size} float32", "Store.put_array", "np.save to /dev/shm", meth, base, ">= 1.0x", 1.0
    )


def row_put_file_npy(ctx: Context) -> Row:
    source = ctx.src / "big.npy"
    write_random_npy(source, ctx.config.npy_bytes)
    base, meth = timed_pair(
        ctx,
        lambda: subprocess.run(["cp", str(source), str(ctx.shm / ctx.fresh("c"))], check=True),
        lambda: ctx.store.put_file(ctx.fresh("f"), source),
        after=lambda: _clear(ctx),
    )
    size = fmt_bytes(source.stat().st_size)
    return Row(f"put_file of a {size} .npy", "Store.put_file", "cp to /dev/shm", meth, base, ">= 0.9x", 0.9)


def row_put_file_dir(ctx: Context) -> Row:
    source = ctx.src / "small"
    source.mkdir()
    rng = np.random.default_rng(1)
    rows = ctx.config.dir_file_bytes // (256 * 4)
    for i in range(ctx.config.dir_files):
        np.save(source / f"f{i:05d}.npy", rng.random((rows, 256), dtype=np.float32))
    base, meth = timed_pair(
        ctx,
        lambda: subprocess.run(["cp", "-r", str(source), str(ctx.shm / ctx.fresh("d"))], check=True),
        lambda: ctx.store.put_file(ctx.fresh("d"), source),
        after=lambda: _clear(ctx),
    )
    name = f"put_file of {ctx.config.dir_files:,} x {fmt_bytes(ctx.config.dir_file_bytes)} .npy"
    per_file = (meth.median - base.median) / ctx.config.dir_files
    goal = 0.5 if ctx.config.dir_file_bytes <= 4096 else 0.9  # tiny files: per-file costs dominate
    return Row(
        name,
        "Store.put_file",
        "cp -r",
        meth,
        base,
        f">= {goal}x",
        goal,
        note=f"{per_file * 1e6:+.0f} us/file vs cp -r",
    )


def row_put_blobs(ctx: Context) -> Row:
    """An image folder (20,000 files of 4-200 KiB) packed as one blobs entry vs ``cp -r``."""
    source = ctx.src / "images"
    total = make_blob_tree(source, ctx.config.blob_files, 4, 200)
    tar = Samples()

    def tar_to_shm() -> None:
        started = time.perf_counter()
        archive = ctx.shm / f"{ctx.fresh('t')}.tar"
        subprocess.run(["tar", "-cf", str(archive), "-C", str(source), "."], check=True)
        tar.add(time.perf_counter() - started)

    base, meth = timed_pair(
        ctx,
        lambda: subprocess.run(["cp", "-r", str(source), str(ctx.shm / ctx.fresh("b"))], check=True),
        lambda: ctx.store.put_blobs(ctx.fresh("b"), source),
        after=lambda: (tar_to_shm(), _clear(ctx)),
    )
    name = f"put_blobs of {ctx.config.blob_files:,} files of 4-200 KiB ({fmt_bytes(total)})"
    return Row(
        name,
        "Store.put_blobs",
        "cp -r",
        meth,
        base,
        ">= 0.9x",
        0.9,
        note=f"tar -cf to /dev/shm: {fmt_seconds(tar.median)} ({base.median / tar.median:.2f}x cp -r)",
    )


def _feather_baseline(records: list[dict[str, Any]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.feather as feather

    feather.write_feather(pa.Table.from_pylist(records), str(path), compression="uncompressed")


def row_share_annotations(ctx: Context) -> Row | None:
    """``share()`` of annotation dicts vs what HF datasets does with them (Arrow from the
    list, written as an uncompressed Arrow/Feather file: ``save_to_disk``'s format)."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return None
    records = make_annotations(ctx.config.annotations)
    sizes: dict[str, int] = {}
    cpu = {"feather": Samples(), "share": Samples()}  # process CPU: what others running does not inflate

    def feather_once() -> None:
        path = ctx.shm / f"{ctx.fresh('f')}.feather"
        started = time.process_time()
        _feather_baseline(records, path)
        cpu["feather"].add(time.process_time() - started)
        sizes["feather"] = path.stat().st_size

    def share_once() -> None:
        key = ctx.fresh("ann")
        started = time.process_time()
        ctx.store.share(key, records)
        cpu["share"].add(time.process_time() - started)
        sizes["shmcache"] = ctx.store.info(key).size

    base, meth = timed_pair(ctx, feather_once, share_once, after=lambda: _clear(ctx))
    ctx.sizes = sizes  # the bytes row reports them
    ratios = [m / b for m, b in zip(cpu["share"].values, cpu["feather"].values, strict=True)]
    return Row(
        f"share() of {len(records):,} annotation dicts",
        "Store.share",
        "pa.Table.from_pylist + write_feather",
        meth,
        base,
        "<= 0.6x its time",
        0.6,
        kind="slowdown",
        note=(
            f"CPU time (process, median): {fmt_seconds(cpu['share'].median)} vs "
            f"{fmt_seconds(cpu['feather'].median)}, {statistics.median(ratios):.2f}x (pairs "
            f"{min(ratios):.2f}-{max(ratios):.2f}x)"
        ),
    )


def row_bytes_stored(ctx: Context) -> Row | None:
    sizes = ctx.sizes
    if not sizes:
        return None
    base, meth = Samples(), Samples()
    base.add(sizes["feather"])
    meth.add(sizes["shmcache"])
    return Row(
        f"bytes stored for {ctx.config.annotations:,} annotation dicts",
        "share() entry",
        "the Feather file",
        meth,
        base,
        "<= 1.0x",
        1.0,
        kind="bytes",
    )


def _per_item(sequence: Any, indices: list[int]) -> float:
    started = time.perf_counter()
    for i in indices:
        sequence[i]
    return (time.perf_counter() - started) / len(indices)


def row_item_access(ctx: Context) -> Row:
    """``table[i]`` (what ``share()`` of the dicts gives) vs building the same fresh dict
    from Python values (columns held as Python lists), at random rows; ``list[i]`` (an
    object that exists, no fresh dict) and ``records[i]`` shown."""
    records = make_annotations(ctx.config.annotations)
    table = ctx.store.share(ctx.fresh("ann"), records)
    as_records = ctx.store.open_records(_put_records(ctx, records))
    fresh = _FreshDicts(records)
    rng = np.random.default_rng(2)
    indices = rng.integers(0, len(records), size=ctx.config.item_reads).tolist()
    base, meth, recs, lists = Samples(), Samples(), Samples(), Samples()
    for repeat in range(ctx.config.repeats):
        for name in alternated(["fresh", "table", "records", "list"], repeat):
            if name == "fresh":
                base.add(_per_item(fresh, indices))
            elif name == "table":
                meth.add(_per_item(table, indices))
            elif name == "records":
                recs.add(_per_item(as_records, indices))
            else:
                lists.add(_per_item(records, indices))
    return Row(
        "table[i] of those dicts, random i",
        "SharedTable[i]",
        "a fresh dict from Python values",
        meth,
        base,
        "<= 1.2x its time",
        1.2,
        kind="slowdown",
        note=(
            f"list[i]: {lists.median * 1e9:.0f} ns; records[i] (put_records, orjson): "
            f"{recs.median * 1e6:.2f} us"
        ),
        extra={"records_item_s": recs.summary(), "list_item_s": lists.summary()},
    )


class _FreshDicts:
    """Row ``i`` built as a fresh dict (and a fresh bbox list) from values held in Python
    lists: what the fresh-dict contract of ``table[i]`` costs without shared memory."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.boxes = [r["bbox"] for r in records]
        self.labels = [r["label"] for r in records]
        self.ids = [r["id"] for r in records]

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"bbox": self.boxes[i][:], "label": self.labels[i], "id": self.ids[i]}


def _put_records(ctx: Context, records: list[dict[str, Any]]) -> str:
    key = ctx.fresh("rec")
    ctx.store.put_records(key, records)
    return key


class _Items:
    """A Dataset over a sequence of dicts, as a user writes it (``torch`` is imported by
    the row only)."""

    def __init__(self, items: Any) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        item = self.items[i]
        return item["label"] + len(item["bbox"]) + len(item["id"])


def _loader_seconds(dataset: _Items, items: int) -> float:
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    sampler = RandomSampler(dataset, num_samples=items, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(
        dataset, batch_size=256, sampler=sampler, num_workers=4, collate_fn=len,
        multiprocessing_context="fork",
    )
    started = time.perf_counter()
    count = sum(loader)
    assert count == items
    return time.perf_counter() - started


def row_loader(ctx: Context) -> Row | None:
    """DataLoader (4 fork workers) items/s over the dicts: the list vs ``share()``'s table."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    records = make_annotations(ctx.config.annotations)
    table = ctx.store.share(ctx.fresh("ann"), records)
    items = ctx.config.loader_items
    base, meth = Samples(), Samples()
    for repeat in range(ctx.config.repeats):
        for name in alternated(["list", "table"], repeat):
            if name == "list":
                base.add(_loader_seconds(_Items(records), items))
            else:
                meth.add(_loader_seconds(_Items(table), items))
    return Row(
        f"DataLoader, 4 workers, {items:,} of those dicts",
        "over share()'s table",
        "over the list of dicts",
        meth,
        base,
        ">= 1.0x",
        1.0,
        note=f"{items / meth.median:,.0f} vs {items / base.median:,.0f} items/s",
    )


_IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+(\d+) \| (\S+)\s*$")


def _import_us(code: str, module: str) -> float:
    """Cumulative import time of ``module`` (seconds) in a fresh interpreter running ``code``."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=scratch_base(on_shm=False),  # not the checkout: ``-c`` puts the cwd first on sys.path
    )
    for line in out.stderr.splitlines():
        match = _IMPORT_LINE.match(line)
        if match and match[2] == module:
            return int(match[1]) / 1e6
    raise RuntimeError(f"no import time for {module} in:\n{out.stderr[-2000:]}")


def row_import(ctx: Context) -> Row:
    base, meth = Samples(), Samples()
    for repeat in range(ctx.config.import_runs):
        for name in alternated(["numpy", "shmcache"], repeat):
            if name == "numpy":
                base.add(_import_us("import numpy", "numpy"))
            else:
                meth.add(_import_us("import numpy; import shmcache", "shmcache"))
    return Row(
        "import shmcache (numpy already imported)",
        "import shmcache",
        "import numpy",
        meth,
        base,
        "<= 20 ms",
        20.0,
        kind="ms",
        note=f"import numpy alone: {base.median * 1e3:.1f} ms",
    )


def _process_seconds(code: str, env: dict[str, str]) -> float:
    """Wall time of a fresh interpreter running ``code``, start to exit."""
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code], check=True, env=env, cwd=scratch_base(on_shm=False),
        stdout=subprocess.DEVNULL,
    )
    return time.perf_counter() - started


def row_first_open(ctx: Context) -> Row:
    """A fresh process that imports shmcache and opens one entry vs one that imports numpy
    and runs ``np.load(mmap_mode="r")`` on the same bytes (issue 22: the open path imports
    only what reading needs)."""
    key = ctx.fresh("open")
    array = np.arange(1000, dtype=np.float32)
    ctx.store.put_array(key, array)
    path = ctx.shm / f"{ctx.fresh('open')}.npy"
    np.save(path, array)
    env = {**os.environ, "SHMCACHE_ROOT": str(ctx.store.root)}
    codes = {
        "numpy": f"import numpy as np; np.load({str(path)!r}, mmap_mode='r')",
        "shmcache": f"import shmcache; shmcache.open_array({key!r})",
    }
    base, meth = Samples(), Samples()
    for repeat in range(ctx.config.import_runs):
        for name in alternated(["numpy", "shmcache"], repeat):
            (base if name == "numpy" else meth).add(_process_seconds(codes[name], env))
    _evict_all(ctx.store)
    path.unlink()
    return Row(
        "a fresh process: import + open one entry",
        "import shmcache; open_array",
        "import numpy; np.load(mmap_mode='r')",
        meth,
        base,
        "<= 1.2x its time",
        1.2,
        kind="slowdown",
    )


ROWS: list[Callable[[Context], Row | None]] = [
    row_put_array,
    row_put_file_npy,
    row_put_file_dir,
    row_put_blobs,
    row_share_annotations,
    row_bytes_stored,
    row_item_access,
    row_loader,
    row_import,
    row_first_open,
]
"""Every row, in table order; a row function gets the shared :class:`Context`."""


# ---------------------------------------------------------------------- main


@contextlib.contextmanager
def context(config: Config) -> Iterator[Context]:
    with (
        scratch_dir("shmcache-bench-ingest-") as shm,
        scratch_dir("shmcache-bench-ingest-src-", on_shm=False) as src,
    ):
        root = shm / "root"
        copies = shm / "copies"
        copies.mkdir()
        store = shmcache.Store(root)
        store.prepare()
        yield Context(config, src, copies, store)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="CI size (64 MiB, 100 small files, 5 imports)")
    parser.add_argument("--repeats", type=int, help="repeats of every timed pair")
    parser.add_argument("--array-bytes", type=int, help="bytes of the put_array and .npy rows")
    parser.add_argument("--dir-files", type=int, help="files of the directory row")
    parser.add_argument(
        "--dir-file-bytes", type=int, help="bytes of each file of the directory row (issue 22: 1024)"
    )
    parser.add_argument("--only", help="comma-separated row function names (e.g. row_import)")
    parser.add_argument("--json", type=str, metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    if args.repeats:
        config = replace(config, repeats=args.repeats)
    if args.array_bytes:
        config = replace(config, array_bytes=args.array_bytes, npy_bytes=args.array_bytes)
    if args.dir_files:
        config = replace(config, dir_files=args.dir_files)
    if args.dir_file_bytes:
        config = replace(config, dir_file_bytes=args.dir_file_bytes)
    selected = [f for f in ROWS if not args.only or f.__name__ in args.only.split(",")]

    started = time.perf_counter()
    rows: list[Row] = []
    with context(config) as ctx:
        for row_function in selected:
            row = row_function(ctx)
            if row is not None:  # None: an optional package (pyarrow, torch) is missing
                rows.append(row)
            _clear(ctx)
    elapsed = time.perf_counter() - started

    env = environment()
    report_rows(
        rows,
        f"# bench_ingest ({'quick' if args.quick else 'full'}): {env['cpu']}, {env['cpus']} CPUs, "
        f"python {env['python']}, numpy {env['numpy']}; {config.repeats} repeats, order alternated",
        args.json,
        "bench_ingest",
        quick=args.quick,
        config=asdict(config),
        elapsed_s=elapsed,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
