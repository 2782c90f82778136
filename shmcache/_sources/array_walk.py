"""One walk of a directory a ``put_file`` takes: its array files (by suffix) in the order the
put takes them, and what decides the directory's kind (``blobs.put_kind``: arrays, blobs,
or refused as mixed), so that a directory put lists its files once. One ``os.scandir``
per directory: a regular file costs no ``stat``."""

from __future__ import annotations

import gc
import operator
import os
from collections.abc import Container
from typing import Any, NamedTuple

from .._disk.fs import out_of_descriptors, too_many_open_files

__all__ = ["ArrayFiles", "walk_array_files"]


class ArrayFiles(NamedTuple):
    """One walk of a directory: what ``put_file`` decides its kind from (``blobs.put_kind``)
    and then plans, so that a directory put lists its files once."""

    top: str
    """The directory, absolute and normal."""
    files: list[tuple[str, str]]
    """``(relative path, lower-case suffix)`` of the regular files (or links to them) whose
    suffix has a planner, in the order a put takes them."""
    named: int
    """Non-directories whose suffix has a planner, regular files or not."""
    others: int
    """The other non-directories (links to directories aside): what a blobs entry takes."""


def walk_array_files(top: str, suffixes: Container[str]) -> ArrayFiles:
    """:class:`ArrayFiles` of ``top`` (absolute and normal) for the lower-case ``suffixes``
    that have a planner, its files in the order ``sorted(Path(top).rglob("*"))`` gives:
    each directory's entries sorted by name, depth first (what sorting every path's parts
    gives, without a tuple per file); linked directories are not entered. The cyclic
    garbage collector waits meanwhile (as ``_store/gc_pause`` makes it wait for the rest
    of a directory put): a walk of 100,000 files makes 100,000 tuples and no cycle, and
    its passes over them cost up to a third of the walk (measured)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _walk(top, suffixes)
    finally:
        if enabled:
            gc.enable()


def _walk(top: str, suffixes: Container[str]) -> ArrayFiles:
    found: list[tuple[str, str]] = []
    named = others = 0
    # (path, relative path, None) of a directory to list, (_, relative, suffix) of a file
    pending: list[tuple[str, str, str | None]] = [(top.rstrip("/") + "/", "", None)]
    while pending:
        path, relative, lower = pending.pop()
        if lower is not None:  # a file, in its place among directories
            found.append((relative, lower))
            continue
        files, dirs, counts = _scan(path, suffixes)
        named, others = named + counts[0], others + counts[1]
        if not dirs:  # nearly always: the files in name order
            found.extend([(relative + name, lower) for name, lower in files])
            continue
        merged = sorted(
            [(name, f"{path}{name}/", f"{relative}{name}/", None) for name in dirs]
            + [(name, "", relative + name, lower) for name, lower in files]
        )
        pending.extend((path, relative, lower) for _, path, relative, lower in reversed(merged))
    return ArrayFiles(top, found, named, others)


def _scan(
    directory: str, suffixes: Container[str]
) -> tuple[list[tuple[str, str]], list[str], tuple[int, int]]:
    """The files of ``directory`` whose suffix has a planner (``(name, lower-case suffix)``)
    and its subdirectories (links to directories aside), each sorted by name; and how
    many non-directories have a planner's suffix, and how many have not."""
    with _listing(directory) as listing:
        entries = sorted(listing, key=_NAME)
    files: list[tuple[str, str]] = []
    dirs: list[str] = []
    named = others = 0
    append = files.append
    for entry in entries:  # a directory's type is in its entry: no stat but for a link
        name = entry.name
        dot = name.rfind(".")
        try:
            if entry.is_file():  # a regular file (one call, nearly always), or a link to one
                if dot > 0 and (lower := name[dot:].lower()) in suffixes:
                    named += 1
                    append((name, lower))
                else:
                    others += 1
            elif entry.is_dir(follow_symlinks=False):
                dirs.append(name)
            elif dot > 0 and name[dot:].lower() in suffixes:
                named += 1  # not a file (a FIFO, a broken link): counted, not taken
            elif not (entry.is_symlink() and entry.is_dir()):
                others += 1
        except OSError:  # a link that cannot be followed: not an array file (named, if so named)
            named += dot > 0 and name[dot:].lower() in suffixes
            others += 1
    return files, dirs, (named, others)


_NAME = operator.attrgetter("name")


def _listing(directory: str) -> Any:
    """``os.scandir(directory)``; out of descriptors is :class:`TooManyOpenFilesError`."""
    try:
        return os.scandir(directory)
    except OSError as exc:
        if out_of_descriptors(exc):
            raise too_many_open_files(exc, f"listing {directory}") from exc
        raise
