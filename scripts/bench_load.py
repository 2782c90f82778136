#!/usr/bin/env python
"""Benchmark: loading files into the cache vs ``cp`` into /dev/shm.

Sources live on disk (the temp directory, or ``--src-dir``) and are read once before
every repeat, so both sides copy from the page cache: what is compared is the copy
into tmpfs, not the disk. Cases (full size; ``--quick`` in brackets):

- one 1 GiB ``.npy`` [64 MiB];
- a directory of 1,000 small ``.npy`` files, 100 KiB each [100; ``--dir-files N``];
- an ``.npz`` of 4 arrays, stored (no compression), 256 MiB [32 MiB];
- the same ``.npz`` compressed (compressible int32 data), 256 MiB uncompressed [32 MiB].

Methods, alternated in order from one repeat to the next: the baseline ``cp`` (``cp -r``
for the directory; for the compressed ``.npz`` also ``unzip -d``, the shell way to get
``.npy`` files out of it), ``Store.put_file`` in this process, and the same load through
the daemon (a ``shmcache serve`` subprocess, driven by ``shmcache.client.Client``: from
the request to the job's ``finished`` stamp, see ``DaemonLoader``). Throughput is the
uncompressed data bytes over the time; ratios are baseline time over method time
(speed ratios), medians over ``--repeats``.
Target (DESIGN.md): loading a ``.npy`` at least 0.9x the throughput of ``cp``. Usage::

    python scripts/bench_load.py [--quick] [--repeats N] [--dir-files N] [--no-daemon] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
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
    scratch_base,
    scratch_dir,
    serve,
    write_random_npy,
    write_report,
)
from shmcache.client import Client

import shmcache

LOAD_TARGET = 0.9
"""Loading into the cache: at least 0.9x the throughput of ``cp`` into /dev/shm."""


@dataclass(frozen=True)
class Config:
    npy_bytes: int
    dir_files: int
    dir_file_bytes: int
    npz_bytes: int
    repeats: int


FULL = Config(npy_bytes=GiB, dir_files=1000, dir_file_bytes=100 * 1024, npz_bytes=256 * MiB, repeats=5)
QUICK = Config(npy_bytes=64 * MiB, dir_files=100, dir_file_bytes=100 * 1024, npz_bytes=32 * MiB, repeats=3)


@dataclass(frozen=True)
class Case:
    name: str
    source: Path
    data_bytes: int
    """Bytes of ``.npy`` files this load produces (uncompressed)."""
    source_bytes: int
    baselines: tuple[str, ...]


# ---------------------------------------------------------------------- sources


def make_sources(directory: Path, config: Config) -> list[Case]:
    cases: list[Case] = []
    npy = directory / "big.npy"
    write_random_npy(npy, config.npy_bytes)
    cases.append(
        Case(f"{fmt_bytes(config.npy_bytes)} .npy", npy, npy.stat().st_size, npy.stat().st_size, ("cp",))
    )

    small = directory / "small"
    small.mkdir()
    rng = np.random.default_rng(1)
    rows = config.dir_file_bytes // (256 * 4)
    for i in range(config.dir_files):
        np.save(small / f"f{i:05d}.npy", rng.random((rows, 256), dtype=np.float32))
    dir_bytes = sum(p.stat().st_size for p in small.iterdir())
    cases.append(
        Case(
            f"directory of {config.dir_files:,} .npy ({fmt_bytes(config.dir_file_bytes)} each)",
            small,
            dir_bytes,
            dir_bytes,
            ("cp",),
        )
    )

    members = 4
    per_member = config.npz_bytes // members // 4
    arrays = {f"a{i}": rng.random(per_member, dtype=np.float32) for i in range(members)}
    stored = directory / "stored.npz"
    np.savez(stored, **arrays)  # type: ignore[arg-type]
    npy_bytes = sum(a.nbytes + 128 for a in arrays.values())
    cases.append(
        Case(f"{fmt_bytes(config.npz_bytes)} .npz, stored", stored, npy_bytes, stored.stat().st_size, ("cp",))
    )
    del arrays
    # Compressible: a slowly varying signal plus small noise, as int32 (like labels or counts).
    compressible = {
        f"c{i}": (np.arange(per_member, dtype=np.int64) // 64 % 1000 + rng.integers(0, 4, per_member)).astype(
            np.int32
        )
        for i in range(members)
    }
    compressed = directory / "compressed.npz"
    np.savez_compressed(compressed, **compressible)  # type: ignore[arg-type]
    npy_bytes = sum(a.nbytes + 128 for a in compressible.values())
    on_disk = compressed.stat().st_size / npy_bytes
    cases.append(
        Case(
            f"{fmt_bytes(config.npz_bytes)} .npz, compressed ({on_disk:.0%} on disk)",
            compressed,
            npy_bytes,
            compressed.stat().st_size,
            ("cp", "unzip"),
        )
    )
    return cases


def read_into_page_cache(path: Path) -> None:
    """Read every byte of ``path`` (a file or a directory of files) once."""
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    buffer = bytearray(8 * MiB)
    for file in files:
        with open(file, "rb", buffering=0) as fp:
            while fp.readinto(buffer):
                pass


# ---------------------------------------------------------------------- methods


class DaemonLoader:
    """Loads through ``shmcache serve``: ``Client.load``, then ``Client.wait`` for the job.

    Timed from just before the request to the job's ``finished`` stamp (the daemon's
    ``time.time()``: the same system clock), so the client's polling neither adds its
    granularity (it backs off to 250 ms) nor takes CPU from the copy: polling every
    millisecond slowed the daemon's own load of 1,000 files by half on 2 cores.
    """

    def __init__(self, client: Client) -> None:
        self.client = client

    def load(self, key: str, source: Path) -> tuple[list[str], float]:
        """The keys published, and the seconds from the request to the publish."""
        submitted = time.time()
        job = self.client.wait(self.client.load(key, source).id)
        assert job.finished is not None
        return list(job.keys), job.finished - submitted


def run_cp(source: Path, target: Path) -> None:
    command = ["cp", "-r", str(source), str(target)] if source.is_dir() else ["cp", str(source), str(target)]
    subprocess.run(command, check=True)


def run_unzip(source: Path, target: Path) -> None:
    subprocess.run(["unzip", "-q", "-o", str(source), "-d", str(target)], check=True)


def bench_case(
    case: Case,
    store: shmcache.Store,
    daemon: DaemonLoader | None,
    scratch: Path,
    repeats: int,
) -> dict[str, Samples]:
    """Seconds per load of ``case`` for every method, ``repeats`` times, order alternated.

    A method's run returns its own time when it knows better than the wall clock
    around it (the daemon: request to publish), else None."""
    Run = Callable[[], float | None]
    methods: dict[str, Callable[[str], Run]] = {}
    cleanups: list[Callable[[], None]] = []

    def cp_method(tool: Callable[[Path, Path], None]) -> Callable[[str], Run]:
        def prepare(tag: str) -> Run:
            target = scratch / tag
            if tool is run_unzip:
                target.mkdir()
            cleanups.append(
                lambda: shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink()
            )
            return lambda: tool(case.source, target)

        return prepare

    def put_method(load: Callable[[str, Path], tuple[list[str], float | None]]) -> Callable[[str], Run]:
        def prepare(tag: str) -> Run:
            key = f"bench/{tag}"
            published: list[str] = []

            def run() -> float | None:
                keys, seconds = load(key, case.source)
                published.extend(keys)
                return seconds

            def evict() -> None:
                for k in published:
                    store.evict(k)

            cleanups.append(evict)
            return run

        return prepare

    for baseline in case.baselines:
        methods[baseline] = cp_method(run_cp if baseline == "cp" else run_unzip)
    methods["Store.put_file"] = put_method(lambda key, source: (store.put_file(key, source), None))
    if daemon is not None:
        methods["daemon PUT + job"] = put_method(daemon.load)

    samples = {name: Samples() for name in methods}
    names = list(methods)
    for repeat in range(repeats):
        for n, name in enumerate(alternated(names, repeat)):
            read_into_page_cache(case.source)
            run = methods[name](f"r{repeat}m{n}")
            started = time.perf_counter()
            own = run()
            samples[name].add(time.perf_counter() - started if own is None else own)
            while cleanups:  # free the copy before the next method writes its own
                cleanups.pop()()
    return samples


# ---------------------------------------------------------------------- report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="CI size (64 MiB .npy, 100 small files)")
    parser.add_argument("--repeats", type=int, help="repeats of every load")
    parser.add_argument(
        "--dir-files",
        type=int,
        metavar="N",
        help=f"files of the directory load (default {FULL.dir_files:,}; --quick {QUICK.dir_files:,})",
    )
    parser.add_argument("--src-dir", type=Path, help="where the sources are written (default: temp dir)")
    parser.add_argument("--no-daemon", action="store_true", help="skip loads through `shmcache serve`")
    parser.add_argument("--json", type=str, metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    if args.repeats:
        config = replace(config, repeats=args.repeats)
    if args.dir_files:
        config = replace(config, dir_files=args.dir_files)

    started = time.perf_counter()
    src_parent = args.src_dir or scratch_base(on_shm=False)
    src_parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Samples]] = {}
    cases: list[Case] = []
    daemon_error = ""
    with contextlib.ExitStack() as stack:
        shm_dir = stack.enter_context(scratch_dir("shmcache-bench-load-"))
        src = stack.enter_context(scratch_dir("shmcache-bench-src-", parent=src_parent))
        root = shm_dir / "root"
        copies = shm_dir / "cp"
        copies.mkdir()
        store = shmcache.Store(root)
        store.prepare()
        cases = make_sources(src, config)
        daemon: DaemonLoader | None = None
        if not args.no_daemon:
            try:
                daemon = DaemonLoader(stack.enter_context(serve(root)).client)
            except Exception as exc:  # the service extra may be missing: report, go on without
                daemon_error = f"{type(exc).__name__}: {exc}"
                print(f"daemon not measured: {daemon_error}", file=sys.stderr)
        for case in cases:
            results[case.name] = bench_case(case, store, daemon, copies, config.repeats)
    elapsed = time.perf_counter() - started

    env = environment()
    print(
        f"# bench_load ({'quick' if args.quick else 'full'}): {env['cpu']}, {env['cpus']} CPUs, "
        f"python {env['python']}, numpy {env['numpy']}; sources on {src_parent} (page cache), "
        f"targets on /dev/shm; {config.repeats} repeats, order alternated\n"
    )
    rows: list[list[object]] = []
    targets: list[Target] = []
    json_results: dict[str, Any] = {}
    for case in cases:
        samples = results[case.name]
        base = samples["cp"]
        json_results[case.name] = {
            "data_bytes": case.data_bytes,
            "source_bytes": case.source_bytes,
            "methods": {name: s.summary() for name, s in samples.items()},
        }
        for name, s in samples.items():
            ratio = base.median / s.median
            ratio_text = "baseline" if name == "cp" else f"{ratio:.2f}x"
            if "unzip" in samples and name not in ("cp", "unzip"):
                ratio_text += f" (vs unzip {samples['unzip'].median / s.median:.2f}x)"
            rows.append(
                [
                    case.name,
                    name,
                    fmt_seconds(s.median),
                    fmt_seconds(s.min),
                    fmt_seconds(s.max),
                    f"{case.data_bytes / s.median / MiB:,.0f} MiB/s",
                    ratio_text,
                ]
            )
            json_results[case.name]["methods"][name]["speed_vs_cp"] = ratio
            if name in ("cp", "unzip"):
                continue
            compressed = "compressed" in case.name
            targets.append(
                Target(
                    target=f"load into the cache >= {LOAD_TARGET}x cp",
                    row=f"{case.name}: {name} vs cp",
                    measured=ratio,
                    measured_text=f"{ratio:.2f}x ({fmt_seconds(s.median)} vs {fmt_seconds(base.median)})",
                    ok=None if compressed else ratio >= LOAD_TARGET,
                    note="cp copies the compressed bytes: information only" if compressed else "",
                )
            )
            if compressed:
                unzip = samples["unzip"]
                ratio_unzip = unzip.median / s.median
                targets.append(
                    Target(
                        target=f"load into the cache >= {LOAD_TARGET}x unzip (compressed .npz)",
                        row=f"{case.name}: {name} vs unzip -d /dev/shm",
                        measured=ratio_unzip,
                        measured_text=f"{ratio_unzip:.2f}x",
                        ok=ratio_unzip >= LOAD_TARGET,
                    )
                )
    print(
        markdown_table(
            ["source", "method", "median", "min", "max", "throughput (median)", "speed vs cp (median)"],
            rows,
            "llrrrrr",
        )
    )
    if daemon_error:
        print(f"\ndaemon not measured: {daemon_error}")
    print()
    print_targets(targets)
    print(f"({elapsed:.1f} s)")
    write_report(
        args.json,
        "bench_load",
        quick=args.quick,
        config=asdict(config),
        results=json_results | {"environment": env},
        targets=targets,
        elapsed_s=elapsed,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
