"""Background loads: a bounded pool of threads running ``Store.put_file``, one job per key.

A second request for a key whose load is queued or running gets the same job back. Job
counts are kept as jobs change state and the oldest finished job goes as another
finishes: ``/v1/stats`` and every submit stay O(1) however many jobs are remembered.
A load from inside the ``--allow-source`` directories opens its files without following
links out of them: a file swapped for a symlink after the request was checked fails the job.
Cancelling sets a flag that the load's progress callback checks after every chunk; it
raises, the store discards the partial write, and nothing is published.

A :class:`LoadJob` is the mutable, running side of a job; what the API answers and the
client parses is its :meth:`~LoadJob.snapshot`, the shared record :class:`shmcache._control.Job`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from shmcache import Store
from shmcache._control import ACTIVE_STATES, JOB_STATES, Job, JobError, JobState
from shmcache._error_table import HTTP, fix, reword
from shmcache._store.ownership import acting_for
from shmcache.errors import ShmCacheError

from .errors import JobCancelledError, JobConflictError, JobFinishedError, JobNotFoundError
from .sources import shown_source

__all__ = ["JobManager", "LoadJob"]

logger = logging.getLogger(__name__)

_KEEP_FINISHED = 1000


class _Settled(threading.Event):
    """The event of every finished job: no longer per job (two events were two thirds of
    the ~3 KB a remembered job took), and never to be changed again."""

    def __init__(self, is_set: bool) -> None:
        super().__init__()
        if is_set:
            super().set()

    def set(self) -> None:
        raise RuntimeError("a finished job's events do not change")

    def clear(self) -> None:
        raise RuntimeError("a finished job's events do not change")


_SET = _Settled(True)
_UNSET = _Settled(False)


@dataclass(slots=True)
class LoadJob:
    """One load of ``source`` under ``key`` as it runs; the API reads :meth:`snapshot`."""

    key: str
    source: Path | str
    """A resolved path, or a URL (without credentials: ``sources.resolve_source`` refuses those)."""
    pin: bool
    overwrite: bool
    as_: str = "auto"
    dtype: str | None = None
    owner: int | None = None
    """The uid of the member who asked (recorded as the entries' owner); None: the daemon's."""
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    state: JobState = "queued"
    bytes_done: int = 0
    bytes_total: int | None = None
    keys: list[str] = field(default_factory=list)
    error: JobError | None = None
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    cancel_event: threading.Event = field(default_factory=threading.Event, repr=False)
    finished_event: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def cancel_requested(self) -> bool:
        return self.cancel_event.is_set()

    @property
    def shown_source(self) -> str:
        """The source as logs and answers name it: a URL without its secrets (a config
        preload's user information or query string)."""
        return shown_source(self.source)

    def snapshot(self) -> Job:
        """The job as it is now, as the shared immutable record."""
        return Job(
            id=self.id,
            key=self.key,
            source=self.shown_source,
            pin=self.pin,
            overwrite=self.overwrite,
            state=self.state,
            bytes_done=self.bytes_done,
            bytes_total=self.bytes_total,
            keys=tuple(self.keys),
            error=self.error,
            cancel_requested=self.cancel_requested,
            created=self.created,
            started=self.started,
            finished=self.finished,
        )


class JobManager:
    """Runs loads on ``workers`` threads; keeps the last 1000 finished jobs for status queries."""

    def __init__(
        self,
        store: Store,
        *,
        workers: int,
        max_load_rate: int | None = None,
        on_finish: Callable[[LoadJob], None] | None = None,
        allowed_dirs: Sequence[Path] = (),
    ) -> None:
        self.store = store
        self.allowed_dirs = tuple(allowed_dirs)
        self.workers = workers
        self.max_load_rate = max_load_rate
        self._on_finish = on_finish
        self._lock = threading.Lock()
        self._jobs: OrderedDict[str, LoadJob] = OrderedDict()
        self._active_by_key: dict[str, LoadJob] = {}
        self._counts: dict[str, int] = dict.fromkeys(JOB_STATES, 0)
        self._finished: deque[str] = deque()
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    # ------------------------------------------------------------------ queries

    def get(self, job_id: str) -> LoadJob:
        job = self._jobs.get(job_id)
        if job is None:
            raise JobNotFoundError(
                f"no job {job_id!r}: unknown id, or it finished long ago (the last {_KEEP_FINISHED} "
                "finished jobs are kept)"
            )
        return job

    def active_for(self, key: str) -> LoadJob | None:
        return self._active_by_key.get(key)

    def list(self) -> list[LoadJob]:
        with self._lock:
            return list(self._jobs.values())

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    # ------------------------------------------------------------------ changes

    def submit(
        self,
        key: str,
        source: Path | str,
        *,
        pin: bool = False,
        overwrite: bool = False,
        as_: str = "auto",
        dtype: str | None = None,
        owner: int | None = None,
    ) -> tuple[LoadJob, bool]:
        """Queue a load; returns ``(job, created)``. A queued or running load of the same
        key and source is returned instead of starting another one."""
        with self._lock:
            if self._closed:
                raise JobConflictError("the daemon is shutting down; it accepts no new loads")
            current = self._active_by_key.get(key)
            if current is not None:
                if current.source != source:
                    raise JobConflictError(
                        f"key {key!r} is already being loaded from {current.shown_source} by job "
                        f"{current.id}; "
                        f"wait for it, or cancel it ({fix('cancel', HTTP, job=current.id)}) first"
                    )
                return current, False
            job = LoadJob(
                key=key, source=source, pin=pin, overwrite=overwrite, as_=as_, dtype=dtype, owner=owner
            )
            self._jobs[job.id] = job
            self._active_by_key[key] = job
            self._counts["queued"] += 1
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="shmcache-load")
            self._executor.submit(self._run, job)
        logger.debug("job %s queued: %s from %s", job.id, key, job.shown_source)
        return job, True

    def cancel(self, job_id: str, wait: float = 2.0) -> LoadJob:
        """Ask a job to stop; wait up to ``wait`` seconds for it to do so."""
        job = self.get(job_id)
        with self._lock:
            if not job.active:
                raise JobFinishedError(f"job {job_id} already finished ({job.state}); nothing to cancel")
            job.cancel_event.set()
            if job.state == "queued":  # never started: finish it here
                self._finish(job, "cancelled", "JobCancelledError", "cancelled before it started")
        job.finished_event.wait(wait)
        return job

    def shutdown(self, timeout: float = 30.0) -> None:
        """Cancel every queued and running load and wait for the workers to stop."""
        with self._lock:
            self._closed = True
            for job in self._jobs.values():
                if job.active:
                    job.cancel_event.set()
                    if job.state == "queued":
                        self._finish(job, "cancelled", "JobCancelledError", "the daemon is shutting down")
            executor, self._executor = self._executor, None
        if executor is not None:
            deadline = time.monotonic() + timeout
            for job in self.list():
                job.finished_event.wait(max(0.0, deadline - time.monotonic()))
            executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ worker side

    def _run(self, job: LoadJob) -> None:
        with self._lock:
            if job.state != "queued":  # cancelled while queued
                return
            self._move(job, "running")
            job.started = time.time()
        start = time.monotonic()
        try:
            with acting_for(job.owner) if job.owner is not None else contextlib.nullcontext():
                job.keys = self.store.put_file(
                    job.key,
                    job.source,
                    overwrite=job.overwrite,
                    pin=job.pin,
                    progress=self._progress_of(job, start),
                    allowed_dirs=self._confinement(job.source),
                    as_=job.as_,
                    dtype=job.dtype,
                )
        except JobCancelledError as exc:
            self._finish_locked(job, "cancelled", type(exc).__name__, str(exc))
            logger.warning(
                "load %s from %s cancelled (job %s); nothing was published", job.key, job.shown_source, job.id
            )
        except (ShmCacheError, OSError) as exc:  # told to whoever asks over HTTP: in its words
            self._finish_locked(job, "failed", type(exc).__name__, reword(str(exc), HTTP))
            logger.warning("load %s from %s failed (job %s): %s", job.key, job.shown_source, job.id, exc)
        except Exception as exc:  # a bug: keep the worker alive, report it on the job
            self._finish_locked(job, "failed", "InternalError", f"{type(exc).__name__}: {exc}")
            logger.exception(
                "load %s from %s failed unexpectedly (job %s)", job.key, job.shown_source, job.id
            )
        else:
            self._finish_locked(job, "done", None, None)
            elapsed = time.monotonic() - start
            logger.debug(
                "job %s done: %s (%d keys, %d bytes) in %.2f s",
                job.id,
                job.key,
                len(job.keys),
                job.bytes_done,
                elapsed,
            )

    def _confinement(self, source: Path | str) -> tuple[Path, ...]:
        """The allowed directories, for a source inside one of them (every API load; a
        config preload from elsewhere is the operator's choice and loads unconfined).
        A URL has none: its prefix was checked when the load was asked for."""
        if isinstance(source, str):
            return ()
        inside = any(source == top or source.is_relative_to(top) for top in self.allowed_dirs)
        return self.allowed_dirs if inside else ()

    def _progress_of(self, job: LoadJob, start: float) -> Callable[[int, int], None]:
        rate = self.max_load_rate

        def progress(done: int, total: int) -> None:
            job.bytes_done, job.bytes_total = done, total
            if job.cancel_event.is_set():
                raise JobCancelledError(self._cancel_reason())
            if rate:  # pace the copy; wake up at once when cancelled
                delay = start + done / rate - time.monotonic()
                if delay > 0 and job.cancel_event.wait(delay):
                    raise JobCancelledError(self._cancel_reason())

        return progress

    def _cancel_reason(self) -> str:
        return "the daemon is shutting down" if self._closed else "cancelled on request"

    def _finish_locked(
        self, job: LoadJob, state: JobState, error_type: str | None, detail: str | None
    ) -> None:
        with self._lock:
            self._finish(job, state, error_type, detail)

    def _finish(self, job: LoadJob, state: JobState, error_type: str | None, detail: str | None) -> None:
        self._move(job, state)
        self._finished.append(job.id)
        while len(self._finished) > _KEEP_FINISHED:
            old = self._jobs.pop(self._finished.popleft())
            self._counts[old.state] -= 1
        job.error = JobError(error_type, detail or "") if error_type is not None else None
        job.finished = time.time()
        if self._active_by_key.get(job.key) is job:
            del self._active_by_key[job.key]
        job.finished_event.set()  # wakes whoever waits on the job's own event
        job.finished_event, job.cancel_event = _SET, _SET if job.cancel_event.is_set() else _UNSET
        if self._on_finish is not None:
            try:
                self._on_finish(job)
            except Exception:
                logger.exception("job %s: on_finish hook failed", job.id)

    def _move(self, job: LoadJob, state: JobState) -> None:
        """Change a job's state and the counts (under ``_lock``)."""
        self._counts[job.state] -= 1
        self._counts[state] += 1
        job.state = state
