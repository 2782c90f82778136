"""Appends to a version's files on a second thread while the caller prepares the next.

A table decoded from mapped Arrow streams (a ``save_to_disk`` folder) is written a group
of record batches at a time: the kernel's copy in ``write()`` releases the GIL, so while
this thread copies one group into tmpfs the caller decodes, encodes and checksums the
next (on 2 cores the put took the time of the copies alone, not copies + decoding). One
group is handed over at a time, and only once the thread has taken the one before: the
caller is never more than a group ahead (memory stays flat), and it waits, GIL released,
while the thread picks the group up, so the copy starts at once rather than after the
interpreter's switch interval (5 ms) of the caller's Python.

``copy_pool`` is not this: it runs independent items (whole files) on several threads,
where here every group appends to the same files, in order, behind a producer.

The thread's first error (ENOSPC as :class:`CacheFullError`, EMFILE as
:class:`TooManyOpenFilesError`, as ``write_all`` raises them) is raised unchanged by the
caller's next :meth:`WriteBehind.append` or :meth:`WriteBehind.finish`; an error of the
caller's (a cancel, an interrupt) stops the thread at its next file through
:meth:`WriteBehind.close`, which returns once it has stopped writing, so that the caller
may remove the version. Nothing here publishes anything.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence
from typing import Any

from .fs import full_is_cache_full

__all__ = ["Appends", "WriteBehind"]

Appends = Sequence[tuple[str, Sequence[Any]]]
"""``[(path, buffers), ...]``: each file's buffers (bytes, uint8 arrays), appended in order."""

_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 16


class WriteBehind:
    """One writer thread (or the caller itself: ``threaded=False``, for appends too small
    to pay for a thread, or where no thread can start)."""

    def __init__(self, threaded: bool = True) -> None:
        self._cond = threading.Condition()
        self._pending: Appends | None = None
        self._busy = False
        self._closing = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="shmcache-write-behind", daemon=True)
            try:
                self._thread.start()
            except RuntimeError:  # no more threads (a process or cgroup limit): write inline
                self._thread = None
            except BaseException:  # an interrupt while it starts: no `with` will close it
                self.close()
                raise

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def append(self, appends: Appends) -> None:
        """Append each file's buffers (the files exist), after every earlier append; returns
        once the thread has begun them. Raises the thread's error, if it met one."""
        if self._thread is None:
            _append_all(appends, lambda: False)
            return
        with self._cond:
            while self._pending is not None and self._error is None:
                self._cond.wait()
            self._raise()
            self._pending = appends
            self._cond.notify_all()
            while self._pending is appends and self._error is None:
                self._cond.wait()

    def finish(self) -> None:
        """Wait until every append is written; raises the thread's error, if any."""
        with self._cond:
            while (self._pending is not None or self._busy) and self._error is None:
                self._cond.wait()
            self._raise()

    def close(self) -> None:
        """Stop the thread (after the file it is writing) and wait for it; idempotent."""
        thread = self._thread
        if thread is None:
            return
        interrupted: BaseException | None = None
        while True:  # an interrupt while taking the lock must not leave the thread waiting
            try:
                with self._cond:
                    self._closing = True
                    self._cond.notify_all()
                break
            except BaseException as exc:
                interrupted = interrupted or exc
        while thread.is_alive():
            try:
                thread.join()
            except BaseException as exc:  # an interrupt: still wait, the version is removed next
                interrupted = interrupted or exc
        self._thread = None
        if interrupted is not None:
            raise interrupted

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                if self._closing or self._error is not None:  # after an error: nothing more
                    return
                appends, self._pending, self._busy = self._pending, None, True
                self._cond.notify_all()
            try:
                if appends is not None:
                    _append_all(appends, lambda: self._closing)
            except BaseException as exc:
                with self._cond:
                    self._error = self._error or exc  # the first error is the one raised
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


def _append_all(appends: Appends, stop: Any) -> None:
    for path, buffers in appends:
        if stop():
            return
        with full_is_cache_full(path):
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            try:
                _writev_all(fd, [memoryview(b).cast("B") for b in buffers if len(b)])
            finally:
                os.close(fd)


def _writev_all(fd: int, views: list[memoryview]) -> None:
    """Write every view, in order, with as few ``writev`` calls as ``IOV_MAX`` allows."""
    first = 0
    while first < len(views):
        done = os.writev(fd, views[first : first + _IOV_MAX])
        if done == 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        while done and first < len(views):
            if done >= len(views[first]):
                done -= len(views[first])
                first += 1
            else:
                views[first] = views[first][done:]
                done = 0
