"""File-system primitives: writes that fail cleanly, kernel copies, locks, space.

Data is written with ``write()``/``copy_file_range`` and never through a mapping: on a
full tmpfs a ``write()`` fails with ENOSPC (turned into :class:`CacheFullError`), while
a store through a mapping kills the process with SIGBUS. Running out of descriptors
(EMFILE, ENFILE) becomes :class:`TooManyOpenFilesError` naming the limit and how to raise it.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import resource
import shutil
import stat
import struct
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..errors import CacheFullError, TooManyOpenFilesError

Buffer = Any  # anything with the buffer protocol (bytes, memoryview, ndarray)

__all__ = [
    "FileLockProbe",
    "allocated_bytes",
    "copy_range",
    "copy_range_at",
    "descriptors_typed",
    "free_bytes",
    "full_is_cache_full",
    "out_of_descriptors",
    "pread_exactly",
    "raise_if_full",
    "range_lock_conflict",
    "range_lock_holder",
    "remove_tree",
    "too_many_open_files",
    "total_bytes",
    "try_lock_exclusive",
    "try_lock_range",
    "unlock_all_but",
    "unlock_range",
    "unlock_ranges",
    "write_all",
]

_CHUNK = 64 << 20
_COPY_CHUNK = 2 << 20  # a checksum thread reads each copied chunk while it is still in cache


def _full(path: str | Path, exc: OSError) -> CacheFullError:
    if _out_of_inodes(Path(path)):
        return CacheFullError(
            f"no space left on the cache's file system while creating {path}: it has no free "
            "inodes (files) left; evict entries (`shmcache evict`/`cleanup`), or remount the tmpfs "
            "with more (mount -o remount,nr_inodes=...)"
        )
    return CacheFullError(
        f"no space left on the cache's file system while writing {path} ({exc.strerror}); "
        "free space with `shmcache evict`/`cleanup`, or enlarge /dev/shm "
        "(Docker: --shm-size or --ipc=host)"
    )


def raise_if_full(path: str | Path, exc: OSError) -> None:
    """Raise :class:`CacheFullError` for an ENOSPC/EDQUOT ``exc`` met creating ``path``
    (:class:`TooManyOpenFilesError` for EMFILE/ENFILE); return otherwise
    (``full_is_cache_full`` without a context manager, for the per-file steps of a batch:
    ``except OSError as exc: raise_if_full(path, exc); raise``)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        raise _full(path, exc) from exc
    if exc.errno in _NO_DESCRIPTOR:
        raise too_many_open_files(exc, f"creating {path}") from exc


_NO_DESCRIPTOR = (errno.EMFILE, errno.ENFILE)


def out_of_descriptors(exc: BaseException) -> bool:
    """Whether ``exc`` is the kernel refusing a new descriptor (EMFILE, ENFILE)."""
    return isinstance(exc, OSError) and exc.errno in _NO_DESCRIPTOR


_F = TypeVar("_F", bound=Callable[..., Any])


