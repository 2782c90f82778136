"""Whether a daemon lives for a root, asked of the kernel rather than of the daemon.

``shmcache serve`` holds ``<root>/daemon.pid`` flocked for as long as it runs, and the
kernel drops that lock when it dies, even by ``kill -9``. So a locked pid file means a
daemon lives, whether or not it answers: one that is stopped (SIGSTOP, Ctrl+Z), hung or
swamped is still there, still owns the root's budget, and must be reported, never
worked around. Works across containers that share the root (a flock is seen through
any pid namespace, unlike ``/proc/locks``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from shmcache._disk.layout import Layout

__all__ = ["LiveDaemon", "live_daemon"]


@dataclass(frozen=True)
class LiveDaemon:
    """A daemon that holds a root's pid file locked."""

    pid: int | None
    """Its pid as it wrote it (in its own pid namespace); None while it has not written it yet."""
    pid_file: Path

    def __str__(self) -> str:
        return f"pid {self.pid}" if self.pid is not None else f"(pid not yet written to {self.pid_file})"

    @property
    def stopped(self) -> bool:
        """Whether it is stopped by a signal (``kill -CONT`` resumes it): its ``/proc`` entry
        says state T and holds the pid file open (so it is that daemon, in this namespace)."""
        if self.pid is None:
            return False
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as fp:
                state = fp.read().rpartition(b")")[2].split()[0]
            if state not in (b"T", b"t"):
                return False
            fds = f"/proc/{self.pid}/fd"
            target = os.path.realpath(self.pid_file)
            return any(os.readlink(f"{fds}/{fd}") == target for fd in os.listdir(fds))
        except (OSError, IndexError):  # gone, another user's, or another namespace's pid
            return False


def live_daemon(root: str | os.PathLike[str]) -> LiveDaemon | None:
    """The daemon serving ``root`` if one lives (its pid file is locked), else None.

    The probe takes a shared lock without waiting and drops it at once. (A daemon that
    starts in those microseconds finds the lock taken and says another daemon serves the
    root; only a pid file left by a killed daemon can be probed, as a clean stop removes it.)
    """
    path = Layout(Path(root)).pid_file
    try:  # O_NONBLOCK: a FIFO planted under the name must not hang us
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # no pid file: no daemon (a clean stop removes it)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            return LiveDaemon(int(text) if text.isdigit() else None, path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
