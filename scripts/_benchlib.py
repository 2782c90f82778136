"""Shared pieces of the benchmark scripts: sample statistics, markdown tables, target
rows, the machine description, temporary roots on /dev/shm and the JSON report.

Every ``bench_*.py`` in ``scripts/`` imports this from its own directory (Python puts a
script's directory first on ``sys.path``), so each stays runnable on its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
SHM = Path("/dev/shm")

__all__ = [
    "SHM",
    "GiB",
    "MiB",
    "Samples",
    "Target",
    "environment",
    "fmt_bytes",
    "fmt_seconds",
    "mark",
    "markdown_table",
    "print_targets",
    "scratch_dir",
    "write_report",
]


@dataclass
class Samples:
    """Repeated measurements of one quantity (one value per repeat)."""

    values: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        self.values.append(value)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def min(self) -> float:
        return min(self.values) if self.values else float("nan")

    @property
    def max(self) -> float:
        return max(self.values) if self.values else float("nan")

    def summary(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.min, "max": self.max, "values": list(self.values)}


@dataclass
class Target:
    """One DESIGN.md target as measured: the row it belongs to, the measured ratio and
    whether it is met (``ok`` None: shown for information, not a target)."""

    target: str
    """The target as DESIGN.md states it, e.g. ``"load .npy >= 0.9x cp"``."""
    row: str
    """What was measured, e.g. ``"1 GiB .npy, Store.put_file vs cp"``."""
    measured: float
    """The measured ratio (or value) the target is checked against."""
    measured_text: str
    ok: bool | None
    note: str = ""


def mark(ok: bool | None) -> str:
    return "" if ok is None else ("✓" if ok else "✗")


def fmt_seconds(seconds: float) -> str:
    if seconds != seconds:  # NaN
        return "n/a"
    if seconds < 1e-6:
        return f"{seconds * 1e9:.0f} ns"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(nbytes: float) -> str:
    if nbytes >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    if nbytes >= MiB:
        return f"{nbytes / MiB:.1f} MiB"
    return f"{nbytes / 1024:.1f} KiB"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]], align: str = "") -> str:
    """A markdown table; ``align`` has one character per column (``l`` or ``r``)."""
    align = align.ljust(len(header), "l")
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def print_targets(targets: Sequence[Target]) -> None:
    print(
        markdown_table(
            ["target (DESIGN.md)", "row", "measured", "ok"],
            [
                (t.target, t.row, t.measured_text + (f" ({t.note})" if t.note else ""), mark(t.ok))
                for t in targets
            ],
        )
    )
    checked = [t for t in targets if t.ok is not None]
    met = sum(bool(t.ok) for t in checked)
    print(f"\n{met}/{len(checked)} targets met")


def environment() -> dict[str, Any]:
    """The machine and the versions a result was measured with."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fp:
        for line in fp:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    ram = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as fp:
        for line in fp:
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * 1024
                break
    env: dict[str, Any] = {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "ram_bytes": ram,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
    for module in ("numpy", "torch", "shmcache"):
        loaded = sys.modules.get(module)
        if loaded is not None:
            env[module] = getattr(loaded, "__version__", "?")
    return env


@contextlib.contextmanager
def scratch_dir(prefix: str, on_shm: bool = True) -> Iterator[Path]:
    """A fresh directory (on /dev/shm when ``on_shm`` and it exists, else the temp
    directory), removed with everything in it on exit, whatever happened."""
    parent = str(SHM) if on_shm and SHM.is_dir() else None
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def write_report(
    path: str | os.PathLike[str] | None,
    benchmark: str,
    *,
    quick: bool,
    config: Any,
    results: Any,
    targets: Sequence[Target],
    elapsed_s: float,
    plots: Sequence[Path] = (),
) -> None:
    """The JSON every script writes with ``--json`` (``bench_all`` reads ``targets``)."""
    if path is None:
        return
    report = {
        "benchmark": benchmark,
        "quick": quick,
        "environment": environment(),
        "config": config,
        "elapsed_s": elapsed_s,
        "results": results,
        "targets": [asdict(t) for t in targets],
        "plots": [str(p) for p in plots],
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fp:
        json.dump(report, fp, indent=1, default=str)
