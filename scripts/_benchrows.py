"""What the ingest benchmarks share beyond ``_benchlib``: a table row of a method against
its baseline (:class:`Row`) and the report printed from rows (``bench_ingest``,
``bench_ingest_formats``), and a measured child process (its seconds, its peak RSS: those two
and ``bench_remote``). Standard library only, as ``_benchlib``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from _benchlib import Samples, Target, fmt_bytes, fmt_seconds, markdown_table, print_targets, write_report

__all__ = ["PEAK_RSS_LINE", "Row", "report_rows", "run_child"]


@dataclass
class Row:
    """One line of the table: a method against its baseline, and the target it is held to."""

    name: str
    method: str
    baseline: str
    method_s: Samples
    baseline_s: Samples
    target: str
    goal: float | None
    """For a speed row the least ratio (baseline time / method time); for a time row the
    most milliseconds; None: shown for information."""
    kind: str = "speed"  # or "ms", "slowdown" (method time / baseline time), "bytes" (method / baseline size)
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def measured(self) -> float:
        if self.kind == "speed":
            return self.baseline_s.median / self.method_s.median
        if self.kind in ("slowdown", "bytes"):
            return self.method_s.median / self.baseline_s.median
        return self.method_s.median * 1e3

    @property
    def measured_text(self) -> str:
        if self.kind == "speed":
            return f"{self.measured:.2f}x"
        if self.kind == "slowdown":
            return f"{self.measured:.2f}x its time"
        if self.kind == "bytes":
            return f"{self.measured:.2f}x its size"
        return f"{self.measured:.1f} ms"

    @property
    def ok(self) -> bool | None:
        if self.goal is None:
            return None
        return self.measured >= self.goal if self.kind == "speed" else self.measured <= self.goal

    def shown(self, seconds_or_bytes: float) -> str:
        """A measurement of this row as the table shows it."""
        return fmt_bytes(seconds_or_bytes) if self.kind == "bytes" else fmt_seconds(seconds_or_bytes)


PEAK_RSS_LINE = (
    "peak = next(int(line.split()[1]) * 1024 for line in open('/proc/self/status') "
    "if line.startswith('VmHWM:'))"
)
"""Python that sets ``peak`` to the peak RSS of the running process, in bytes (VmHWM:
``ru_maxrss`` of a child would count what its parent had); for code run by :func:`run_child`."""


def run_child(code: str, *args: str, what: str = "") -> dict[str, Any]:
    """Run ``python -c code args`` in a fresh process and return the JSON object its last
    line prints (its seconds, its peak RSS...); a failure raises with its stderr."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{what or 'a measured child'} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(result, dict)
    return result


def report_rows(
    rows: Sequence[Row], title: str, json_path: str | None, script: str, **report: Any
) -> None:
    """Print ``title``, the table of ``rows`` (baseline, method, measured, target) and the
    targets, then write the JSON report (``report``: ``write_report``'s other fields):
    what ``bench_ingest`` and ``bench_ingest_formats`` print alike."""
    print(title + "\n")
    table = [
        [
            r.name,
            r.baseline,
            r.shown(r.baseline_s.median),
            r.method,
            r.shown(r.method_s.median),
            r.measured_text,
            r.target,
            {True: "✓", False: "✗", None: ""}[r.ok],
            r.note,
        ]
        for r in rows
    ]
    header = ["row", "baseline", "baseline time", "method", "method time", "measured", "target", "ok", "note"]
    print(markdown_table(header, table, "llrlrrll"))
    print()
    targets = [Target(r.target, r.name, r.measured, r.measured_text, r.ok, r.note) for r in rows]
    print_targets([t for t in targets if t.ok is not None])
    results = {
        r.name: {
            "method": r.method,
            "baseline": r.baseline,
            "method_s": r.method_s.summary(),
            "baseline_s": r.baseline_s.summary(),
            "kind": r.kind,
            "measured": r.measured,
            "target": r.target,
            "ok": r.ok,
            "note": r.note,
            **r.extra,
        }
        for r in rows
    }
    write_report(json_path, script, results=results, targets=targets, **report)
