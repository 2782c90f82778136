"""Tables and flat-memory checks shared by the local and remote table tests: a table of
mixed column types, a big multi-row-group Parquet file, and the peak RSS (VmHWM) a fresh
process gains while it loads one."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BIG_ROWS", "assert_flat", "mixed_table", "peak_growth", "write_big_parquet"]

BIG_ROWS = 5_000_000  # float64 + int64 + 20-byte strings: ~190 MiB


def mixed_table(rows: int, *, categorical: bool = True) -> Any:
    """Numbers, nullable strings, lists and bools (the first nulls after the first batch);
    ``categorical``: a dictionary column and a timestamp column too."""
    import pyarrow as pa

    ids = np.arange(rows)
    columns = {
        "id": pa.array(ids, pa.int64()),
        "x": pa.array(np.sqrt(ids), pa.float32()),
        "text": pa.array([None if i % 7 == 3 else f"row {i}" * (i % 5) for i in ids], pa.string()),
        "lists": pa.array([None if i % 11 == 1 else list(range(i % 4)) for i in ids], pa.list_(pa.int32())),
        "flag": pa.array([None if i % 13 == 2 else bool(i % 2) for i in ids], pa.bool_()),
    }
    if categorical:
        columns["cat"] = pa.array([None if i % 17 == 5 else f"c{i % 3}" for i in ids]).dictionary_encode()
        columns["when"] = pa.array(ids * 1_000_000, pa.timestamp("us"))
    return pa.table(columns)


def write_big_parquet(path: Path, rows: int = BIG_ROWS, groups: int = 25) -> int:
    """An uncompressed Parquet file of ``rows`` rows in ``groups`` row groups; its size."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(1)
    letters = pa.py_buffer(rng.integers(97, 123, rows * 20, dtype=np.uint8))
    offsets = pa.py_buffer(np.arange(0, rows * 20 + 1, 20, dtype=np.int32))
    strings = pa.StringArray.from_buffers(rows, offsets, letters)
    table = pa.table({"x": rng.random(rows), "n": rng.integers(0, 1 << 60, rows), "s": strings})
    pq.write_table(table, path, compression="none", row_group_size=-(-rows // groups))
    return path.stat().st_size


def peak_growth(warm_up: str, load: str, timeout: float = 300) -> tuple[int, int]:
    """Run ``warm_up`` (imports, a small load of the same kind, data made), then ``load`` in a
    fresh Python process; its peak RSS (VmHWM, reset to the RSS after ``warm_up``) before
    and after ``load``, in bytes."""
    script = "\n".join(
        [
            "def peak():",
            "    status = open('/proc/self/status').read().splitlines()",
            "    return next(int(line.split()[1]) * 1024 for line in status if line.startswith('VmHWM:'))",
            textwrap.dedent(warm_up),
            "open('/proc/self/clear_refs', 'w').write('5')  # the peak so far := RSS now",
            "before = peak()",
            textwrap.dedent(load),
            "print(before, peak())",
        ]
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    before, after = map(int, done.stdout.split())
    return before, after


def assert_flat(smaller: tuple[int, int], bigger: tuple[int, int], what: str) -> None:
    """Two loads of the same kind, each as (peak RSS growth, bytes loaded): memory is flat
    when the bigger load grows the process by under a quarter of the bytes it adds over the
    smaller one (a whole decode: all of them and more), and by under 60% of its own bytes.
    Compared with each other, not with a fixed share: what the allocator keeps beyond the
    batches in flight differs between machines (one CI run: +96 MiB where this VM had +78)."""
    (small_growth, small_bytes), (big_growth, big_bytes) = smaller, bigger
    report = (
        f"{what}: peak RSS grew {small_growth >> 20} MiB for {small_bytes >> 20} MiB, "
        f"{big_growth >> 20} MiB for {big_bytes >> 20} MiB"
    )
    assert big_bytes - small_bytes > 50 << 20, report
    assert big_growth - small_growth < 0.25 * (big_bytes - small_bytes), report
    assert big_growth < 0.6 * big_bytes, report
    print(report)