def descriptors_typed(function: _F) -> _F:
    """``function`` with EMFILE/ENFILE from anywhere inside it (a directory listed, a file
    opened by a module that does not check) raised as :class:`TooManyOpenFilesError`."""

    @functools.wraps(function)
    def typed(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except TooManyOpenFilesError:
            raise
        except OSError as exc:
            if exc.errno not in _NO_DESCRIPTOR:
                raise
            doing = f"opening {exc.filename}" if exc.filename else f"in {function.__name__}()"
            raise too_many_open_files(exc, doing) from exc

    return typed  # type: ignore[return-value]


def too_many_open_files(exc: OSError, doing: str) -> TooManyOpenFilesError:
    """The typed error for EMFILE/ENFILE met while ``doing`` (e.g. "opening /data/x.npy"):
    which limit was reached, and how to raise it."""
    if exc.errno == errno.ENFILE:
        return TooManyOpenFilesError(
            f"too many open files in the whole system while {doing}: the kernel's limit "
            "(fs.file-max) is reached; close programs that hold many files, or raise it "
            "(sysctl -w fs.file-max=N)"
        )
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        limit = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
        how = (
            f"raise it (up to the hard limit, {limit}) with `ulimit -n {limit}` in the shell that "
            "starts the program, or resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard)) in Python"
        )
    else:
        how = (
            "that is also its hard limit: raise both as root (/etc/security/limits.conf, "
            "LimitNOFILE= in a systemd unit, docker run --ulimit nofile=N:N)"
        )
    return TooManyOpenFilesError(
        f"too many open files while {doing}: this process has reached its limit of {soft} open "
        f"files (RLIMIT_NOFILE, `ulimit -n`); {how}; or close files the program keeps open"
    )


def _out_of_inodes(path: Path) -> bool:
    for where in (path, *path.parents):
        try:
            st = os.statvfs(where)
        except OSError:
            continue
        return st.f_files > 0 and st.f_favail == 0
    return False


@contextmanager
def full_is_cache_full(path: str | Path) -> Iterator[None]:
    """Turn ENOSPC/EDQUOT from creating or writing ``path`` (a file, directory, link or
    lock: out of blocks or out of inodes) into :class:`CacheFullError`, and EMFILE/ENFILE
    into :class:`TooManyOpenFilesError`."""
    try:
        yield
    except (CacheFullError, TooManyOpenFilesError):
        raise
    except OSError as exc:
        raise_if_full(path, exc)
        raise


def write_all(fd: int, data: Buffer, path: str | Path) -> None:
    """Write every byte of ``data`` to ``fd``; ENOSPC/EDQUOT become CacheFullError."""
    view = memoryview(data).cast("B")
    done = 0
    try:
        while done < len(view):
            done += os.write(fd, view[done : done + _CHUNK])
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _full(path, exc) from exc
        raise


def copy_range(
    src_fd: int,
    dst_fd: int,
    offset: int,
    count: int,
    path: str | Path,
    on_chunk: Callable[[int], None] | None = None,
) -> None:
    """Copy ``count`` bytes from ``src_fd`` at ``offset`` to the end of ``dst_fd``.

    The kernel moves the bytes (``copy_file_range``, else ``sendfile``); they never
    pass through Python memory. ``on_chunk(n)`` is called after every chunk of ``n``
    bytes (it may raise to abort the copy).
    """
    end = offset + count
    try:
        try:
            while offset < end:
                copied = os.copy_file_range(src_fd, dst_fd, min(end - offset, _COPY_CHUNK), offset)
                if copied == 0:
                    raise EOFError(f"source ended at byte {offset}, expected {end}")
                offset += copied
                if on_chunk is not None:
                    on_chunk(copied)
            return
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
        while offset < end:  # across file systems on kernels that refuse copy_file_range
            sent = os.sendfile(dst_fd, src_fd, offset, min(end - offset, _COPY_CHUNK))
            if sent == 0:
                raise EOFError(f"source ended at byte {offset}, expected {end}")
            offset += sent
            if on_chunk is not None:
                on_chunk(sent)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _full(path, exc) from exc
        raise


def copy_range_at(
    src_fd: int, dst_fd: int, dst_offset: int, count: int, path: str | Path, src_offset: int = 0
) -> None:
    """Copy ``count`` bytes of ``src_fd`` from ``src_offset`` (a tar member's data) to
    ``dst_fd`` at ``dst_offset`` by the kernel, leaving both file positions alone: several
    threads can fill one file at once. A source shorter than that raises :class:`EOFError`."""
    done = 0
    try:
        try:
            while done < count:
                copied = os.copy_file_range(
                    src_fd, dst_fd, count - done, src_offset + done, dst_offset + done
                )
                if copied == 0:
                    raise EOFError(f"source ended at byte {done}, expected {count}")
                done += copied
            return
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
        while done < count:  # no kernel copy between these file systems: through a buffer
            chunk = os.pread(src_fd, min(count - done, _COPY_CHUNK), src_offset + done)
            if not chunk:
                raise EOFError(f"source ended at byte {done}, expected {count}")
            view = memoryview(chunk)
            while view:
                written = os.pwrite(dst_fd, view, dst_offset + done)
                view = view[written:]
                done += written
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _full(path, exc) from exc
        raise


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer can still allocate on ``path``'s file system."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def total_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def allocated_bytes(path: Path) -> int:
    """Bytes the files under the directory ``path`` take; links are not followed."""
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            with suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def remove_tree(path: Path) -> int:
    """Remove a directory tree, file or symlink; return the bytes its files held.

    Symlinks are removed, never followed (a staged entry link points into ``objects/``).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(path)
        except FileNotFoundError:
            return 0
        return st.st_blocks * 512
    freed = allocated_bytes(path)
    shutil.rmtree(path, ignore_errors=True)
    return freed


def try_lock_exclusive(fd: int) -> bool:
    """Take an exclusive flock on ``fd`` without waiting; False if someone holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class FileLockProbe:
    """Tells whether the process that flocked a file is still alive.

    The kernel drops a flock when its holder dies (even by ``kill -9``), so a lock we
    can take belongs to a dead (or finished) writer, whatever PID namespace it ran in.
    """

    @staticmethod
    def holder_alive(path: Path) -> bool:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            if try_lock_exclusive(fd):
                fcntl.flock(fd, fcntl.LOCK_UN)
                return False
            return True
        finally:
            os.close(fd)


# Byte-range locks (``fcntl`` F_SETLK: owned by the process, not inherited by a fork,
# released by the kernel when the process dies). ``struct flock`` on 64-bit Linux:
# short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid (32 bytes).
_FLOCK = "hhqqi4x"
_BUSY = (errno.EAGAIN, errno.EACCES)


def try_lock_range(fd: int, offset: int, shared: bool, length: int = 1) -> bool:
    """Lock ``length`` bytes from ``offset`` of ``fd``'s file (0: to its end, however far it
    grows) for this process without waiting; False if another process holds a conflicting
    lock on any of them."""
    kind = fcntl.F_RDLCK if shared else fcntl.F_WRLCK
    try:
        fcntl.fcntl(fd, fcntl.F_SETLK, struct.pack(_FLOCK, kind, os.SEEK_SET, offset, length, 0))
    except OSError as exc:
        if exc.errno in _BUSY:
            return False
        raise
    return True


def unlock_range(fd: int, offset: int, length: int = 1) -> None:
    """Release this process's locks on ``length`` bytes from ``offset`` of ``fd``'s file
    (0: to its end)."""
    fcntl.fcntl(fd, fcntl.F_SETLK, struct.pack(_FLOCK, fcntl.F_UNLCK, os.SEEK_SET, offset, length, 0))


def unlock_ranges(fd: int, ranges: Iterable[tuple[int, int]]) -> None:
    """:func:`unlock_range` of each ``(offset, length)``: a batch's thousands of unlocks
    without a Python call each."""
    pack, setlk, unlock, fcntl_ = struct.Struct(_FLOCK).pack, fcntl.F_SETLK, fcntl.F_UNLCK, fcntl.fcntl
    for offset, length in ranges:
        fcntl_(fd, setlk, pack(unlock, os.SEEK_SET, offset, length, 0))


_FLOCK_ARRAY = np.dtype(
    {
        "names": ["type", "whence", "start", "length"],
        "formats": ["=i2", "=i2", "=i8", "=i8"],
        "offsets": [0, 2, 8, 16],  # as struct packs _FLOCK (native alignment: l_start at 8)
        "itemsize": struct.calcsize(_FLOCK),
    }
)


def unlock_all_but(fd: int, keep: np.ndarray) -> None:
    """Release this process's locks on all of ``fd``'s file but the bytes ``keep`` (sorted
    int64, each once): one unlock per gap, highest first (each then splits the process's
    first lock of the file, where the kernel's walk stops; lowest first would walk every
    byte kept). The gaps and their ``struct flock`` are built in numpy and the calls made
    without a Python loop: a batch's thousands of unlocks cost about the system calls."""
    if len(keep) == 0:
        unlock_range(fd, 0, 0)
        return
    starts = keep[:-1] + 1
    lengths = keep[1:] - starts
    gap = lengths > 0
    # int64 throughout: an empty list would make numpy concatenate to float64, which cannot
    # hold offsets up to 2**58 exactly (kept bytes would be unlocked).
    first = np.array([0] if keep[0] > 0 else [], np.int64)  # the gap below the lowest kept: last
    packed = np.zeros(1 + int(gap.sum()) + len(first), _FLOCK_ARRAY)
    packed["type"], packed["whence"] = fcntl.F_UNLCK, os.SEEK_SET
    last = np.array([keep[-1] + 1], np.int64)
    packed["start"] = np.concatenate((last, starts[gap][::-1].astype(np.int64), first))
    below = np.array([keep[0]] if len(first) else [], np.int64)
    to_end = np.zeros(1, np.int64)  # length 0: to the end of the file
    packed["length"] = np.concatenate((to_end, lengths[gap][::-1].astype(np.int64), below))
    raw, size = packed.tobytes(), _FLOCK_ARRAY.itemsize
    unlock = functools.partial(fcntl.fcntl, fd, fcntl.F_SETLK)
    deque(map(unlock, [raw[at : at + size] for at in range(0, len(raw), size)]), maxlen=0)


def range_lock_holder(fd: int, offset: int, shared: bool) -> int | None:
    """The pid of a process whose lock on byte ``offset`` conflicts with ours (as this
    process's PID namespace numbers it: 0 for a process it cannot see), or None if none
    does now. The kernel's answer, so it names the real owner (never a stale pid file)."""
    found = range_lock_conflict(fd, offset, shared)
    return None if found is None else found[0]


def range_lock_conflict(fd: int, offset: int, shared: bool) -> tuple[int, bool] | None:
    """What :func:`range_lock_holder` says, and whether the conflicting lock covers the
    whole file (offset 0 to its end: a big batch's, held for milliseconds while it narrows
    to its own bytes)."""
    kind = fcntl.F_RDLCK if shared else fcntl.F_WRLCK
    got = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack(_FLOCK, kind, os.SEEK_SET, offset, 1, 0))
    held, _, start, length, pid = struct.unpack(_FLOCK, got)
    return None if held == fcntl.F_UNLCK else (int(pid), start == 0 and length == 0)


_PREAD_CHUNK = 1 << 30  # below Linux's 2 GiB cap on one read


def pread_exactly(fd: int, count: int, offset: int, short: Callable[[int], Exception]) -> bytearray:
    """``count`` bytes of ``fd`` from ``offset`` into a new buffer (``preadv``, in reads
    under Linux's 2 GiB cap); a file that ends first raises ``short(bytes_read)``: the
    caller says what was truncated."""
    buffer = bytearray(count)
    view = memoryview(buffer)
    done = 0
    while done < count:
        got = os.preadv(fd, [view[done : done + _PREAD_CHUNK]], offset + done)
        if got == 0:
            raise short(done)
        done += got
    return buffer
