"""The copy phase of a directory put on every core the process may run on.

A directory put's per-file work is mostly system calls (``mkdir``, ``open``, ``pread``,
``write``, ``close``, ``stat``) and the CRC-32 of each file, all of which release the GIL:
a second thread copies while the first waits in the kernel (``cp -r`` uses one core; the
issue's "near the hardware" asks for what the machine has). Items are taken in plan order
from one shared counter (a thread slowed by a busy machine takes fewer), each by exactly
one thread; the first error (or a progress callback's cancel) stops the others at their
next item or chunk, and is raised unchanged once every thread has stopped (nothing else
touches the batch after that).

Progress is reported from the calling thread only, as ``put_file``'s ``progress=`` always
was: the workers add the bytes they copy to counters of their own, and the caller reports
the sum after each chunk it copies itself, and while it waits for the others.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

from .._sources.planned import Planned

__all__ = ["copy_threads", "run_copies"]

MAX_THREADS = 4
"""More threads than this gain nothing: the kernel's directory locks and memory bandwidth
are shared (and a directory put must not take every core of a big machine)."""
MIN_BYTES = 8 << 20
"""Smaller batches are copied by the calling thread alone: starting a thread costs ~100
us, more than a few files' copies."""
MIN_AVERAGE = 64 << 10
"""Nor batches of smaller files: their copy is mostly Python between short system calls,
and two threads passing the GIL back and forth at each call cost more than they overlap
(on 2 cores: 1 KiB files 1.2x the time of one thread, 16-32 KiB within the noise, 100 KiB
0.9-0.95x, 1 MiB 0.6x; BENCHMARKS.md, "Directory puts")."""
_REPORT_EVERY = 0.05
"""Seconds between the caller's progress reports while it waits for the other threads."""

Work = Callable[[int, Callable[[int], None]], None]
"""``work(index, add)``: copy item ``index`` of the batch, calling ``add(n)`` per ``n`` bytes."""


def copy_threads(plan: Sequence[Planned]) -> int:
    """How many threads copy ``plan`` (1: the calling thread alone): several for a batch big
    enough to pay for them, of files big enough, whose items are all byte copies (a
    ``.npy``, a stored ``.npz`` member, a built header and a raw range); anything decoded
    (a compressed member, an HDF5 dataset, a strided tensor, a container) keeps the whole
    batch on one thread."""
    total, size, last = 0, 0, None
    for item in plan:  # one pass; a directory's files share a few header objects
        if item.container is not None or item.write is not None or item.copy_offset is None:
            return 1
        if item.header is not last:
            last, size = item.header, item.header.file_size
        total += size
    if len(plan) < 2 or total < MIN_BYTES or total < MIN_AVERAGE * len(plan):
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_THREADS, len(plan)))


def run_copies(count: int, work: Work, threads: int, advance: Callable[[int], None]) -> None:
    """Run ``work(i, add)`` for every ``i`` of ``range(count)`` on ``threads`` threads, the
    calling one included; ``advance(n)`` (progress, which may raise to cancel) is called
    from the calling thread only, and has been given every byte once this returns. The
    first exception (from a worker, ``work`` or ``advance``) stops the rest and is raised
    after every thread has stopped."""
    run = _Run(count, work, threads, advance)
    finished = threading.Semaphore(0)

    def background(slot: int) -> None:
        try:
            run.work(slot)
        finally:
            finished.release()

    workers = [
        threading.Thread(target=background, args=(slot,), name="shmcache-copy", daemon=True)
        for slot in range(1, threads)
    ]
    started = 0
    try:
        for worker in workers:
            try:
                worker.start()
            except RuntimeError:  # no more threads (a process or cgroup limit): fewer copy
                break
            started += 1
        run.work(0)
        waiting = started
        while waiting and run.error is None:
            if finished.acquire(timeout=_REPORT_EVERY):
                waiting -= 1
            run.report()
    except BaseException as exc:
        run.fail(exc)
        if not isinstance(exc, Exception):  # an interrupt wins over a worker's error
            run.error = exc
    finally:
        run.stop = True
        _join(workers[:started])
    if run.error is not None:
        raise run.error
    run.report()


class _Stopped(Exception):
    """Raised in a worker's copy once the run is stopped (never the run's error)."""


class _Run:
    """The shared state of one :func:`run_copies`."""

    def __init__(self, count: int, work: Work, threads: int, advance: Callable[[int], None]) -> None:
        self.todo = iter(range(count))  # next() on it is atomic: each index is taken once
        self._work = work
        self._advance = advance
        self.copied = [0] * threads  # each slot written by its own thread only
        self.reported = 0
        self.error: BaseException | None = None
        self.stop = False
        self._lock = threading.Lock()

    def work(self, slot: int) -> None:
        """Take items until none is left or one failed; the calling thread (slot 0) reports
        progress as it copies."""
        copied = self.copied
        if slot == 0:

            def add(nbytes: int) -> None:
                copied[0] += nbytes
                self.report()

        else:

            def add(nbytes: int) -> None:
                copied[slot] += nbytes
                if self.stop:  # another item failed, or progress cancelled: stop mid-file
                    raise _Stopped

        try:
            for index in self.todo:
                if self.stop:
                    return
                self._work(index, add)
        except BaseException as exc:
            if slot == 0:
                raise
            self.fail(exc)

    def report(self) -> None:
        """Give ``advance`` what was copied since the last report (calling thread only)."""
        done = sum(self.copied)
        if done > self.reported:
            delta, self.reported = done - self.reported, done
            self._advance(delta)

    def fail(self, exc: BaseException) -> None:
        """Record the first error and stop every thread at its next item."""
        with self._lock:
            if self.error is None:
                self.error = exc
            self.stop = True


def _join(workers: list[threading.Thread]) -> None:
    """Wait for every worker, even through a ``KeyboardInterrupt`` (raised after): the
    batch is removed by the caller's cleanup only once no thread writes into it."""
    interrupted: BaseException | None = None
    for worker in workers:
        while worker.is_alive():
            try:
                worker.join()
            except BaseException as exc:  # a signal's exception, raised in the main thread
                interrupted = interrupted or exc
    if interrupted is not None:
        raise interrupted
