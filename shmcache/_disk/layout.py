"""The on-disk contract in one place: every path, file name, environment name and the key
encoding of a cache root. Change the format here and nowhere else.

::

    <root>/generation            change counters, one 8-byte slot each (see below)
    <root>/entries/<key>         symlink -> ../objects/<version>   ("/" in keys is "~")
    <root>/objects/<version>/    <name>.npy files + meta.json, immutable once published
    <root>/tmp/                  partial writes and the lock of each live writer
    <root>/locks/space.lock      the root's space-accounting lock
    <root>/locks/keys/           one lock per key (``<key>.lock``), apart from the root's own,
                                 and the key's last failed ``cache()`` load (``<key>.failed``)
    <root>/daemon.sock           the daemon's control socket (mode 0600)
    <root>/daemon.pid            the daemon's pid file (flocked while it runs)
    <root>/budget.json           the root's byte budget, honoured by every writer (absent: none)

The generation file holds ``GENERATION_SLOTS`` little-endian uint64 counters. Slot 0
changes on every publish or evict in the root (what the daemon's entry-list cache
watches); slot ``generation_slot(key)`` changes when that key (or another key hashed to
the same slot) is published or evicted, so a publish sends only that key's warm opens
back to the slow path.

``default_root`` is the one place that reads ``SHMCACHE_ROOT``; everything else takes an
explicit root.
"""

from __future__ import annotations

import logging
import os
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CacheRootError
from .trust import refuse_untrusted

__all__ = [
    "ARRAY_FILE",
    "BUDGET_NAME",
    "ENV_CONFIG",
    "ENV_PREFIX",
    "ENV_ROOT",
    "ENV_SOCKET",
    "ENV_TOKEN",
    "GENERATION_BYTES",
    "GENERATION_SLOTS",
    "META_FILE",
    "PID_NAME",
    "SHM_DIR",
    "SOCKET_NAME",
    "Layout",
    "decode_key",
    "default_root",
    "encode_key",
    "generation_slot",
    "object_path",
    "prepare_root",
    "read_version",
    "version_of_target",
]

ENV_PREFIX = "SHMCACHE_"
ENV_ROOT = f"{ENV_PREFIX}ROOT"
ENV_SOCKET = f"{ENV_PREFIX}SOCKET"
ENV_TOKEN = f"{ENV_PREFIX}TOKEN"
ENV_CONFIG = f"{ENV_PREFIX}CONFIG"
SHM_DIR = "/dev/shm"

SOCKET_NAME = "daemon.sock"
PID_NAME = "daemon.pid"
BUDGET_NAME = "budget.json"
META_FILE = "meta.json"
ARRAY_FILE = "data.npy"
"""The one file of an array entry (containers have one ``<name>.npy`` per part)."""

GENERATION_SLOTS = 1024
GENERATION_BYTES = 8 * GENERATION_SLOTS
_SEPARATOR_ON_DISK = "~"  # not a key character, so the mapping is one-to-one
_OBJECTS_TARGET = "../objects/"

logger = logging.getLogger(__name__)


def default_root() -> Path:
    """``$SHMCACHE_ROOT``, else ``/dev/shm/shmcache-<uid>`` (a temp dir if no ``/dev/shm``)."""
    configured = os.environ.get(ENV_ROOT)
    if configured:
        return Path(configured)
    name = f"shmcache-{os.getuid()}"
    if os.path.isdir(SHM_DIR):
        return Path(SHM_DIR) / name
    import tempfile  # deferred: a fallback few roots need (import time of the open path)

    fallback = Path(tempfile.gettempdir()) / name
    warnings.warn(
        f"{SHM_DIR} does not exist; caching in {fallback} instead, which may be on disk "
        f"rather than in memory. Set {ENV_ROOT} to a tmpfs directory to silence this.",
        RuntimeWarning,
        stacklevel=3,
    )
    return fallback


def encode_key(key: str) -> str:
    """File name of a (valid) key inside the flat ``entries/`` directory."""
    return key.replace("/", _SEPARATOR_ON_DISK)


def decode_key(name: str) -> str:
    """Inverse of :func:`encode_key`."""
    return name.replace(_SEPARATOR_ON_DISK, "/")


def generation_slot(key: str) -> int:
    """The generation slot (1..SLOTS-1) of a key: stable across processes (CRC-32, not
    ``hash()``, which is salted per process)."""
    return 1 + zlib.crc32(key.encode("utf-8", "surrogatepass")) % (GENERATION_SLOTS - 1)


def object_path(root: str, version: str, filename: str) -> str:
    """A published file of a version (string formatting only: it is on the attach hot path)."""
    return f"{root}/objects/{version}/{filename}"


