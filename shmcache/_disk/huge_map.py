"""Entry files mapped on 2 MiB pages without root: an aligned mapping, then ``MADV_COLLAPSE``.

A tmpfs mounted without ``huge=`` (the usual ``/dev/shm``) keeps files on 4 KiB pages,
and random rows of a big entry then miss the TLB (issue 22 item 3). Since Linux 6.1,
``madvise(MADV_COLLAPSE)`` turns the page cache of a tmpfs file into 2 MiB pages for any
user, whatever ``shmem_enabled`` says (short of ``deny``) -- provided the mapping's
address is 2 MiB aligned with the file offset, which tmpfs without ``huge=`` never
gives and Python's ``mmap`` cannot ask for. So: reserve ``size + 2 MiB`` of address
space, map the file over the aligned start with ``MAP_FIXED``, trim the rest. The first
collapse copies the file into huge pages (about 1-2 s per GiB); they stay the file's
pages, for every process, until it is removed, and later collapses cost next to nothing.
Only a mapping aligned like this one is mapped with 2 MiB entries: readers get the
speed by mapping this way too.

Everything here declines rather than fails (``None``, or a :class:`Collapsed` with a
reason): other systems, 32-bit builds, kernels without ``MADV_COLLAPSE``, an ``mmap``
refused. The caller then maps the ordinary way and reads 4 KiB pages.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import weakref
from functools import cache
from typing import NamedTuple

import numpy as np

__all__ = [
    "Collapsed",
    "address_of",
    "collapse",
    "collapse_file",
    "map_aligned",
    "map_collapsed",
    "pmd_size",
    "supported",
]

_PMD_SIZE_FILE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
_SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
# The generic Linux numbers, shared by these architectures (others: declined).
_ARCHES = ("x86_64", "aarch64", "riscv64", "s390x")
_PROT_NONE, _PROT_READ, _PROT_WRITE = 0, 1, 2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MADV_COLLAPSE = 25
_MAP_FAILED = ctypes.c_void_p(-1).value
_TRANSIENT = (errno.EAGAIN, errno.ENOMEM, errno.EBUSY)


class Collapsed(NamedTuple):
    """What one :func:`collapse` did: bytes now on huge pages, and why not all (None: all)."""

    collapsed: int
    reason: str | None


@cache
def pmd_size() -> int | None:
    """The kernel's transparent huge page size (2 MiB on x86-64), or None where this
    module declines: not Linux, not 64-bit, another architecture, no THP in the kernel,
    ``shmem_enabled`` set to ``deny``, or a kernel older than 6.1 (no ``MADV_COLLAPSE``)."""
    if sys.platform != "linux" or ctypes.sizeof(ctypes.c_void_p) != 8 or os.uname().machine not in _ARCHES:
        return None
    try:
        with open(_PMD_SIZE_FILE) as fp:
            size = int(fp.read())
        with open(_SHMEM_ENABLED) as fp:
            if "[deny]" in fp.read():
                return None
    except (OSError, ValueError):
        return None
    release = os.uname().release.split(".")
    try:
        if (int(release[0]), int(release[1].split("-")[0])) < (6, 1):
            return None
    except (IndexError, ValueError):
        return None
    return size if size > 0 and size & (size - 1) == 0 else None


def supported() -> bool:
    """Whether huge page mappings may work here (cheap: a few sysfs reads, once). The
    kernel may still refuse a collapse (memory, a ``prctl``): :func:`collapse` says so."""
    return pmd_size() is not None


@cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)  # the process's own libc: no find_library subprocess
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.restype = ctypes.c_int
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _munmap(address: int, length: int) -> None:
    _libc().munmap(address, length)


def map_aligned(fd: int, size: int, *, private: bool = True) -> memoryview | None:
    """``size`` bytes of ``fd`` from offset 0, mapped at a huge-page-aligned address.

    ``private``: ``MAP_PRIVATE | MAP_NORESERVE`` with ``PROT_READ | PROT_WRITE``, the
    copy-on-write mapping ``attach`` makes (a write copies its page into this mapping,
    never into the file); else ``MAP_SHARED`` with ``PROT_READ``, and the view is
    read-only (numpy refuses writes instead of a SIGSEGV). The mapping is removed when
    the view, and every array over it, is gone. None where this module declines, or
    the file is smaller than one huge page (nothing to gain), or the kernel refuses the
    mapping (the caller's ordinary ``mmap`` then says why).
    """
    huge = pmd_size()
    if huge is None or size < huge:
        return None
    libc = _libc()
    page = os.sysconf("SC_PAGE_SIZE")
    length = -(-size // page) * page
    reserved = libc.mmap(
        None, length + huge, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0
    )
    if reserved is None or reserved == _MAP_FAILED:
        return None
    start = -(-reserved // huge) * huge
    if private:
        prot, flags = _PROT_READ | _PROT_WRITE, _MAP_PRIVATE | _MAP_NORESERVE
    else:
        prot, flags = _PROT_READ, _MAP_SHARED
    address = libc.mmap(start, length, prot, flags | _MAP_FIXED, fd, 0)
    if address != start:  # refused (ENOMEM under strict overcommit, a locked file...)
        libc.munmap(reserved, length + huge)
        return None
    if start > reserved:  # give back the reservation around the mapping
        libc.munmap(reserved, start - reserved)
    if reserved + huge > start:
        libc.munmap(start + length, reserved + huge - start)
    buffer = (ctypes.c_char * size).from_address(start)  # the view holds it; it holds the mapping
    unmap = weakref.finalize(buffer, _munmap, start, length)
    unmap.atexit = False  # at exit, arrays over it may outlive the finalizers: leave it to the kernel
    view = memoryview(buffer).cast("B")
    return view if private else view.toreadonly()


def address_of(view: memoryview) -> int:
    """The address of the first byte of a :func:`map_aligned` view (read-only ones too)."""
    return int(np.frombuffer(view, dtype=np.uint8, count=1).ctypes.data)


def collapse(address: int, size: int) -> Collapsed:
    """Put the whole huge pages inside ``[address, address + size)`` of a file mapping
    on huge pages (``MADV_COLLAPSE``). Never raises: a kernel that cannot (EINVAL, ...)
    or a range it could only partly collapse (EAGAIN, ENOMEM: no free 2 MiB page) comes
    back as the bytes done and the reason; the mapping works either way."""
    huge = pmd_size()
    if huge is None:
        return Collapsed(0, "not supported here (needs Linux >= 6.1, 64-bit, transparent huge pages)")
    start = -(-address // huge) * huge
    end = (address + size) // huge * huge
    if end <= start:
        return Collapsed(0, f"no whole {huge >> 20} MiB page in {size:,} bytes")
    libc = _libc()
    if libc.madvise(start, end - start, _MADV_COLLAPSE) == 0:
        return Collapsed(end - start, None)
    error = ctypes.get_errno()
    if error not in _TRANSIENT:
        return Collapsed(
            0,
            f"not supported by this kernel for this file ({_strerror(error)}; MADV_COLLAPSE needs "
            "Linux >= 6.1, a tmpfs file, huge pages not disabled for this process)",
        )
    done, last = 0, error  # partly: page by page, to go on past the pages it could not do
    for page in range(start, end, huge):
        if libc.madvise(page, huge, _MADV_COLLAPSE) == 0:
            done += huge
        else:
            last = ctypes.get_errno()
    if done == end - start:
        return Collapsed(done, None)
    return Collapsed(done, f"{done >> 20} of {(end - start) >> 20} MiB collapsed ({_strerror(last)})")


def map_collapsed(fd: int, size: int) -> tuple[memoryview, Collapsed] | None:
    """:func:`map_aligned` (private), then :func:`collapse` over it; None where declined."""
    buffer = map_aligned(fd, size)
    if buffer is None:
        return None
    done = collapse(address_of(buffer), size)
    if done.reason is not None:  # not the user's error: said for who looks (logging at DEBUG)
        import logging

        logging.getLogger(__name__).debug("huge pages for a %d-byte entry: %s", size, done.reason)
    return buffer, done


def collapse_file(path: str) -> Collapsed:
    """Put the whole huge pages of the file at ``path`` on huge pages, through a shared
    read-only aligned mapping made for it and dropped at once: for a process that does not
    read the file (a daemon after a load), so that readers find the pages made and the
    collapsing process's memory cgroup, which the kernel charges for them, is its own."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return Collapsed(0, f"cannot open {path}: {exc.strerror}")
    try:
        size = os.fstat(fd).st_size
        view = map_aligned(fd, size, private=False)
    finally:
        os.close(fd)
    if view is None:
        return Collapsed(0, f"{path}: smaller than a huge page, or huge pages not supported here")
    done = collapse(address_of(view), size)
    del view  # unmapped with it; the page cache keeps the huge pages
    return done


def _strerror(error: int) -> str:
    return f"{errno.errorcode.get(error, str(error))}: {os.strerror(error)}"
