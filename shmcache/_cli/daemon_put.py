"""``put`` through the daemon: submit one load per source, follow them on one bar, and
after Ctrl+C ask the daemon what became of each before saying anything.

A load interrupted near its end may already be publishing when the cancel arrives (the
daemon then finishes it), so the command never guesses: it cancels, waits up to
:data:`SETTLE_S` for every job to reach a final state, and reports each one as the daemon
does. Further Ctrl+C are ignored meanwhile (that wait is bounded), so the report cannot
be cut short. Exit statuses (README, "Exit codes"): 0 when every load was published,
the interrupt came too late to stop it; 130 when a load was cancelled and published
nothing; 1 when one failed, or its outcome is unknown.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from .._sources.urls import is_url
from ..errors import JobCancelledError, ShmCacheError
from .common import EXIT_FAILED, EXIT_INTERRUPTED, warn_or_raise

if TYPE_CHECKING:
    from rich.progress import Progress

    from ..client import Client, Job

__all__ = ["SETTLE_S", "Outcome", "interrupts_restored", "put_through", "report"]

SETTLE_S = 10.0
"""How long after Ctrl+C the command waits for the daemon to settle each interrupted load."""
_POLL_MIN_S = 0.01
_POLL_MAX_S = 0.2
_LATE_S = 1.0


def put_through(
    client: Client,
    sources: list[tuple[str, Path | str]],
    pin: bool,
    overwrite: bool,
    bar: Progress,
    title: str,
    as_: str = "auto",
    dtype: str | None = None,
) -> Outcome:
    """Submit one load per source (the daemon runs them in parallel) and follow them on one
    bar until they are final, or until Ctrl+C: then each is cancelled, and is as final as
    the daemon made it within :data:`SETTLE_S`. A refused source cancels those already
    submitted and raises."""
    jobs: list[Job] = []
    since = time.time()
    try:
        for key, source in sources:
            jobs.append(client.load(key, source, pin=pin, overwrite=overwrite, as_=as_, dtype=dtype))
        with bar:
            task = bar.add_task(title, total=None)
            delay = _POLL_MIN_S
            while True:
                jobs = [client.refresh(job) if job.active else job for job in jobs]
                totals = [job.bytes_total for job in jobs]
                known = all(t is not None for t in totals)
                bar.update(task, completed=sum(job.bytes_done for job in jobs),
                           total=sum(t or 0 for t in totals) if known else None)
                if not any(job.active for job in jobs):
                    _ignore_interrupts()  # they are final: a late Ctrl+C must not cut the report
                    return Outcome(jobs)
                time.sleep(delay)
                delay = min(delay * 2, _POLL_MAX_S)
    except KeyboardInterrupt:
        _ignore_interrupts()  # until the report is out: see interrupts_restored()
        settled, unsent = _settle(client, jobs, sources, since)
        return Outcome(settled, interrupted=True, unsent=unsent)
    except BaseException:
        _cancel(client, _ours(client, jobs, sources, since)[0])
        raise


@dataclass(frozen=True)
class Outcome:
    """What became of a put's loads."""

    jobs: list[Job]
    """Final, unless the daemon did not settle one within :data:`SETTLE_S` after Ctrl+C."""
    interrupted: bool = False
    """Ctrl+C stopped the wait (and asked the daemon to cancel every load)."""
    unsent: list[str] = field(default_factory=list)
    """Keys whose load Ctrl+C stopped before the daemon took it."""


