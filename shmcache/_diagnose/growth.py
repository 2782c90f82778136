"""Is a process's private memory growing? The verdict ``shmcache watch`` prints per process.

A robust slope (Theil-Sen) over the samples after a warm-up, against thresholds chosen so
that allocator jitter on a short run is *flat* and a slow leak on a long one is *growing*.
A process too short-lived for a slope (a DataLoader worker of a short epoch) is judged on
its whole life instead: a forked worker that copied a good part of what it inherited is
*growing* whatever the slope.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "COPY_MIN_FRACTION",
    "GROWTH_MIN_BYTES",
    "MAX_FIT_POINTS",
    "MIN_LIFE_S",
    "MIN_SAMPLES",
    "MIN_SPAN_S",
    "SLOPE_MIN_BYTES_PER_MIN",
    "STEP_MIN_BYTES",
    "WARMUP_S",
    "Verdict",
    "judge",
    "theil_sen",
]

MiB = 1 << 20

WARMUP_S = 3.0
"""Samples from a process's first seconds are ignored: imports, the first prefetch round
and allocator arenas settle there, and that rise is not a leak."""
SLOPE_MIN_BYTES_PER_MIN = 2 * MiB
"""A process is *growing* only if its robust slope is at least 2 MiB/min ..."""
GROWTH_MIN_BYTES = 8 * MiB
"""... and the fitted growth over its judged samples (slope x duration) is at least 8 MiB.
The pair ignores allocator jitter of a few MiB on short runs and still catches a slow
leak on a long one (2 MiB/min for 4 min)."""
STEP_MIN_BYTES = 64 * MiB
"""A forked worker whose private memory rose this much since it started copied part of
its parent (a fork-started DataLoader worker itself adds a few MiB)."""
COPY_MIN_FRACTION = 0.1
"""A forked worker too short-lived for a slope is *growing* when its private memory rose by
GROWTH_MIN_BYTES and by this fraction of its RSS at its first sample (what it inherited,
nearly all shared with its parent), or by STEP_MIN_BYTES: copying a tenth of the parent in
a few seconds is the Dataset's Python objects being touched, not a worker's own buffers."""
MIN_SAMPLES = 4
MIN_SPAN_S = 2.0
"""A slope needs MIN_SAMPLES samples over MIN_SPAN_S seconds after the warm-up."""
MIN_LIFE_S = 1.0
"""Without a slope, a process seen MIN_SAMPLES times over this long that did not grow is
*flat*; one seen less than that, without a copy to show, is too short to judge."""
MAX_FIT_POINTS = 120
"""Theil-Sen is quadratic in the points: longer traces are thinned evenly first."""

State = Literal["growing", "stepped", "flat", "short"]


@dataclass(frozen=True)
class Verdict:
    """Whether one process's private memory grew while it was watched."""

    pid: int
    state: State
    slope: float
    """Bytes per minute (Theil-Sen estimate over the samples after warm-up)."""
    growth: float
    """Fitted growth over the judged samples: slope x their duration, bytes."""
    span_s: float
    samples: int
    rise: float = 0.0
    """Private anonymous memory at its highest minus at the first sample, warm-up included."""
    forked: bool = False
    """A forked child (same command line as its parent): a DataLoader worker under fork."""
    start: float = 0.0
    """RSS at the first sample, bytes: for a forked worker, what it inherited from its parent."""
    whole_life: bool = False
    """Too short-lived for a slope: judged on all its samples, warm-up included
    (``span_s`` is then its life as seen, ``growth`` its rise)."""
    workers_copied: bool = False
    """Some of its forked workers grew: pages they stopped sharing with it became its own."""

    def describe(self) -> str:
        if self.whole_life:
            return self._describe_life()
        rate = f"{self.slope / MiB:+.1f} MiB/min"
        if self.state == "flat":
            return f"flat ({rate}, {self.growth / MiB:+.1f} MiB over {self.span_s:.0f} s)"
        if self.state == "stepped":
            return (
                f"flat now ({rate}) after its private memory rose {self.rise / MiB:+.1f} MiB since it "
                "started: a forked worker that copied this much holds its own copy of the Dataset's "
                "Python objects (copy-on-write)"
            )
        text = (
            f"growing at {self.slope / MiB:.1f} MiB/min ({self.growth / MiB:+.1f} MiB over "
            f"{self.span_s:.0f} s)"
        )
        if self.forked:
            return text + ": the copy-on-write leak signature"
        if self.workers_copied:
            return text + " (a parent also grows as its forked workers copy pages it shared with them)"
        return text + ": its own heap (no forked worker copied pages from it), not copy-on-write"

    def _describe_life(self) -> str:
        seen = f"{self.samples} samples over {self.span_s:.1f} s"
        rose = f"{self.rise / MiB:+.1f} MiB"
        if self.state == "growing":
            inherited = (
                f", {self.rise / self.start:.0%} of the {self.start / MiB:.1f} MiB it started with "
                "(shared with its parent)" if self.start else ""
            )
            return (
                f"growing: its private memory rose {rose} in its short life ({seen}){inherited}: a forked "
                "worker copying this much holds its own copy of the Dataset's Python objects (copy-on-write)"
            )
        if self.state == "flat":
            return f"flat over its short life ({rose}, {seen})"
        if self.rise >= GROWTH_MIN_BYTES and not self.forked:
            return (
                f"too short to tell start-up (imports, loading data) from growth: private memory rose "
                f"{rose} ({seen})"
            )
        return f"too short to judge ({seen})"


