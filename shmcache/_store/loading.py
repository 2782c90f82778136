"""``cache()``'s failed loads, shared with the callers that waited for them.

Callers of ``cache(key, loader)`` that find no entry queue on the key's lock; the first
runs the loader. If the load fails, the others must not each run it again (8 waiters,
8 failing runs of a loader that may take minutes): the loading process records the
failure beside the key's lock (``layout.key_failure``) before it lets go, and a waiter
that finds a record other than the one it saw before waiting raises that error.

The record holds the error's class, arguments and traceback text: a waiter raises the
same class with the same arguments, caused by the loader's traceback (as
``concurrent.futures`` does for a worker process's error).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from .._disk.layout import Layout
from ..errors import ShmCacheError

__all__ = ["LoadFailure", "last_failure", "recording_failure"]

_PLAIN = (str, int, float, bool, type(None))


class _LoaderTraceback(Exception):
    """The cause of an error re-raised for a waiter: where the loader raised it."""


@dataclass(frozen=True)
class LoadFailure:
    """One failed load of a key, as recorded by the process that ran the loader."""

    id: str
    pid: int
    error_type: str  # "module:qualname"
    args: tuple[Any, ...]
    traceback: str

    def error(self, key: str) -> Exception:
        """The same error, raised again in this process, caused by the loader's traceback."""
        error = _rebuild(self.error_type, self.args)
        cause = _LoaderTraceback(
            f"the load of {key!r} that this call waited for failed in process {self.pid} (the "
            "loader is not run again for callers that waited; call cache() again to retry):\n"
            f"{self.traceback}"
        )
        error.__cause__ = cause
        return error


def _rebuild(error_type: str, args: tuple[Any, ...]) -> Exception:
    """``cls(*args)`` for a class already imported here (nothing is imported on a record's
    word); a :class:`ShmCacheError` naming it otherwise."""
    module, _, qualname = error_type.partition(":")
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if isinstance(found, type) and issubclass(found, Exception):
        with suppress(Exception):
            return found(*args)
    return ShmCacheError(f"{error_type.replace(':', '.')}: {', '.join(map(str, args))}")


def last_failure(layout: Layout, key: str) -> LoadFailure | None:
    """The last recorded failed load of ``key``, or None."""
    try:
        with open(layout.key_failure(key), "rb") as fp:
            record = json.load(fp)
        return LoadFailure(
            str(record["id"]),
            int(record["pid"]),
            str(record["error_type"]),
            tuple(record["args"]),
            str(record["traceback"]),
        )
    except (OSError, ValueError, KeyError, TypeError):  # none, or not ours to trust
        return None


@contextmanager
def recording_failure(layout: Layout, key: str) -> Iterator[None]:
    """Run a load (under the key's lock): record the error it raises for the callers that
    wait, or forget an earlier failure once it succeeds."""
    path = layout.key_failure(key)
    try:
        yield
    except Exception as exc:
        with suppress(OSError):  # best effort: the error itself goes on either way
            _write(path, _record_of(exc))
        raise
    with suppress(FileNotFoundError):
        os.unlink(path)


def _record_of(exc: Exception) -> dict[str, Any]:
    cls = type(exc)
    args = list(exc.args) if all(isinstance(a, _PLAIN) for a in exc.args) else [str(exc)]
    return {
        "id": os.urandom(16).hex(),
        "pid": os.getpid(),
        "error_type": f"{cls.__module__}:{cls.__qualname__}",
        "args": args,
        "traceback": "".join(traceback.format_exception(exc)),
    }


def _write(path: os.PathLike[str], record: dict[str, Any]) -> None:
    """Write ``record`` whole: a reader sees the old record or the new one."""
    staging = f"{os.fspath(path)}.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as fp:
            json.dump(record, fp)
        os.replace(staging, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(staging)
        raise