def version_of_target(target: str) -> str:
    """The version an entry link's target names (``../objects/<version>``)."""
    return target.rpartition("/")[2]


def read_version(link: str | os.PathLike[str]) -> str | None:
    """The version an entry link points at, or None if there is no such link."""
    try:
        return os.readlink(link).rpartition("/")[2]
    except (OSError, ValueError):  # missing, or a name no key could have (NUL, too long)
        return None


@dataclass(frozen=True)
class Layout:
    """Paths inside one cache root."""

    root: Path
    _entries_prefix: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The prefix of every entry link, formatted once: entry_link is on the open path.
        object.__setattr__(self, "_entries_prefix", f"{self.root}/entries/")

    @property
    def entries(self) -> Path:
        return self.root / "entries"

    @property
    def objects(self) -> Path:
        return self.root / "objects"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def locks(self) -> Path:
        return self.root / "locks"

    @property
    def generation(self) -> Path:
        return self.root / "generation"

    @property
    def socket(self) -> Path:
        """Where ``shmcache serve`` listens by default."""
        return self.root / SOCKET_NAME

    @property
    def pid_file(self) -> Path:
        return self.root / PID_NAME

    @property
    def budget(self) -> Path:
        """The root's budget record (JSON), replaced whole by ``rename``."""
        return self.root / BUDGET_NAME

    @property
    def key_locks(self) -> Path:
        """Where per-key locks live: a namespace of their own, so that no key (``space``...)
        can share a lock file with the root's own locks."""
        return self.locks / "keys"

    def directories(self) -> tuple[Path, ...]:
        return (self.root, self.entries, self.objects, self.tmp, self.locks, self.key_locks)

    def entry_link(self, key: str) -> str:
        """The symlink of a (valid) key (a ``str``: it is on the open hot path)."""
        return self._entries_prefix + key.replace("/", _SEPARATOR_ON_DISK)

    def names_under(self, prefix: str) -> list[str]:
        """The keys under ``prefix`` (a group), relative to it and sorted: ``["x"]`` for
        ``prefix/x``. Empty when there are none or no root yet."""
        start = encode_key(prefix + "/")
        try:
            listed = os.listdir(self.entries)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except PermissionError as exc:  # another user's root
            raise CacheRootError(f"cannot read cache root {self.root}: {exc.strerror}") from exc
        return sorted(decode_key(name[len(start) :]) for name in listed if name.startswith(start))

    def link_target(self, version: str) -> str:
        """What an entry link to ``version`` contains (relative, so the root can move)."""
        return f"{_OBJECTS_TARGET}{version}"

    def version_dir(self, version: str) -> Path:
        return self.objects / version

    def object_file(self, version: str, filename: str) -> str:
        """A published file of a version (a ``str``: it is on the attach hot path)."""
        return object_path(str(self.root), version, filename)

    def key_lock(self, key: str) -> Path:
        return self.key_locks / f"{encode_key(key)}.lock"

    def key_failure(self, key: str) -> Path:
        """The record of the key's last failed ``cache()`` load (JSON), for the callers
        that waited for it."""
        return self.key_locks / f"{encode_key(key)}.failed"

    @property
    def space_lock(self) -> Path:
        return self.locks / "space.lock"


def _mkdir_private(path: Path, what: str) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise CacheRootError(f"cannot create {what} {path}: {exc.strerror}") from exc
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise CacheRootError(f"cannot use {what} {path}: {exc.strerror}") from exc
    refuse_untrusted(path, st, what)  # a symlink, another user's, or writable by others


def prepare_root(root: Path) -> Layout:
    """Create the root and its sub-directories (mode 0700) if needed; return the layout.

    Refuses (``CacheRootError``) a root or sub-directory that is a symlink, another
    user's, or writable by others (``trust``)."""
    layout = Layout(root)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheRootError(f"cannot create the parent of cache root {root}: {exc.strerror}") from exc
    for directory in layout.directories():
        _mkdir_private(directory, "cache root" if directory == root else "cache directory")
    _prepare_generation(layout)
    return layout


def _prepare_generation(layout: Layout) -> None:
    """Create the generation file whole (never seen short), or grow one written by an
    older version (8 bytes: slot 0 only) to the full table."""
    try:
        size = os.stat(layout.generation).st_size
    except FileNotFoundError:
        staging = layout.root / f".generation.{os.getpid()}.{os.urandom(4).hex()}"
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.pwrite(fd, os.urandom(GENERATION_BYTES), 0)
        finally:
            os.close(fd)
        try:
            os.link(staging, layout.generation)  # fails if another process won the race
        except FileExistsError:
            pass
        finally:
            os.unlink(staging)
        return
    if size < GENERATION_BYTES:
        os.truncate(layout.generation, GENERATION_BYTES)  # new slots start at 0
