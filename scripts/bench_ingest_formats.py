#!/usr/bin/env python
"""Benchmark: today's LLM formats into the cache (issue 21, item 7), each row against a
baseline in the same run; ``bench_ingest.py``'s rows, table and report, in a script of its
own (that one is at its size limit).

Rows (full size; ``--quick`` in brackets), methods alternated, medians over ``--repeats``:

- ``put_file`` of a 1 GiB bfloat16 ``.safetensors`` checkpoint [64 MiB] vs
  ``safetensors.torch.load_file`` + ``share_memory_()`` of every tensor (what a process
  does to hold the weights in shared memory itself); target >= 0.9x its speed. The note
  gives the peak RSS growth of a process that does only the ``put_file``: flat, no copy
  of the checkpoint in RAM beside the cache.
- ``put_file(..., dtype="uint16")`` of a 1 GiB nanoGPT-style token file [64 MiB] vs ``cp``
  to /dev/shm; target >= 0.9x.
- ``put_file`` of WebDataset ``.tar`` shards (a brace pattern; 1 GiB of 100 KiB images +
  labels, 64 MiB shards) [64 MiB] vs ``tar -xf`` of each shard into /dev/shm; target >= 0.9x.
  The note gives the peak RSS growth of a process doing only the ``put_file`` (flat: members
  are copied by the kernel, never read into Python).
- ``put_file`` of a ``datasets`` ``save_to_disk`` folder (256 MiB of int64 labels, float32
  embeddings, strings; 4 shards) [16 MiB] vs ``datasets.load_from_disk`` +
  ``with_format("numpy")`` access to every column (which maps the files and copies nothing:
  the columns are lazy), and vs ``cp -r`` of the folder into /dev/shm (the copy floor: a
  put must copy the data); target >= 0.9x. The note gives a put process's peak RSS growth.
- ``put_file`` of a local Parquet file (float64, int64 and 20-byte string columns, snappy,
  32 row groups; 512 MiB decoded [8 MiB]) vs ``pyarrow.parquet.read_table`` +
  ``feather.write_feather(..., compression="uncompressed")`` into /dev/shm (what a user does
  by hand); each call in a fresh process (imports done on a small file first), alternated;
  target >= 0.9x. The note gives both processes' peak RSS growths (median): the put reads
  one row group at a time (flat), the baseline holds the decoded table.
- random batches of 12 x 1024 token windows from ``TokenWindows`` vs nanoGPT's ``get_batch``
  over an ``np.memmap`` of the same tokens; target >= 0.9x its speed.

Usage::

    python scripts/bench_ingest_formats.py [--quick] [--repeats N] [--json PATH]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
from _benchlib import (
    GiB,
    MiB,
    Samples,
    alternated,
    environment,
    fmt_bytes,
)
from _benchrows import PEAK_RSS_LINE, Row, report_rows, run_child
from bench_ingest import FULL, QUICK, Context, _clear, context, timed_pair

_PEAK_RSS = (
    """
import importlib, json, sys
import shmcache
for name in sys.argv[3:]:  # what the put imports lazily, imported before the first reading
    importlib.import_module(name)
store = shmcache.Store(sys.argv[1])
"""
    + PEAK_RSS_LINE.replace("peak =", "before =")
    + """
store.put_file("peak", sys.argv[2], overwrite=True)
"""
    + PEAK_RSS_LINE
    + """
