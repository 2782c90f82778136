#!/usr/bin/env python
"""Benchmark: opening the packed entries of a directory put (1 KiB ``.npy`` files).

Two measurements, each in fresh child processes so that one shmcache can be compared
with another (``--old PATH``: a checkout put first on the child's ``PYTHONPATH``, e.g.
``git archive <commit> | tar -x -C PATH``):

- ``cold``: in a process that already opened one key of the batch, the per-key time of
  ``open_array`` of other keys of it (each opened once: cold), interleaved in chunks with
  ``numpy.lib.format.open_memmap(mode="r")`` of as many distinct 1 KiB files (the same
  files' sources), and old/new processes alternated;
- ``all``: one process opening every key of the put and holding them: time, descriptors
  open, and lines of ``/proc/self/maps`` under the root, or the error that stopped it.

Usage::

    python scripts/bench_packed_open.py [--count N] [--rounds R] [--old PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

ITEMS = 224  # int32: a 1 KiB .npy

COLD = textwrap.dedent(
    """
    import json, os, sys, time
    import numpy.lib.format as fmt
    import shmcache
    root, src, first, count, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), 100
    shmcache.open_array("d/f0", root=root)  # a warm process: the batch already opened once
    fmt.open_memmap(os.path.join(src, "f0.npy"), mode="r")
    keys = [f"d/f{i}" for i in range(first, first + count)]
    files = [os.path.join(src, f"f{i}.npy") for i in range(first, first + count)]
    ours, theirs, keep = [], [], []
    for at in range(0, count, chunk):
        t = time.perf_counter_ns()
        for key in keys[at : at + chunk]:
            keep.append(shmcache.open_array(key, root=root))
        ours.append((time.perf_counter_ns() - t) / chunk)
        t = time.perf_counter_ns()
        for path in files[at : at + chunk]:
            keep.append(fmt.open_memmap(path, mode="r"))
        theirs.append((time.perf_counter_ns() - t) / chunk)
    print(json.dumps([ours, theirs, shmcache.__file__]))
    """
)

ALL = textwrap.dedent(
    """
    import json, os, sys, time
    import shmcache
    root, count = sys.argv[1], int(sys.argv[2])
    arrays, error = [], None
    t = time.perf_counter()
    try:
        for i in range(count):
            arrays.append(shmcache.open_array(f"d/f{i}", root=root))
    except Exception as exc:
        error = f"{type(exc).__name__} at key {len(arrays)}"
    elapsed = time.perf_counter() - t
    objects = os.path.realpath(os.path.join(root, "objects"))
    with open("/proc/self/maps") as maps:
        mapped = sum(1 for line in maps if objects in line)
    right = all(int(a[0]) == i for i, a in enumerate(arrays))
    fds = len(os.listdir("/proc/self/fd"))
    print(json.dumps({"opened": len(arrays), "seconds": round(elapsed, 3), "fds": fds, "maps": mapped,
                      "correct": right, "error": error}))
    """
)


def _write(src: Path, count: int) -> None:
    import io

    buffer = io.BytesIO()
    np.save(buffer, np.zeros(ITEMS, np.int32))
    header = buffer.getvalue()[: -4 * ITEMS]
    src.mkdir()
    for i in range(count):
        (src / f"f{i}.npy").write_bytes(header + np.full(ITEMS, i, np.int32).tobytes())


def _run(code: str, args: list[str], path: str | None) -> str:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = path
    proc = subprocess.run(  # cwd: not this checkout, which "-c" would put first on sys.path
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=900, cwd="/"
    )
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--cold", type=int, default=2000, help="keys opened cold per process")
    parser.add_argument("--old", help="a checkout of another shmcache to compare with")
    args = parser.parse_args()
    import shmcache

    versions = {"new": None} if args.old is None else {"old": args.old, "new": None}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as scratch:
        src, root = Path(scratch) / "src", Path(scratch) / "root"
        _write(src, args.count)
        shmcache.Store(root).put_file("d", src)
        per_op: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in versions}
        for r in range(args.rounds):
            first = 1 + r * args.cold
            for name, path in versions.items():
                ours, theirs, where = json.loads(
                    _run(COLD, [str(root), str(src), str(first), str(args.cold)], path)
                )
                assert (path is None) != where.startswith(path or "/nowhere"), where
                per_op[name][0].extend(ours)
                per_op[name][1].extend(theirs)
        print(f"load average: {os.getloadavg()}")
        for name, (ours, theirs) in per_op.items():
            o, t = statistics.median(ours), statistics.median(theirs)
            print(
                f"cold open_array of another packed key [{name}]: {o / 1000:.2f} us/key, "
                f"open_memmap {t / 1000:.2f} us/file, ratio {o / t:.2f}x"
            )
        for name, path in versions.items():
            opened = _run(ALL, [str(root), str(args.count)], path).strip()
            print(f"open all {args.count} keys [{name}]: {opened}")


if __name__ == "__main__":
    main()
