"""``shmcache watch``'s recorder: samples a process tree into a CSV, keeps the series for
the growth verdict, and plots USS/PSS per process (matplotlib, when installed), and GPU
memory per process where NVML is (``nvml``; the ``gpu`` column is empty without it).

Each process is sampled every FAST_INTERVAL_S during its warm-up, then at the configured
interval: a DataLoader worker of a short epoch may live two seconds, and those samples are
all the verdict will have of it."""

from __future__ import annotations

import csv
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .growth import WARMUP_S, Verdict, judge
from .nvml import GpuMemory
from .procfs import Memory, command_line, parent_pid, process_tree, read_memory

__all__ = ["CSV_HEADER", "FAST_INTERVAL_S", "Series", "WatchRecorder"]

MiB = 1 << 20
CSV_HEADER = ("time_s", "pid", "ppid", "cmd", "rss", "pss", "uss", "own", "cache_pss", "gpu")
FAST_INTERVAL_S = 0.2
"""How often a process is sampled in its first WARMUP_S seconds, and how often the tree is
walked for new workers. One smaps read of a process with a few hundred MiB costs ~10-20 ms,
so the recorder also waits at least as long as its last round took (at most half a core)."""
_LEGEND_MAX = 12


@dataclass
class Series:
    """Samples of one process seen by ``watch``."""

    pid: int
    ppid: int
    command: str
    times: list[float] = field(default_factory=list)
    memories: list[Memory] = field(default_factory=list)
    gpus: list[int | None] = field(default_factory=list)
    """GPU memory at each sample (NVML; None without it)."""


class WatchRecorder:
    """Samples a process tree into a CSV (one row per process per sample) and keeps the
    series for the verdict and the plot."""

    def __init__(
        self, csv_path: Path, started: float, cache_root: Path | None = None, interval: float = 1.0
    ) -> None:
        self.csv_path = csv_path
        self.cache_root = cache_root
        self.started = started
        self.interval = interval
        self.tick = min(interval, FAST_INTERVAL_S)
        """How often :meth:`sample` should be called."""
        self.series: dict[int, Series] = {}
        self.root_pid = -1
        self.gpu = GpuMemory()
        self._file = open(csv_path, "w", newline="")  # noqa: SIM115 - closed in close()
        self._writer = csv.writer(self._file)
        self._writer.writerow(CSV_HEADER)

    def sample(self, root_pid: int, now: float) -> int:
        """Walk ``root_pid``'s tree (call every ``tick`` seconds) and read the processes that are
        new, in their warm-up, or due at the interval; returns how many were read."""
        seen = 0
        self.root_pid = root_pid
        elapsed = now - self.started
        on_gpu = self.gpu.by_pid() if self.gpu.available else None  # one NVML read per round
        for pid in process_tree(root_pid):
            series = self.series.get(pid)
            if series is not None and not self._due(series, elapsed):
                continue
            memory = read_memory(pid, self.cache_root)
            if memory is None:
                continue
            if series is None:
                series = self.series[pid] = Series(pid, parent_pid(pid), command_line(pid, 120))
            elapsed = time.monotonic() - self.started  # a round of reads takes a while: stamp each
            series.times.append(elapsed)
            series.memories.append(memory)
            used = None if on_gpu is None else on_gpu.get(pid, 0)
            series.gpus.append(used)
            self._writer.writerow(
                (f"{elapsed:.3f}", pid, series.ppid, series.command, memory.rss, memory.pss, memory.uss,
                 memory.own, memory.cache_pss, "" if used is None else used)
            )
            seen += 1
        self._file.flush()
        return seen

    def _due(self, series: Series, elapsed: float) -> bool:
        """In its warm-up (sampled every tick), or an interval since its last sample."""
        if elapsed - series.times[0] < WARMUP_S:
            return True
        return elapsed - series.times[-1] >= self.interval - self.tick / 2

    def close(self) -> None:
        self._file.close()
        self.gpu.close()

    def verdicts(self) -> list[tuple[Series, Verdict]]:
        """Each process's series with its verdict; a child with its parent's command line
        counts as forked (a DataLoader worker under fork), and a parent learns whether any
        of its forked workers grew (then its own growth may be pages they copied)."""
        judged = {}
        for s in self.series.values():
            parent = self.series.get(s.ppid)
            forked = s.pid != self.root_pid and parent is not None and parent.command == s.command
            owns = [m.own for m in s.memories]
            judged[s.pid] = judge(s.pid, s.times, owns, forked=forked, start=s.memories[0].rss)
        grew = ("growing", "stepped")
        copied_from = {self.series[pid].ppid for pid, v in judged.items() if v.forked and v.state in grew}
        return [
            (s, dataclasses.replace(judged[s.pid], workers_copied=s.pid in copied_from))
            for s in self.series.values()
        ]

    def plot(self, png_path: Path, title: str) -> bool:
        """USS and PSS (and GPU memory, with NVML) per process over time; False (nothing
        written) without matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return False
        gpu = any(g is not None for s in self.series.values() for g in s.gpus)
        fig, axes = plt.subplots(1, 3 if gpu else 2, figsize=(19 if gpu else 13, 5), sharex=True)
        ax_uss, ax_pss = axes[0], axes[1]
        panels = [(ax_uss, "USS (private)"), (ax_pss, "PSS (proportional share)")]
        if gpu:
            panels.append((axes[2], "GPU memory (NVML)"))
        shown = sorted(self.series.values(), key=lambda s: -max((m.pss for m in s.memories), default=0))
        for n, s in enumerate(shown):
            label = f"{s.pid} main" if s.pid == self.root_pid else f"{s.pid} child of {s.ppid}"
            kwargs: dict[str, Any] = {"label": label if n < _LEGEND_MAX else None, "linewidth": 1.2}
            line = ax_uss.plot(s.times, [m.uss / MiB for m in s.memories], **kwargs)[0]
            ax_pss.plot(s.times, [m.pss / MiB for m in s.memories], color=line.get_color(), **kwargs)
            if gpu:
                used = [(g or 0) / MiB for g in s.gpus]
                axes[2].plot(s.times, used, color=line.get_color(), **kwargs)
        for ax, what in panels:
            ax.set_title(f"{what} per process")
            ax.set_xlabel("seconds since start")
            ax.set_ylabel("MiB")
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
        if ax_uss.get_legend_handles_labels()[1]:  # none when no process was sampled (matplotlib warns)
            ax_uss.legend(fontsize="small")
        fig.suptitle(title[:120])
        fig.tight_layout()
        fig.savefig(png_path, dpi=100)
        plt.close(fig)
        return True
