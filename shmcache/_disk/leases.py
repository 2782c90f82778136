"""What file leases (``F_SETLEASE``) prove about a file, whoever holds it.

The kernel grants a read lease only when nobody has the file open for writing (writable
shared mappings included), and a write lease only when nobody else has it open or mapped
at all. A daemon owns the files of its root, so it may ask for either, and so learn, for
processes of any user (whose ``/proc/<pid>/maps`` it may not read):

- that a member who filled a file has closed every writable descriptor of it (after
  which nobody can write it again: only the daemon could open it for writing);
- that an entry's files are mapped by nobody (budget eviction never takes a mapped one).
"""

from __future__ import annotations

import errno
import fcntl
import os

__all__ = ["has_writers", "in_use"]

_F_SETLEASE = getattr(fcntl, "F_SETLEASE", 1024)
_BUSY = (errno.EAGAIN, errno.EBUSY)


def has_writers(fd: int) -> bool:
    """Whether anyone has the file open as ``fd`` (read-only, ours) open for writing, or
    maps it writable. Raises the ``OSError`` of a file system without leases."""
    try:
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
    except OSError as exc:
        if exc.errno in _BUSY:
            return True
        raise
    fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
    return False


def in_use(path: str | os.PathLike[str]) -> bool:
    """Whether any process but this probe has ``path`` open or mapped (False if it is
    gone). Only the file's owner may ask: for others the answer is True (unknown)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    try:
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_WRLCK)
    except OSError:
        return True
    else:
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
        return False
    finally:
        os.close(fd)
