"""The root's byte budget, recorded in the root itself (``<root>/budget.json``) so that
every writer honours it: library calls, the CLI with or without a daemon, the daemon and
its preloads. ``shmcache serve --max-bytes``, ``shmcache budget set`` and
``Store.set_budget`` write it; ``space.reserve`` reads it under the space lock before
every write.

The record is written beside and renamed over the old one, so a reader sees the old
budget or the new one, never a partial file. No record means no budget.
"""

from __future__ import annotations

import errno
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from .._disk.fs import out_of_descriptors, too_many_open_files
from .._disk.layout import Layout
from .._disk.trust import check_root
from .._units import size_in_bytes
from ..errors import CacheRootError, InvalidRequestError

__all__ = ["BudgetRecord", "checked_budget", "read_budget", "write_budget"]

_FIX = "set it again with `shmcache budget set SIZE`, or remove it with `shmcache budget clear`"


@dataclass(frozen=True)
class BudgetRecord:
    """The budget recorded in a root, and who set it when (for ``shmcache budget``)."""

    max_bytes: int
    set_by: str
    set_at: float


def checked_budget(value: object, what: str = "max_bytes") -> int | None:
    """A budget in bytes from an int or a size (``"100MiB"``), or None for no budget;
    :class:`InvalidRequestError` for anything else (negative numbers, bools, nonsense)."""
    if value is None:
        return None
    try:
        nbytes = size_in_bytes(value)
    except ValueError as exc:
        raise InvalidRequestError(f"{what} {exc}") from None
    if nbytes < 0:
        raise InvalidRequestError(f"{what} must be a number of bytes >= 0, got {value!r}")
    return nbytes


def read_budget(layout: Layout) -> BudgetRecord | None:
    """The root's budget, or None when none is recorded (or there is no root yet).

    A record that cannot be read or makes no sense raises :class:`CacheRootError`: a
    writer must not take a damaged budget for no budget.
    """
    path = layout.budget
    try:
        with open(path, "rb") as fp:
            text = fp.read(4096)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if out_of_descriptors(exc):  # not the record's fault: no advice to reset it
            raise too_many_open_files(exc, f"reading the budget of {layout.root}") from exc
        if exc.errno == errno.EACCES:
            check_root(str(layout.root), layout.owner)  # another user's root: say that
            raise CacheRootError(f"cannot read the budget of cache root {layout.root} ({path}): "
                                 f"{exc.strerror}") from exc
        raise CacheRootError(f"cannot read the budget of cache root {layout.root} ({path}): "
                             f"{exc.strerror}; {_FIX}") from exc
    try:
        data: Any = json.loads(text)
        max_bytes = data["max_bytes"]
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ValueError(f"max_bytes is {max_bytes!r}, not a number of bytes")
        return BudgetRecord(max_bytes, str(data.get("set_by", "?")), float(data.get("set_at", 0.0)))
    except (ValueError, TypeError, KeyError) as exc:  # JSONDecodeError is a ValueError
        raise CacheRootError(f"the budget record {path} of cache root {layout.root} is damaged "
                             f"({exc}); {_FIX}") from None


def write_budget(layout: Layout, max_bytes: int | None, set_by: str) -> None:
    """Record ``max_bytes`` as the root's budget (None removes it), replacing the record
    whole. The root must exist."""
    path = layout.budget
    if max_bytes is None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    body = json.dumps({"max_bytes": max_bytes, "set_by": set_by, "set_at": time.time()})
    staging = layout.root / f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}"
    try:
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, layout.file_mode)
        try:
            os.write(fd, body.encode())
        finally:
            os.close(fd)
        os.replace(staging, path)
    except OSError as exc:
        try:
            os.unlink(staging)
        except OSError:
            pass
        raise CacheRootError(f"cannot record the budget of cache root {layout.root} in {path}: "
                             f"{exc.strerror}") from exc
