"""The tree of entry links: replacing a whole prefix at once, migrating flat roots,
pruning empty prefixes.

A directory put (several keys) must be seen whole or not at all by every reader, even
one that opens a single key, and even if the writer dies halfway (``kill -9``). Swapping
N links one by one cannot give that; swapping one directory can: the writer builds a
complete new copy of the keys' common prefix directory in ``tmp/`` and exchanges it with
the live one in one ``renameat2(RENAME_EXCHANGE)``. A reader's path walk goes through the
old directory or the new one. The caller holds the root's publish lock exclusive from the
copy to the exchange, so no single-key publish or evict (which take it shared) is lost.

``crash_point`` is a test hook: ``SHMCACHE_TEST_CRASH_AT=<step>`` makes the writer
``SIGKILL`` itself at that step, so tests can kill it at exact instants.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable, Container, Iterable

from ..errors import CacheRootError
from .fs import raise_if_full
from .layout import (
    DIR_MARK,
    Layout,
    decode_key,
    entry_path,
    flat_entry_names,
    mark_tree_format,
    version_of_target,
)

__all__ = [
    "CRASH_ENV",
    "MIGRATING_PREFIX",
    "build_tree",
    "common_prefix",
    "crash_point",
    "install_tree",
    "make_prefix_dirs",
    "migrate_flat_links",
    "prune_empty_prefixes",
]

CRASH_ENV = "SHMCACHE_TEST_CRASH_AT"
MIGRATING_PREFIX = "migrate-"
"""A format-1 link staged in ``tmp/`` by a migration (no writer's lock: aged, not probed)."""
_CRASH_AT = os.environ.get(CRASH_ENV) or None

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347}


def crash_point(step: str) -> None:
    """Die here by ``SIGKILL`` if the test hook names ``step`` (no cost otherwise)."""
    if _CRASH_AT is not None and step == _CRASH_AT:
        os.kill(os.getpid(), signal.SIGKILL)


def common_prefix(keys: Iterable[str]) -> str:
    """The longest prefix directory that holds every key ("" for ``entries/`` itself): the
    common start of the least and the greatest key (every key shares what those two do),
    cut at its last ``/`` (what stays before it is whole segments that every key has below
    it); two C passes over the keys, no ``split`` per key."""
    listed = keys if isinstance(keys, (list, tuple)) else list(keys)
    if not listed:
        return ""
    common = os.path.commonprefix([min(listed), max(listed)])  # noqa: RUF071 (characters, then cut)
    cut = common.rfind("/")
    return common[:cut] if cut > 0 else ""


