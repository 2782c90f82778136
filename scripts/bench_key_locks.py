#!/usr/bin/env python
"""Benchmark: the key locks of one big batch (a directory put's publish), by bytes vs by
whole lock files.

Times ``key_locks(layout, keys)`` on N keys (taking, then releasing; wall and CPU time) in a temporary root
on /dev/shm, the ways interleaved round-robin in one process so drift on a noisy machine
hits all alike:

- ``bytes``: one ``fcntl`` byte lock per key, as before whole files (the threshold
  ``WHOLE_FILE_KEYS`` set out of reach);
- ``whole``: each lock file with enough keys locked whole, then its gaps unlocked (the
  default);
- ``busy-file``: whole files, but another process holds an unrelated byte of one file,
  whose keys are then taken byte by byte;
- ``before`` (with ``--before PATH``): the ``key_locks`` of another ``locks.py`` (say,
  ``git show REV:shmcache/_store/locks.py > /tmp/locks_before.py``), loaded beside this one;
  only a ``locks.py`` from before its split (a REV up to ``df5797b``) is whole: a later one
  imports ``lock_batches`` and its siblings from this tree (compare trees on ``PYTHONPATH``).

Usage::

    python scripts/bench_key_locks.py [--keys 100000] [--repeats 5] [--before PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from shmcache import Store
from shmcache._store import key_slots, lock_batches, locks

Times = tuple[float, float, float, float]  # take, release (wall); take, release (CPU of this process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", help="another locks.py to time alongside")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        store = Store(tmp)
        store.prepare()
        layout = store.layout
        keys = [f"d/f{i:06d}.npy" for i in range(args.keys)]
        threshold = lock_batches.WHOLE_FILE_KEYS

        def timed(key_locks: Callable[..., AbstractContextManager[None]]) -> Times:
            start, cpu = time.perf_counter(), time.process_time()
            with key_locks(layout, keys, 60):
                taken, taken_cpu = time.perf_counter(), time.process_time()
            done, done_cpu = time.perf_counter(), time.process_time()
            return taken - start, done - taken, taken_cpu - cpu, done_cpu - taken_cpu

        def batch() -> Times:
            return timed(locks.key_locks)

        def by_bytes() -> Times:
            lock_batches.WHOLE_FILE_KEYS = 1 << 62
            try:
                return batch()
            finally:
                lock_batches.WHOLE_FILE_KEYS = threshold

        # another process holds a byte of one lock file that no key of the batch maps to
        path = key_slots.slot_files(layout)[0]
        holder = subprocess.Popen(
            [sys.executable, "-c", _BYTE_HOLDER, path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        ways: dict[str, Callable[[], Times]] = {
            "bytes": by_bytes,
            "whole": batch,
        }
        if args.before:
            spec = importlib.util.spec_from_file_location("shmcache._store._locks_before", args.before)
            assert spec is not None and spec.loader is not None
            before = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(before)

            def by_before() -> Times:
                return timed(before.key_locks)

            ways["before"] = by_before
        results: dict[str, list[Times]] = {name: [] for name in [*ways, "busy-file"]}
        try:
            for _ in range(args.repeats):
                for name, way in ways.items():
                    results[name].append(way())
                results["busy-file"].append(batch())  # the holder's byte is in file 0
        finally:
            holder.communicate("\n", timeout=60)
        print(f"key_locks on {args.keys:,} keys, {locks.KEY_LOCK_FILES} files, WHOLE_FILE_KEYS={threshold}")
        print(f"load average {os.getloadavg()[0]:.2f} / {os.getloadavg()[1]:.2f} (1 / 5 min)")
        for name, times in results.items():
            take, free, take_cpu, free_cpu = (sorted(column) for column in zip(*times, strict=True))
            print(
                f"{name:>10}: take median {statistics.median(take) * 1e3:8.1f} ms"
                f" (min {take[0] * 1e3:.1f}, max {take[-1] * 1e3:.1f};"
                f" CPU {statistics.median(take_cpu) * 1e3:.1f}),"
                f" release median {statistics.median(free) * 1e3:6.1f} ms"
                f" (CPU {statistics.median(free_cpu) * 1e3:.1f})"
            )


_BYTE_HOLDER = """
import os, sys
from shmcache._disk.fs import try_lock_range
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
assert try_lock_range(fd, (1 << 58) + 7, False)  # beyond every key's byte (hashes are 58 bits)
print("held", flush=True)
sys.stdin.readline()
"""


if __name__ == "__main__":
    main()