def report(outcome: Outcome) -> None:
    """Print the keys the jobs published, then one line per job that did not publish, and
    exit with the status that says what happened (nothing printed twice, nothing guessed)."""
    from ..client import error_from_body

    jobs, interrupted = outcome.jobs, outcome.interrupted
    for job in jobs:
        for published_key in job.keys:
            typer.echo(published_key)
    many = len(jobs) + len(outcome.unsent) > 1
    failed = cancelled = False
    for key in outcome.unsent:
        typer.echo(f"interrupted: {f'{key}: ' if many else ''}cancelled, nothing published", err=True)
        cancelled = True
    for job in jobs:
        name = f"{job.key}: " if many else ""
        if job.state == "done":
            if interrupted:
                typer.echo(f"interrupted: {name}published (the load had finished)", err=True)
        elif job.state == "cancelled":
            if interrupted:
                typer.echo(f"interrupted: {name}cancelled, nothing published", err=True)
            else:
                detail = job.error.detail if job.error is not None else "cancelled"
                warn_or_raise(JobCancelledError(f"{name}load of {job.key!r} was cancelled ({detail}); "
                                                "nothing was published"))
            cancelled = True
        elif job.active:
            typer.echo(
                f"error: {name}interrupted, and the daemon did not say within {SETTLE_S:g} s whether "
                f"job {job.id} was cancelled: see `shmcache ls {job.key}` (it is {job.state})",
                err=True,
            )
            failed = True
        else:
            error = error_from_body(job.error.type if job.error else None,
                                    job.error.detail if job.error else job.state)
            warn_or_raise(error, f"{name}{error}")
            failed = True
    if failed or (cancelled and not interrupted):
        raise typer.Exit(EXIT_FAILED)
    if cancelled:
        raise typer.Exit(EXIT_INTERRUPTED)


Sources = Sequence[tuple[str, Path | str]]


def _settle(client: Client, jobs: list[Job], sources: Sources, since: float) -> tuple[list[Job], list[str]]:
    """Cancel our loads, then wait (up to :data:`SETTLE_S`) until the daemon says how each
    ended; returns their last known states, and the keys of sources never submitted."""
    ours, unsent = _ours(client, jobs, sources, since)
    _cancel(client, ours)
    deadline = time.monotonic() + SETTLE_S
    delay = _POLL_MIN_S
    settled: dict[str, Job] = {job.id: job for job in ours}
    while True:
        for job_id, job in settled.items():
            if job.active:
                try:
                    settled[job_id] = client.job(job_id)
                except ShmCacheError:
                    pass  # the daemon is gone or forgot it: stays unknown
        if not any(job.active for job in settled.values()) or time.monotonic() >= deadline:
            return list(settled.values()), unsent
        time.sleep(delay)
        delay = min(delay * 2, _POLL_MAX_S)


def _ours(client: Client, jobs: Sequence[Job], sources: Sources, since: float) -> tuple[list[Job], list[str]]:
    """Our jobs, and the keys of sources that have none. Ctrl+C may have cut a load
    request short after the daemon took it: such a job is the newest of its key and source
    created since ``since``, looked for until :data:`_LATE_S` has passed (the daemon may
    still be handling the request)."""
    try:  # an interrupted request may have left the connection half-read: start afresh
        client.close()
    except Exception:
        pass
    known = {job.key for job in jobs}
    paths = {
        key: {source} if is_url(source) else {os.path.abspath(source), os.path.realpath(source)}
        for key, source in sources
        if key not in known
    }
    found: dict[str, Job] = {}
    deadline = time.monotonic() + _LATE_S
    while paths.keys() - found.keys():
        try:
            listed = client.jobs()
        except ShmCacheError:
            break  # the daemon is gone: nothing more to find
        for job in sorted(listed, key=lambda j: j.created):
            if job.source in paths.get(job.key, ()) and job.created >= since - 1.0:
                found[job.key] = job
        if time.monotonic() >= deadline:
            break
        time.sleep(_POLL_MAX_S)
    return list(jobs) + list(found.values()), sorted(paths.keys() - found.keys())


def _cancel(client: Client, jobs: Sequence[Job]) -> None:
    """Ask the daemon to cancel each active job (it answers once the job stopped, or after
    two seconds while it publishes)."""
    for job in jobs:
        if not job.active:
            continue
        try:
            client.cancel(job.id)
        except ShmCacheError:
            pass  # finished meanwhile, or the daemon is gone: the settle loop says which


def _ignore_interrupts() -> None:
    """Ignore SIGINT while the daemon is asked what happened (a bounded wait) and the
    answer is printed, so that a second Ctrl+C cannot cut the report short."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass


@contextmanager
def interrupts_restored() -> Iterator[None]:
    """Put back, on the way out, the SIGINT handler that :func:`put_through` may set aside
    (the command may run inside a longer-lived process, e.g. a test's)."""
    try:
        previous = signal.getsignal(signal.SIGINT)
        yield
    finally:
        if previous is not None and signal.getsignal(signal.SIGINT) is not previous:
            try:
                signal.signal(signal.SIGINT, previous)
            except ValueError:
                pass