print(json.dumps({"growth": peak - before}))
"""
)


def _peak_growth(ctx: Context, source: str, *preload: str) -> int:
    """Peak RSS growth (bytes) of a fresh process doing only ``put_file(source)`` (with the
    modules ``preload`` imported before: their import is not the put's memory)."""
    result = run_child(_PEAK_RSS, str(ctx.store.root), source, *preload, what=f"put_file of {source}")
    return int(result["growth"])


_TABLE_CHILD = (
    """
import json, sys, time
mode, root, source, small, out = sys.argv[1:6]
if mode == "put":
    import shmcache
    store = shmcache.Store(root)
    def run(path, key):
        store.put_file(key, path, overwrite=True)
else:
    import pyarrow.feather as feather, pyarrow.parquet as pq
    def run(path, key):
        feather.write_feather(pq.read_table(path), out + key + ".feather", compression="uncompressed")
run(small, "warm")  # every import done, every lazy module loaded
open("/proc/self/clear_refs", "w").write("5")  # the peak so far := RSS now
"""
    + PEAK_RSS_LINE.replace("peak =", "before =")
    + """
started = time.perf_counter()
run(source, "big")
seconds = time.perf_counter() - started
"""
    + PEAK_RSS_LINE
    + """
print(json.dumps({"seconds": seconds, "growth": peak - before}))
"""
)


def _write_parquet(path: Path, nbytes: int, groups: int = 32) -> int:
    """A Parquet file of about ``nbytes`` decoded (float64, int64, 20-byte strings) in
    ``groups`` row groups, written a row group at a time; its row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = max(groups, nbytes // 44)  # 8 + 8 + 20 bytes + 8 of offsets a row
    per_group = -(-rows // groups)
    rng = np.random.default_rng(0)
    schema = pa.schema([("x", pa.float64()), ("n", pa.int64()), ("s", pa.string())])
    with pq.ParquetWriter(path, schema) as out:
        for start in range(0, rows, per_group):
            count = min(per_group, rows - start)
            letters = pa.py_buffer(rng.integers(97, 123, count * 20, dtype=np.uint8))
            offsets = pa.py_buffer(np.arange(0, count * 20 + 1, 20, dtype=np.int32))
            strings = pa.StringArray.from_buffers(count, offsets, letters)
            x, n = rng.random(count), rng.integers(0, 1 << 60, count)
            out.write_table(pa.table({"x": x, "n": n, "s": strings}), row_group_size=per_group)
    return rows


def row_local_parquet(ctx: Context) -> Row | None:
    """``put_file`` of a local Parquet file vs ``read_table`` + an uncompressed Feather write
    into /dev/shm, each call in a fresh process: its seconds and its peak RSS growth."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        return None
    source, small = ctx.src / "table.parquet", ctx.src / "small.parquet"
    rows = _write_parquet(source, ctx.config.npy_bytes // 2 if ctx.config.npy_bytes > 64 * MiB else 8 * MiB)
    pq.write_table(pq.ParquetFile(source).read_row_group(0).slice(0, 1000), small)
    times = {"put": Samples(), "feather": Samples()}
    growths: dict[str, list[int]] = {"put": [], "feather": []}
    for repeat in range(ctx.config.repeats):
        for mode in alternated(list(times), repeat):
            out = str(ctx.shm / ctx.fresh("f"))
            args = (mode, str(ctx.store.root), str(source), str(small), out)
            result = run_child(_TABLE_CHILD, *args, what=f"{mode} of {source}")
            times[mode].add(float(result["seconds"]))
            growths[mode].append(int(result["growth"]))
            _clear(ctx)
    put, feather = (sorted(growths[m])[len(growths[m]) // 2] for m in ("put", "feather"))
    size = source.stat().st_size
    return Row(
        f"put_file of a local Parquet file ({fmt_bytes(size)}, {rows:,} rows, 32 row groups)",
        "Store.put_file",
        'read_table + write_feather(compression="uncompressed") to /dev/shm',
        times["put"],
        times["feather"],
        ">= 0.9x",
        0.9,
        note=f"peak RSS growth: put_file +{fmt_bytes(put)}, read_table + write_feather +{fmt_bytes(feather)} "
        "(each in a fresh process)",
        extra={"peak_rss_growth_bytes": put, "baseline_peak_rss_growth_bytes": feather},
    )


def _write_bf16_checkpoint(path: Path, nbytes: int) -> None:
    """A bfloat16 checkpoint of ``nbytes`` as a model has: a few big matrices, small biases."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    tensors, left, layer = {}, nbytes, 0
    while left > 0:
        rows = max(1, min(4096, left // (2 * 4096)))
        tensors[f"layers.{layer}.weight"] = torch.randn(rows, 4096, generator=generator).to(torch.bfloat16)
        tensors[f"layers.{layer}.bias"] = torch.zeros(rows, dtype=torch.bfloat16)
        left -= rows * 4096 * 2 + rows * 2
        layer += 1
    save_file(tensors, str(path))


def row_bf16_safetensors(ctx: Context) -> Row | None:
    try:
        from safetensors.torch import load_file
    except ImportError:
        return None
    source = ctx.src / "model.safetensors"
    _write_bf16_checkpoint(source, ctx.config.npy_bytes)

    def load_into_shared_memory() -> None:
        for tensor in load_file(str(source)).values():
            tensor.share_memory_()

    base, meth = timed_pair(
        ctx,
        load_into_shared_memory,
        lambda: ctx.store.put_file(ctx.fresh("w"), source),
        after=lambda: _clear(ctx),
    )
    size = source.stat().st_size
    growth = _peak_growth(ctx, str(source))
    return Row(
        f"put_file of a {fmt_bytes(size)} bfloat16 .safetensors",
        "Store.put_file",
        "load_file + share_memory_()",
        meth,
        base,
        ">= 0.9x",
        0.9,
        note=f"peak RSS of a put_file process: +{fmt_bytes(growth)} ({growth / size:.1%} of the file)",
        extra={"peak_rss_growth_bytes": growth},
    )


def row_token_file(ctx: Context) -> Row:
    source = ctx.src / "train.bin"
    tokens = ctx.config.npy_bytes // 2
    with open(source, "wb") as fp:
        rng = np.random.default_rng(0)
        for start in range(0, tokens, 32 * MiB):
            fp.write(rng.integers(0, 50257, min(32 * MiB, tokens - start), dtype=np.uint16).tobytes())
    base, meth = timed_pair(
        ctx,
        lambda: subprocess.run(["cp", str(source), str(ctx.shm / ctx.fresh("c"))], check=True),
        lambda: ctx.store.put_file(ctx.fresh("t"), source, dtype="uint16"),
        after=lambda: _clear(ctx),
    )
    return Row(
        f"put_file of a {fmt_bytes(source.stat().st_size)} uint16 token file",
        "Store.put_file(dtype=)",
        "cp to /dev/shm",
        meth,
        base,
        ">= 0.9x",
        0.9,
    )


def row_token_windows(ctx: Context) -> Row | None:
    """Random batches of 12 x 1024 token windows (x and y): ``TokenWindows.__getitems__`` vs
    nanoGPT's ``get_batch`` over an ``np.memmap`` of the same file (in /dev/shm)."""
    try:
        import torch

        from shmcache.torch import TokenWindows
    except ImportError:
        return None
    batch, block, calls = 12, 1024, 300 if ctx.config.repeats < 5 else 2000
    source = ctx.shm / "windows.bin"
    np.random.default_rng(0).integers(0, 50257, ctx.config.npy_bytes // 2, dtype=np.uint16).tofile(source)
    key = ctx.fresh("w")
    ctx.store.put_file(key, source, dtype="uint16")
    data = np.memmap(source, dtype=np.uint16, mode="r")
    windows = TokenWindows(key, block, root=ctx.store.root)
    count = len(windows) - batch

    def get_batch() -> None:  # nanoGPT's train.py
        ix = torch.randint(len(data) - block, (batch,))
        torch.stack([torch.from_numpy(data[i : i + block].astype(np.int64)) for i in ix])
        torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block].astype(np.int64)) for i in ix])

    def gather(state: list[int] = [0]) -> None:  # noqa: B006 (a counter across calls)
        state[0] = (state[0] + batch) % count
        windows.__getitems__(range(state[0], state[0] + batch))

    base, meth = timed_pair(
        ctx,
        lambda: [get_batch() for _ in range(calls)],
        lambda: [gather() for _ in range(calls)],
    )
    base, meth = Samples([v / calls for v in base.values]), Samples([v / calls for v in meth.values])
    return Row(
        f"random batches of {batch} x {block} token windows (x, y)",
        "TokenWindows.__getitems__",
        "nanoGPT get_batch over np.memmap",
        meth,
        base,
        ">= 0.9x",
        0.9,
    )


def _write_shards(top: Path, nbytes: int, shard_bytes: int) -> str:
    """WebDataset shards of ``nbytes``: 100 KiB "images" and a label per sample; the brace pattern."""
    import io
    import tarfile

    top.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per_shard = max(1, shard_bytes // (100 * 1024))
    shards = max(1, nbytes // shard_bytes)
    sample = 0
    for shard in range(shards):
        with tarfile.open(top / f"shard-{shard:04d}.tar", "w") as tar:
            for _ in range(per_shard):
                for field, data in (("jpg", rng.bytes(100 * 1024)), ("cls", str(sample % 1000).encode())):
                    member = tarfile.TarInfo(f"{sample:08d}.{field}")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
                sample += 1
    return str(top / f"shard-{{0000..{shards - 1:04d}}}.tar")


def row_tar_shards(ctx: Context) -> Row:
    nbytes = ctx.config.npy_bytes
    pattern = _write_shards(ctx.src / "shards", nbytes, min(64 * MiB, max(MiB, nbytes // 4)))
    shards = sorted((ctx.src / "shards").glob("*.tar"))

    def untar() -> None:
        target = ctx.shm / ctx.fresh("x")
        target.mkdir()
        for shard in shards:
            subprocess.run(["tar", "-xf", str(shard), "-C", str(target)], check=True)

    base, meth = timed_pair(
        ctx, untar, lambda: ctx.store.put_file(ctx.fresh("s"), pattern), after=lambda: _clear(ctx)
    )
    size, growth = sum(s.stat().st_size for s in shards), _peak_growth(ctx, pattern)
    return Row(
        f"put_file of {len(shards)} tar shards ({fmt_bytes(size)}, 100 KiB members)",
        "Store.put_file(pattern)",
        "tar -xf into /dev/shm",
        meth,
        base,
        ">= 0.9x",
        0.9,
        note=f"peak RSS of a put_file process: +{fmt_bytes(growth)} ({growth / size:.1%} of the shards)",
        extra={"peak_rss_growth_bytes": growth},
    )


def row_hf_folder(ctx: Context) -> list[Row] | None:
    try:
        import datasets
    except ImportError:
        return None
    rows = max(1000, ctx.config.npy_bytes // 4 // (64 * 4 + 8 + 24))
    rng = np.random.default_rng(0)
    ds = datasets.Dataset.from_dict(
        {
            "label": rng.integers(0, 1000, rows),
            "emb": rng.standard_normal((rows, 64), dtype=np.float32),
            "text": [f"a caption of sample {i}" for i in range(rows)],
        }
    )
    folder = ctx.src / "hf"
    ds.save_to_disk(str(folder), num_shards=4)
    size = sum(f.stat().st_size for f in folder.glob("*.arrow"))

    def load_from_disk() -> None:
        loaded = datasets.load_from_disk(str(folder)).with_format("numpy")
        for column in ("label", "emb", "text"):
            loaded[column]

    def copy_folder() -> None:
        subprocess.run(["cp", "-r", str(folder), str(ctx.shm / ctx.fresh("hf"))], check=True)

    calls = {
        "load_from_disk": load_from_disk,
        "cp": copy_folder,
        "put_file": lambda: ctx.store.put_file(ctx.fresh("h"), folder),
    }
    times = {name: Samples() for name in calls}
    for repeat in range(ctx.config.repeats):
        for name in alternated(list(calls), repeat):
            started = time.perf_counter()
            calls[name]()
            times[name].add(time.perf_counter() - started)
            _clear(ctx)
    growth = _peak_growth(ctx, str(folder), "pyarrow")
    what = f"put_file of a save_to_disk folder ({fmt_bytes(size)}, {rows:,} rows)"
    return [
        Row(
            what,
            "Store.put_file(folder)",
            'load_from_disk + with_format("numpy") columns',
            times["put_file"],
            times["load_from_disk"],
            ">= 0.9x",
            0.9,
            note="load_from_disk maps the Arrow files and copies nothing (its columns are lazy)",
        ),
        Row(
            what,
            "Store.put_file(folder)",
            "cp -r of the folder into /dev/shm (the copy floor)",
            times["put_file"],
            times["cp"],
            ">= 0.9x",
            0.9,
            note=f"peak RSS of a put_file process: +{fmt_bytes(growth)} ({growth / size:.1%} of the folder, "
            "its mapped pages counted)",
            extra={"peak_rss_growth_bytes": growth},
        ),
    ]


ROWS: list[Callable[[Context], Row | list[Row] | None]] = [
    row_bf16_safetensors,
    row_token_file,
    row_tar_shards,
    row_hf_folder,
    row_local_parquet,
    row_token_windows,
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="CI size (64 MiB)")
    parser.add_argument("--repeats", type=int, help="repeats of every timed pair")
    parser.add_argument("--bytes", type=int, help="bytes of the checkpoint and of the token file")
    parser.add_argument("--json", type=str, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--row", action="append", help="only the rows whose function has this in its name")
    args = parser.parse_args(argv)
    config = replace(QUICK if args.quick else FULL, npy_bytes=GiB if not args.quick else 64 * MiB)
    if args.repeats:
        config = replace(config, repeats=args.repeats)
    if args.bytes:
        config = replace(config, npy_bytes=args.bytes)
    started = time.perf_counter()
    rows: list[Row] = []
    with context(config) as ctx:
        for row_function in ROWS:
            if args.row and not any(part in row_function.__name__ for part in args.row):
                continue
            row = row_function(ctx)
            if row is not None:  # None: safetensors (or torch) is missing
                rows.extend(row if isinstance(row, list) else [row])
            _clear(ctx)
    elapsed = time.perf_counter() - started
    env = environment()
    report_rows(
        rows,
        f"# bench_ingest_formats ({'quick' if args.quick else 'full'}): {env['cpu']}, {env['cpus']} CPUs, "
        f"python {env['python']}; {config.repeats} repeats, order alternated",
        args.json,
        "bench_ingest_formats",
        quick=args.quick,
        config=asdict(config),
        elapsed_s=elapsed,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
