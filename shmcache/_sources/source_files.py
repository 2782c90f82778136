"""Opening the files a ``put_file`` copies from, so that what is copied is what was checked.

A source is opened without blocking (a FIFO named ``*.npy`` would wait forever for a
writer) and ``fstat``-ed: anything but a regular file is refused at once. With allowed
directories (the daemon's ``--allow-source``), the file's real path is checked to lie
beneath one of them and is then opened relative to that directory without following any
link (``openat2`` with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``, else ``O_NOFOLLOW`` one
component at a time): a file or directory swapped for a symlink between the check and
the copy cannot point the copy elsewhere. Every later open is compared with the
device/inode, size and mtime seen when the file was checked, and :func:`check_unchanged`
compares them again after the copy, so a file rewritten or replaced meanwhile fails the
load instead of being published mixed.

What no check sees: writes through a shared mapping of a tmpfs file update no time
stamp. The checksum recorded is then still that of the bytes published. Nor a write that
BEGAN before the first ``fstat`` and still copies its bytes during the read: Linux moves
mtime and ctime when a ``write`` begins, so both ``fstat`` calls agree and the bytes read
may be torn, while the file's time stamps already are its final ones (the fingerprint
recorded would match the file forever). Such a file is *racily clean* (git's word): its
mtime lies within :data:`RACY_NS` of when it was read (or after). Its fingerprint then says
so (``"racy": 1``), which no file's fingerprint as it is now (:func:`stat_fingerprint`)
equals: an up-to-date check (config preloads) loads it again later, once its time stamps
are old, rather than trust this copy forever. This put still publishes what it read.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import stat
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from .._disk.fs import out_of_descriptors, too_many_open_files
from ..errors import CorruptSourceError, InvalidSourceError, SourceNotAllowedError, SourceNotFoundError

__all__ = [
    "RACY_JSON",
    "RACY_NS",
    "READ_FLAGS",
    "SourceFile",
    "check_unchanged",
    "descriptors_to_hold",
    "open_checked",
    "open_plain",
    "openat2_available",
    "racy_after",
    "reopen",
    "stat_fingerprint",
]

_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
READ_FLAGS = _READ
"""How a source is opened: without blocking (a FIFO), never as a controlling terminal."""
_DIRECTORY = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
_SYS_OPENAT2 = 437  # the same on every architecture Linux added it to (5.6) but alpha
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
_LINK_ERRNOS = (errno.ELOOP, errno.EXDEV, errno.ENOTDIR)  # a link met, or a way out
_RETRIES = 8  # openat2 answers EAGAIN when a rename raced its path walk
RACY_NS = 2_000_000_000
"""A source whose mtime is later than this many nanoseconds before it was opened is
racily clean (the module's docstring): a write that began then may still have been copying
its bytes during the read. 2 s covers a write of a small file many times over, time stamps
taken from a coarse clock (a tick behind, ~4 ms, before Linux 6.13) or truncated to the
second (a write of up to ~1 s then), and a clock stepped back a little (an mtime in the
future is racy too). mtime, not ctime: the write that matters set both when it began, before
the ``fstat`` that saw them; ctime would also call racy a tree whose old times were just
restored (``cp -p``, ``tar x``), whose bytes were complete before that ``utime``. Missed: a
write copying for longer than this, a clock stepped forward past it meanwhile, or another
thread's ``utime`` setting mtime back while a write still copies."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_syscall: Any = None  # libc's syscall(), loaded on first use
_have_openat2: bool | None = None  # None: not probed yet


class SourceFile(NamedTuple):
    """A source file as it was checked: where to open it from, and which file it was (a
    tuple: ~10x cheaper to make than a frozen dataclass, once per file of a directory put)."""

    path: str
    """The path as given (for messages)."""
    target: str
    """What every open walks: the real path when checked if confined to ``top`` (no link
    is followed then), else the absolute path as given."""
    top: str | None
    """The allowed directory ``target`` lies beneath; None when any readable file may be loaded."""
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    racy: bool
    """Modified within :data:`RACY_NS` of its opening (racily clean): the bytes read may be
    torn by a write in progress, and the fingerprint recorded says so."""

    @property
    def fingerprint(self) -> dict[str, int]:
        """What ``meta.json`` records to tell later whether the source changed (``"racy": 1``:
        never judged unchanged, as no :func:`stat_fingerprint` has that member)."""
        if self.racy:
            return {"size": self.size, "mtime_ns": self.mtime_ns, "racy": 1}
        return {"size": self.size, "mtime_ns": self.mtime_ns}

    @property
    def fingerprint_json(self) -> str:
        """:attr:`fingerprint`'s members as JSON (``"size":N,"mtime_ns":M``), for a manifest
        line formatted without a dict per file."""
        return f'"size":{self.size},"mtime_ns":{self.mtime_ns}{RACY_JSON if self.racy else ""}'


RACY_JSON = ',"racy":1'
"""What a racily-clean source's fingerprint adds to its JSON members."""


def racy_after() -> int:
    """The mtime (ns) after which a source opened from now on is racily clean: taken
    before the files are opened, and so before they are read (a time taken earlier only
    calls more files racy), once for many files if need be."""
    return time.time_ns() - RACY_NS


def descriptors_to_hold() -> int:
    """How many checked files may stay open until copied: half the soft limit on open
    files, less what is open now (the rest are opened, and compared, again when copied)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = soft // 4
    return max(0, min(soft // 2 - open_now, 1 << 16))


def stat_fingerprint(st: os.stat_result) -> dict[str, int]:
    """:attr:`SourceFile.fingerprint` of a file as it is now (``os.stat``), for a comparison."""
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def open_checked(path: str, allowed: Sequence[str] = (), *, absolute: bool = False) -> tuple[int, SourceFile]:
    """Open a regular file for reading, beneath one of ``allowed`` (real paths) if any
    are given; returns the descriptor and what was opened. ``absolute``: ``path`` is
    absolute and normal already (a directory walk's: no ``abspath`` per file)."""
    racy = racy_after()
    target = os.path.realpath(path) if allowed else path if absolute else os.path.abspath(path)
    top = None
    if allowed:
        top = next((d for d in allowed if target == d or target.startswith(d.rstrip("/") + "/")), None)
        if top is None:
            raise SourceNotAllowedError(f"source {path} is outside the directories it may be loaded from")
    fd, st = _open_stat(path, target, top)
    mt = st.st_mtime_ns
    return fd, SourceFile(path, target, top, st.st_dev, st.st_ino, st.st_size, mt, st.st_ctime_ns, mt > racy)


def open_plain(path: str) -> tuple[int, SourceFile]:
    """:func:`open_checked` of an absolute, normal ``path`` with no allowed directories,
    in a few calls for the files of a directory walk; a failure is retried through
    :func:`open_checked`, which raises its typed error."""
    racy = racy_after()
    try:
        fd = os.open(path, _READ)
    except OSError:
        return open_checked(path, absolute=True)
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return open_checked(path, absolute=True)
    mt = st.st_mtime_ns
    return fd, SourceFile(path, path, None, st.st_dev, st.st_ino, st.st_size, mt, st.st_ctime_ns, mt > racy)


def reopen(source: SourceFile) -> int:
    """Open ``source`` again the way it was checked; raises if it is no longer that file,
    or no longer the same size and modification time."""
    fd, st = _open_stat(source.path, source.target, source.top)
    try:
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != (
            source.dev,
            source.ino,
            source.size,
            source.mtime_ns,
        ):
            raise _changed(source, "after it was checked")
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_unchanged(fd: int, source: SourceFile, same_path: bool = True) -> None:
    """After a copy from ``fd``: the file kept its size and time stamps, and (unless
    ``same_path`` is false: ``fd`` is the very descriptor that was checked) its path still
    names it; else the copy may mix old and new bytes."""
    st = os.fstat(fd)
    if (st.st_size, st.st_mtime_ns, st.st_ctime_ns) != (source.size, source.mtime_ns, source.ctime_ns):
        raise _changed(source, "while loading")
    if not same_path:
        return
    if source.top is None:  # one stat of the path: it follows links as the open did
        try:
            st = os.stat(source.target)
        except OSError:
            raise _changed(source, "while loading (it was removed or replaced)") from None
    else:  # confined: walked beneath ``top`` again, following no link
        try:
            again = _open(source.path, source.target, source.top)
        except InvalidSourceError:
            raise _changed(source, "while loading (it was removed or replaced)") from None
        try:
            st = os.fstat(again)
        finally:
            os.close(again)
    if (st.st_dev, st.st_ino) != (source.dev, source.ino):
        raise _changed(source, "while loading (it was replaced)")


def _changed(source: SourceFile, when: str) -> CorruptSourceError:
    return CorruptSourceError(f"{source.path} changed {when}; nothing was published, load it again")


def _open(path: str, target: str, top: str | None) -> int:
    """Open ``target`` (beneath ``top`` without following links, if given); refuse anything
    but a regular file. Errors name ``path``."""
    return _open_stat(path, target, top)[0]


def _open_stat(path: str, target: str, top: str | None) -> tuple[int, os.stat_result]:
    """:func:`_open`, and the ``fstat`` it checked (one call: opens of many small files add up)."""
    try:
        fd = os.open(target, _READ) if top is None else _open_beneath(top, os.path.relpath(target, top))
    except FileNotFoundError:
        raise SourceNotFoundError(f"source {path} does not exist") from None
    except OSError as exc:
        if top is not None and exc.errno in _LINK_ERRNOS:
            raise SourceNotAllowedError(
                f"source {path} changed after it was checked: it no longer lies inside the "
                "directories this daemon may load from without following links"
            ) from None
        if exc.errno == errno.ENXIO:
            raise InvalidSourceError(f"source {path} is not a regular file (a socket, or a device)") from None
        if out_of_descriptors(exc):
            raise too_many_open_files(exc, f"opening source {path}") from exc
        raise InvalidSourceError(f"source {path} cannot be read: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidSourceError(f"source {path} is not a regular file (it is {_kind(st.st_mode)})")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a file"


def _open_beneath(top: str, relative: str) -> int:
    dirfd = os.open(top, _DIRECTORY)
    try:
        if openat2_available():
            return _openat2(dirfd, relative, _READ, _RESOLVE)
        return _open_nofollow(dirfd, relative)
    finally:
        os.close(dirfd)


def _open_nofollow(dirfd: int, relative: str) -> int:
    """Walk ``relative`` from ``dirfd`` one component at a time, following no link."""
    *parents, name = relative.split("/")
    if any(part in ("", ".", "..") for part in (*parents, name)):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), relative)
    current = os.dup(dirfd)
    try:
        for part in parents:
            step = os.open(part, _DIRECTORY | os.O_NOFOLLOW, dir_fd=current)
            os.close(current)
            current = step
        return os.open(name, _READ | os.O_NOFOLLOW, dir_fd=current)
    finally:
        os.close(current)


def openat2_available() -> bool:
    """Whether the kernel (and any seccomp filter) lets us call ``openat2``; probed once."""
    global _have_openat2
    if _have_openat2 is None:
        try:
            os.close(_openat2(-100, "/", os.O_PATH | os.O_CLOEXEC, 0))  # AT_FDCWD
            _have_openat2 = True
        except OSError:
            _have_openat2 = False
    return _have_openat2


def _openat2(dirfd: int, path: str, flags: int, resolve: int) -> int:
    global _syscall
    if _syscall is None:
        libc = ctypes.CDLL(None, use_errno=True)
        _syscall = libc.syscall
        _syscall.restype = ctypes.c_long
    how = _OpenHow(flags, 0, resolve)
    encoded = os.fsencode(path)
    for _ in range(_RETRIES):
        fd = _syscall(
            ctypes.c_long(_SYS_OPENAT2),
            ctypes.c_int(dirfd),
            ctypes.c_char_p(encoded),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
        if fd >= 0:
            return int(fd)
        code = ctypes.get_errno()
        if code != errno.EAGAIN:
            break
    raise OSError(code, os.strerror(code), path)
