#!/usr/bin/env python
"""Benchmark: loading from object storage into the cache vs ``s3fs``'s own ``get`` into /dev/shm.

The server is moto's S3 server mode in a subprocess on 127.0.0.1 (objects in its memory,
uploaded as single parts, so their ETags are MD5s and the cache checks them). Cases (full
size; ``--quick`` in brackets):

- one ``.npy`` object of 1 GiB [16 MiB] (also read as one part: moto, unlike S3, copies the
  whole object for every ranged GET, under a lock, so this row tells its cost from ours);
- 2,000 ``.npy`` objects of 100 KiB under one prefix [50];
- other formats from URLs (issue 21 items 5 and 7): a bfloat16-sized ``.safetensors``
  checkpoint of 1 GiB [16 MiB] (its tensors streamed as byte ranges of the object), and a
  Parquet table of 256 MiB [8 MiB] (uncompressed numeric columns: streamed by one GET, as
  ``s3fs get`` does, into a scratch file in the root's ``tmp/``, and decoded from there one
  row group at a time into a table entry).

Methods, alternated from one repeat to the next, each load in a fresh subprocess (so its
peak RSS is the load's own): the baseline ``S3FileSystem.get`` of the object (or of the
prefix, recursively) into a directory on /dev/shm, and ``Store.put_file`` of the URL
(parallel ranged reads written at their offsets, CRC-32 and MD5 checked, ETags compared
after the load). The time is taken inside the subprocess around the call (imports and
interpreter start excluded on both sides). Ratios are baseline time over the cache's
(speed ratios), medians over ``--repeats``.
Targets (issue 13): >= 0.9x for the big object, >= 1.0x for the many small ones; the loading
process's memory flat (peak RSS well under the object's size: no full-object buffering).
Issue 21: >= 0.9x for the safetensors checkpoint and the Parquet table, memory flat for both
(the table's peak RSS: a few row groups, not the object).
Usage::

    python scripts/bench_remote.py [--quick] [--repeats N] [--big-mib N] [--objects N] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from _benchlib import (
    GiB,
    MiB,
    Samples,
    Target,
    alternated,
    environment,
    fmt_bytes,
    fmt_seconds,
    markdown_table,
    print_targets,
    scratch_dir,
    write_report,
)
from _benchrows import PEAK_RSS_LINE, run_child

BIG_TARGET = 0.9
MANY_TARGET = 1.0
BUCKET = "bench"


@dataclass(frozen=True)
class Config:
    big_bytes: int
    objects: int
    object_bytes: int
    repeats: int
    table_bytes: int = 256 * MiB


FULL = Config(big_bytes=GiB, objects=2000, object_bytes=100 * 1024, repeats=3)
QUICK = Config(big_bytes=16 * MiB, objects=50, object_bytes=100 * 1024, repeats=2, table_bytes=8 * MiB)


@dataclass(frozen=True)
class Case:
    name: str
    path: str  # bucket/key or bucket/prefix/
    data_bytes: int
    target: float


# ---------------------------------------------------------------------- the server


@contextlib.contextmanager
def moto_server(log: Path) -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"moto server did not start: {log.read_text()[-2000:]}") from None
                    time.sleep(0.05)
            yield endpoint
        finally:
            server.terminate()
            server.wait(10)


def options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "bench",
        "secret": "bench",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }


def upload(endpoint: str, config: Config) -> list[Case]:
    import boto3

    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
        region_name="us-east-1",
    )
    s3.create_bucket(Bucket=BUCKET)
    rng = np.random.default_rng(0)
    big = io.BytesIO()
    np.save(big, rng.random(config.big_bytes // 4, dtype=np.float32))
    s3.put_object(Bucket=BUCKET, Key="big.npy", Body=big.getvalue())  # one part: an MD5 ETag
    big_bytes = big.tell()
    del big
    rows = config.object_bytes // (256 * 4)
    many_bytes = 0
    for i in range(config.objects):
        one = io.BytesIO()
        np.save(one, rng.random((rows, 256), dtype=np.float32))
        many_bytes += one.tell()
        s3.put_object(Bucket=BUCKET, Key=f"many/f{i:05d}.npy", Body=one.getvalue())
    tensors_bytes, table_bytes = _upload_formats(s3, config, rng)
    return [
        Case(f"one object of {fmt_bytes(config.big_bytes)}", f"{BUCKET}/big.npy", big_bytes, BIG_TARGET),
        Case(
            f".safetensors of {fmt_bytes(config.big_bytes)}",
            f"{BUCKET}/model.safetensors",
            tensors_bytes,
            BIG_TARGET,
        ),
        Case(f".parquet of {fmt_bytes(config.table_bytes)}", f"{BUCKET}/table.parquet", table_bytes, 0.9),
        Case(
            f"{config.objects:,} objects of {fmt_bytes(config.object_bytes)}",
            f"{BUCKET}/many/",
            many_bytes,
            MANY_TARGET,
        ),
    ]


def _upload_formats(s3: Any, config: Config, rng: np.random.Generator) -> tuple[int, int]:
    """A checkpoint (8 matrices and their biases) and an uncompressed numeric Parquet table."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from safetensors.numpy import save

    side = int((config.big_bytes // 8 // 2) ** 0.5)
    matrix = rng.random((side, side), dtype=np.float32).astype(np.float16)
    tensors = {f"layer{i}.weight": matrix for i in range(8)}
    tensors |= {f"layer{i}.bias": np.zeros(side, np.float16) for i in range(8)}
    body = save(tensors)
    s3.put_object(Bucket=BUCKET, Key="model.safetensors", Body=body)
    rows = config.table_bytes // 24
    table = pa.table({"id": np.arange(rows, dtype=np.int64), "x": rng.random(rows), "y": rng.random(rows)})
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="none")
    s3.put_object(Bucket=BUCKET, Key="table.parquet", Body=buffer.getvalue())
    return len(body), buffer.tell()


# ---------------------------------------------------------------------- one load, in its own process

_LOADER = textwrap.dedent(
    """
    import json, os, resource, sys, time
    method, path, target, opts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    import s3fs  # imported before the clock starts on both sides (shmcache imports it lazily)
    if method == "s3fs.get":
        start = time.perf_counter()
        fs = s3fs.S3FileSystem(**opts)
        if path.endswith("/"):
            fs.get(path, target + "/", recursive=True)
        else:
            fs.get(path, target + "/object.npy")
    else:
        import shmcache
        store = shmcache.Store(target)
        store.prepare()
        start = time.perf_counter()
        part = (1 << 62) if method.endswith("one part") else None
        store.put_file("k", "s3://" + path, storage_options=opts, part_size=part)
    elapsed = time.perf_counter() - start
    """
) + PEAK_RSS_LINE + '\nprint(json.dumps({"seconds": elapsed, "peak_rss": peak}))\n'


def load_measured(method: str, case: Case, target: Path, endpoint: str) -> tuple[float, int]:
    """Seconds of one load in a fresh subprocess, and that process's peak RSS (bytes)."""
    args = (method, case.path, str(target), json.dumps(options(endpoint)))
    result = run_child(_LOADER, *args, what=f"{method} of {case.path}")
    return float(result["seconds"]), int(result["peak_rss"])


def bench_case(case: Case, endpoint: str, scratch: Path, repeats: int) -> dict[str, dict[str, Any]]:
    methods = ["s3fs.get", "Store.put_file"]
    if case.path.endswith(".npy"):  # moto copies the whole object for every ranged GET: show its cost
        methods.append("Store.put_file, one part")
    times = {m: Samples() for m in methods}
    peaks = {m: 0 for m in methods}
    for method in (m for repeat in range(repeats) for m in alternated(methods, repeat)):
        target = scratch / ("get" if method == "s3fs.get" else "cache")
        target.mkdir()
        seconds, peak = load_measured(method, case, target, endpoint)
        shutil.rmtree(target, ignore_errors=True)
        times[method].add(seconds)
        peaks[method] = max(peaks[method], peak)
        print(f"  {case.name}: {method} {fmt_seconds(seconds)}, peak RSS {fmt_bytes(peak)}", file=sys.stderr)
    return {m: {"seconds": times[m].summary(), "peak_rss_bytes": peaks[m]} for m in methods}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="CI size (64 MiB object, 200 small objects)")
    parser.add_argument("--repeats", type=int, help="repeats of every load")
    parser.add_argument("--big-mib", type=int, metavar="N", help="size of the big object in MiB")
    parser.add_argument("--objects", type=int, metavar="N", help="number of small objects")
    parser.add_argument("--json", type=str, metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    if args.repeats:
        config = replace(config, repeats=args.repeats)
    if args.big_mib:
        config = replace(config, big_bytes=args.big_mib * MiB)
    if args.objects:
        config = replace(config, objects=args.objects)

    started = time.perf_counter()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with scratch_dir("shmcache-bench-remote-") as scratch, moto_server(scratch / "moto.log") as endpoint:
        cases = upload(endpoint, config)
        for case in cases:
            results[case.name] = bench_case(case, endpoint, scratch, config.repeats)
    elapsed = time.perf_counter() - started

    env = environment()
    print(
        f"# bench_remote ({'quick' if args.quick else 'full'}): {env['cpu']}, {env['cpus']} CPUs, "
        f"python {env['python']}; moto S3 server on 127.0.0.1, targets on /dev/shm; "
        f"{config.repeats} repeats, order alternated, each load in its own process\n"
    )
    rows: list[list[object]] = []
    targets: list[Target] = []
    for case in cases:
        got, ours = results[case.name]["s3fs.get"], results[case.name]["Store.put_file"]
        base_s, ours_s = got["seconds"]["median"], ours["seconds"]["median"]
        ratio = base_s / ours_s
        others = [(m, sample) for m, sample in results[case.name].items() if m != "s3fs.get"]
        for method, sample in [("s3fs.get (baseline)", got), *others]:
            seconds = sample["seconds"]["median"]
            rows.append(
                [
                    case.name,
                    method,
                    fmt_seconds(seconds),
                    f"{case.data_bytes / seconds / MiB:,.0f} MiB/s",
                    "1.00x" if method.startswith("s3fs") else f"{base_s / seconds:.2f}x",
                    fmt_bytes(sample["peak_rss_bytes"]),
                ]
            )
        targets.append(
            Target(
                f"remote load >= {case.target}x s3fs get into /dev/shm",
                f"{case.name}, Store.put_file vs s3fs.get",
                ratio,
                f"{ratio:.2f}x",
                ratio >= case.target,
            )
        )
        targets.append(
            Target(
                "(information) peak RSS of the loading process vs the data",
                f"{case.name}: {fmt_bytes(ours['peak_rss_bytes'])} "
                f"(s3fs.get: {fmt_bytes(got['peak_rss_bytes'])})",
                ours["peak_rss_bytes"] / case.data_bytes,
                f"{ours['peak_rss_bytes'] / case.data_bytes:.2f}x of {fmt_bytes(case.data_bytes)}",
                None,
            )
        )
    print(
        markdown_table(["case", "method", "median", "throughput", "speed ratio", "peak RSS"], rows, "llrrrr")
    )
    print()
    print_targets(targets)
    write_report(
        args.json,
        "bench_remote",
        quick=args.quick,
        config=asdict(config),
        results=results,
        targets=targets,
        elapsed_s=elapsed,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
