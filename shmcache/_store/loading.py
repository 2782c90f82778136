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
from .._sources.source_files import racy_after
from ..errors import ShmCacheError, SourceNotFoundError, UnsupportedDataError

__all__ = ["CacheVersion", "LoadFailure", "cache_version_token", "last_failure", "recording_failure"]

_PLAIN = (str, int, float, bool, type(None))
_TOKEN_MAX = 200  # longer version tokens are recorded as their hash

CacheVersion = Any
"""What ``cache(..., version=)`` takes: a str, an int, a path (its size and mtime are the
version: a loader that reads it reloads when the file changes, and once more after a load
within 2 s of its modification: ``source_files.RACY_NS``), or a tuple/list of those."""


def cache_version_token(version: CacheVersion) -> str:
    """The recorded form of a ``cache()`` version: two calls agree on a version exactly when
    their tokens are equal (an int and its str differ: ``2`` is not ``"2"``)."""
    token = _token(version, depth=0)
    if len(token) <= _TOKEN_MAX:
        return token
    import hashlib  # deferred: long tokens are rare

    return "sha256:" + hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def _token(version: CacheVersion, depth: int) -> str:
    if isinstance(version, bool) or depth > 8:
        raise _not_a_version(version)
    if isinstance(version, str):
        return f"s:{version}"
    if isinstance(version, int):
        return f"i:{version}"
    if isinstance(version, os.PathLike):
        path = os.fspath(version)
        try:
            st = os.stat(path)
        except OSError as exc:
            raise SourceNotFoundError(
                f"cache() version names the file {path!r}, which cannot be read ({exc.strerror}): "
                "pass the path of a file that the loader reads"
            ) from None
        # modified within RACY_NS (a write may still have been copying when the loader read
        # it): a token no later call makes once the file is old, which then loads it again
        racy = ":racy" if st.st_mtime_ns > racy_after() else ""
        return f"f:{path}:{st.st_size}:{st.st_mtime_ns}{racy}"
    if isinstance(version, (tuple, list)):
        return "(" + ",".join(_token(v, depth + 1) for v in version) + ")"
    raise _not_a_version(version)


def _not_a_version(version: object) -> UnsupportedDataError:
    shown = repr(version)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return UnsupportedDataError(
        f"cache() version {shown} ({type(version).__name__}) is not a version: pass a str, an "
        "int, a file path (its size and modification time are the version) or a tuple of those"
    )


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
            _write(path, _record_of(exc), layout.file_mode)
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


def _write(path: os.PathLike[str], record: dict[str, Any], mode: int) -> None:
    """Write ``record`` whole: a reader sees the old record or the new one."""
    staging = f"{os.fspath(path)}.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "w") as fp:
            json.dump(record, fp)
        os.replace(staging, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(staging)
        raise