def theil_sen(times: Sequence[float], values: Sequence[float]) -> float:
    """Median of the pairwise slopes: one spike or a sawtooth cannot tilt it."""
    n = len(times)
    if n > MAX_FIT_POINTS:
        picks = [round(i * (n - 1) / (MAX_FIT_POINTS - 1)) for i in range(MAX_FIT_POINTS)]
        times = [times[i] for i in picks]
        values = [values[i] for i in picks]
        n = MAX_FIT_POINTS
    slopes = sorted(
        (values[j] - values[i]) / (times[j] - times[i])
        for i in range(n)
        for j in range(i + 1, n)
        if times[j] > times[i]
    )
    if not slopes:
        return 0.0
    mid = len(slopes) // 2
    return slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2


def judge(
    pid: int,
    times: Sequence[float],
    owns: Sequence[float],
    warmup_s: float = WARMUP_S,
    forked: bool = False,
    start: float = 0.0,
) -> Verdict:
    """Verdict over one process's samples (``times`` in seconds, ascending; ``owns`` in bytes;
    ``start``: its RSS at the first sample).

    The first ``warmup_s`` seconds after its first sample are skipped (at most half of
    what was seen). *growing* needs slope >= SLOPE_MIN_BYTES_PER_MIN and fitted growth
    >= GROWTH_MIN_BYTES. A ``forked`` worker that is flat now but rose by STEP_MIN_BYTES
    since its first sample is *stepped*: it copied that much early.

    Fewer than MIN_SAMPLES samples or MIN_SPAN_S seconds after the warm-up leave no slope:
    the whole life is judged by :func:`_judge_life`.
    """
    if not times:
        return Verdict(pid, "short", 0.0, 0.0, 0.0, 0, forked=forked, whole_life=True)
    rise = max(owns) - owns[0]
    skip = min(warmup_s, (times[-1] - times[0]) / 2)
    first = next(i for i, t in enumerate(times) if t - times[0] >= skip)
    t, v = list(times[first:]), list(owns[first:])
    span = t[-1] - t[0]
    if len(t) < MIN_SAMPLES or span < MIN_SPAN_S:
        return _judge_life(pid, times, owns, forked, start)
    slope = theil_sen(t, v) * 60.0
    growth = slope * span / 60.0
    state: State
    if slope >= SLOPE_MIN_BYTES_PER_MIN and growth >= GROWTH_MIN_BYTES:
        state = "growing"
    elif forked and rise >= STEP_MIN_BYTES:
        state = "stepped"
    else:
        state = "flat"
    return Verdict(pid, state, slope, growth, span, len(t), rise, forked, start)


def _judge_life(
    pid: int, times: Sequence[float], owns: Sequence[float], forked: bool, start: float
) -> Verdict:
    """A short life, warm-up included: a forked worker whose private memory rose past the
    copy bar (COPY_MIN_FRACTION of ``start``, at least GROWTH_MIN_BYTES, at most
    STEP_MIN_BYTES) is *growing*, from two samples on; a process seen MIN_SAMPLES times
    over MIN_LIFE_S that stayed under it (under GROWTH_MIN_BYTES if not forked) is *flat*.
    Anything else is *short*: a non-forked process's early rise cannot be told from its
    start-up."""
    life = times[-1] - times[0]
    rise = max(owns) - owns[0]
    copy_bar = min(STEP_MIN_BYTES, max(GROWTH_MIN_BYTES, COPY_MIN_FRACTION * start))
    flat_bar = copy_bar if forked else GROWTH_MIN_BYTES
    state: State = "short"
    if forked and len(times) >= 2 and rise >= copy_bar:
        state = "growing"
    elif len(times) >= MIN_SAMPLES and life >= MIN_LIFE_S and rise < flat_bar:
        state = "flat"
    slope = theil_sen(times, owns) * 60.0 if len(times) >= 2 else 0.0
    return Verdict(pid, state, slope, rise, life, len(times), rise, forked, start, whole_life=True)