def build_tree(
    layout: Layout, prefix: str, staging: str, links: Iterable[tuple[str, str]]
) -> dict[str, str]:
    """Build in ``staging`` (under ``tmp/``) a complete copy of ``prefix``'s directory
    with ``links`` (``(key, target)``, keys under ``prefix``) put in or replaced; returns
    key -> the version its live link pointed at, for the keys that had one (read from the
    copied directory itself: no ``readlink`` per new key).

    Running out of inodes is a :class:`~shmcache.errors.CacheFullError`."""
    live = layout.prefix_dir(prefix)
    start = len(prefix) + 1 if prefix else 0
    links = [(key[start:], target) for key, target in links] if start else list(links)
    found: dict[str, str] = {}
    try:
        mode = layout.dir_mode
        # the links' paths below ``live``, for the copy to leave out: only if there is a copy
        paths = {entry_path(name): name for name, _ in links} if os.path.isdir(live) else {}
        _copy_tree(live, staging, paths, mode, found)
        made = {staging}  # prefix directories made so far
        below: set[str] = set()  # the same, relative to ``staging``
        symlink = os.symlink
        # links made relative to the copy's descriptor: no walk of the root's path per link
        at = os.open(staging, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for count, (name, target) in enumerate(links):
                if "/" in name:  # below a prefix directory of its own
                    directory, _, leaf = name.rpartition("/")
                    directory = f"{entry_path(directory)}{DIR_MARK}"
                    if directory not in below:
                        _make_dirs(staging, f"{staging}/{directory}", mode, made)
                        below.add(directory)
                    path = f"{directory}/{leaf}"
                else:
                    path = name
                try:
                    symlink(target, path, dir_fd=at)
                except FileExistsError:
                    os.unlink(path, dir_fd=at)
                    symlink(target, path, dir_fd=at)
                if not count:
                    crash_point("tree-first-link")
        finally:
            os.close(at)
    except OSError as exc:
        raise_if_full(staging, exc)
        raise
    head = f"{prefix}/" if prefix else ""
    return {head + paths[path]: version_of_target(target) for path, target in found.items()}


def _make_dirs(staging: str, directory: str, mode: int, made: set[str]) -> None:
    """Make ``directory`` (below ``staging``) and its parents that are not in ``made``."""
    missing = []
    while directory not in made:
        missing.append(directory)
        directory = directory.rpartition("/")[0]
    for path in reversed(missing):
        _mkdir(path, mode)
        made.add(path)


def install_tree(layout: Layout, prefix: str, staging: str) -> bool:
    """Put the tree built in ``staging`` in place of ``prefix``'s directory, atomically
    for every reader; the old directory (if there was one) is left at ``staging`` for the
    caller to remove. True if there was an old one."""
    live = layout.prefix_dir(prefix)
    crash_point("tree-before-exchange")
    try:
        _renameat2(staging, live, _RENAME_EXCHANGE)
        replaced = True
    except FileNotFoundError:  # a new prefix: nothing to exchange with
        make_prefix_dirs(layout, prefix.rpartition("/")[0])
        _renameat2(staging, live, _RENAME_NOREPLACE)
        replaced = False
    crash_point("tree-after-exchange")
    return replaced


def make_prefix_dirs(layout: Layout, prefix: str) -> None:
    """Create the directories of ``prefix`` that are missing (the caller holds the
    publish lock, shared or exclusive: none is removed meanwhile)."""
    if not prefix:
        return
    directory = str(layout.entries)
    for segment in prefix.split("/"):
        directory = f"{directory}/{segment}{DIR_MARK}"
        _mkdir(directory, layout.dir_mode)


def migrate_flat_links(layout: Layout) -> int:
    """Move every format 1 link ``entries/a~b`` to ``entries/a~/b``, then record the tree
    format; returns how many moved. The caller holds the publish lock exclusive.

    The new link is made before the flat one goes, and a reader tries the tree first, so
    the key never disappears; a link already in the tree is newer and is kept."""
    moved = 0
    for name in flat_entry_names(layout):
        key = decode_key(name)
        flat = f"{layout.entries}/{name}"
        try:
            target = os.readlink(flat)
        except OSError:
            continue
        version = version_of_target(target)
        make_prefix_dirs(layout, key.rpartition("/")[0])
        link = layout.entry_link(key)
        if not os.path.lexists(link):
            staged = f"{layout.tmp}/{MIGRATING_PREFIX}{os.getpid()}-{os.urandom(4).hex()}.link"
            os.symlink(layout.link_target(version, key), staged)
            os.rename(staged, link)
        os.unlink(flat)
        moved += 1
    if not flat_entry_names(layout):
        mark_tree_format(layout)
    return moved


def prune_empty_prefixes(layout: Layout) -> int:
    """Remove empty prefix directories (the caller holds the publish lock exclusive, so
    no writer is about to link into one); returns how many went."""
    return _prune(str(layout.entries), top=True)


def _prune(directory: str, top: bool = False) -> int:
    removed = 0
    empty = True
    try:
        scanned = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    for item in scanned:
        if item.name.endswith(DIR_MARK) and item.is_dir(follow_symlinks=False):
            removed += _prune(item.path)
            if os.path.isdir(item.path):
                empty = False
        else:
            empty = False
    if empty and not top:
        try:
            os.rmdir(directory)
            removed += 1
        except OSError:
            pass
    return removed


def _copy_tree(
    source: str,
    destination: str,
    replaced: Container[str],
    mode: int,
    found: dict[str, str],
    relative: str = "",
) -> None:
    """Copy a directory of entry links (and prefix directories) as it is, but for the links
    at ``replaced`` (paths relative to ``source``), whose targets go to ``found``: the
    links keep their targets, right at the same depth."""
    _mkdir(destination, mode, exist_ok=False)
    try:
        scanned = os.scandir(source)
    except (FileNotFoundError, NotADirectoryError):
        return  # a new prefix: start empty
    with scanned:
        for item in scanned:
            path = f"{destination}/{item.name}"
            if item.is_symlink():  # the directory entry's type: no stat
                if relative + item.name not in replaced:
                    os.symlink(os.readlink(item.path), path)
                else:
                    found[relative + item.name] = os.readlink(item.path)
            elif item.is_dir(follow_symlinks=False):
                _copy_tree(item.path, path, replaced, mode, found, f"{relative}{item.name}/")


def _mkdir(path: str, mode: int, exist_ok: bool = True) -> None:
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        if not exist_ok:
            raise


_Renameat2 = Callable[[int, bytes, int, bytes, int], int]


def _load_renameat2() -> _Renameat2 | None:
    import ctypes  # deferred: the write side alone needs it (import time of the open path)
    import platform

    # the process's own symbols (its libc among them): find_library("c") would run
    # `ldconfig -p` in a subprocess, ~3 ms of the first directory put
    libc = ctypes.CDLL(None, use_errno=True)
    function = getattr(libc, "renameat2", None)  # glibc >= 2.28
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        function.restype = ctypes.c_int
        return function  # type: ignore[no-any-return]
    number = _SYS_RENAMEAT2.get(platform.machine())
    if number is None:
        return None
    syscall = libc.syscall
    syscall.restype = ctypes.c_long

    def via_syscall(olddirfd: int, old: bytes, newdirfd: int, new: bytes, flags: int) -> int:
        return int(syscall(ctypes.c_long(number), olddirfd, old, newdirfd, new, ctypes.c_uint(flags)))

    return via_syscall


_renameat2_function: _Renameat2 | None = None


def _renameat2(old: str, new: str, flags: int) -> None:
    """``renameat2(2)`` by ctypes; a refused flag is a :class:`CacheRootError` that says why."""
    import ctypes

    global _renameat2_function
    if _renameat2_function is None:
        _renameat2_function = _load_renameat2()
        if _renameat2_function is None:
            raise CacheRootError(
                "cannot publish a directory atomically: no renameat2 in the C library nor a known "
                "system call number for it on this machine; use Linux on x86_64 or aarch64"
            )
    if _renameat2_function(_AT_FDCWD, os.fsencode(old), _AT_FDCWD, os.fsencode(new), flags) == 0:
        return
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        raise CacheRootError(
            f"the file system of {new} cannot exchange two directories atomically "
            f"(renameat2 RENAME_EXCHANGE: {os.strerror(code)}), which a directory put needs to be "
            "seen all old or all new; put the cache root on a tmpfs (/dev/shm) or a local file system"
        )
    raise OSError(code, os.strerror(code), new)
