"""Where the cache lives: the default root and the layout inside it.

``default_root`` is the one place that reads ``SHMCACHE_ROOT``; everything else takes
an explicit root.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from .errors import CacheRootError

__all__ = ["ENV_ROOT", "Layout", "default_root", "prepare_root"]

ENV_ROOT = "SHMCACHE_ROOT"
SHM_DIR = "/dev/shm"

logger = logging.getLogger(__name__)


def default_root() -> Path:
    """``$SHMCACHE_ROOT``, else ``/dev/shm/shmcache-<uid>`` (a temp dir if no ``/dev/shm``)."""
    configured = os.environ.get(ENV_ROOT)
    if configured:
        return Path(configured)
    name = f"shmcache-{os.getuid()}"
    if os.path.isdir(SHM_DIR):
        return Path(SHM_DIR) / name
    fallback = Path(tempfile.gettempdir()) / name
    warnings.warn(
        f"{SHM_DIR} does not exist; caching in {fallback} instead, which may be on disk "
        f"rather than in memory. Set {ENV_ROOT} to a tmpfs directory to silence this.",
        RuntimeWarning,
        stacklevel=3,
    )
    return fallback


@dataclass(frozen=True)
class Layout:
    """Paths inside a cache root (see README, "On-disk layout")."""

    root: Path

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

    def directories(self) -> tuple[Path, ...]:
        return (self.root, self.entries, self.objects, self.tmp, self.locks)


def _mkdir_private(path: Path) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise CacheRootError(f"cannot create cache directory {path}: {exc.strerror}") from exc
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise CacheRootError(f"cannot use cache directory {path}: {exc.strerror}") from exc
    if stat.S_ISLNK(st.st_mode):
        raise CacheRootError(
            f"{path} is a symlink; shmcache does not follow symlinks in its root (someone "
            f"could plant one in /dev/shm): use the real path {os.path.realpath(path)}"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise CacheRootError(f"{path} exists but is not a directory; remove it or pick another root")
    if st.st_uid != os.geteuid():  # e.g. planted in world-writable /dev/shm; root included
        raise CacheRootError(
            f"cache directory {path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}); "
            "pick another root with root= or SHMCACHE_ROOT"
        )


def prepare_root(root: Path) -> Layout:
    """Create the root and its sub-directories (mode 0700) if needed; return the layout."""
    layout = Layout(root)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheRootError(f"cannot create the parent of cache root {root}: {exc.strerror}") from exc
    for directory in layout.directories():
        _mkdir_private(directory)
    if not layout.generation.exists():
        # Written whole under a temporary name, then linked in: never seen short.
        staging = layout.root / f".generation.{os.getpid()}.{os.urandom(4).hex()}"
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.pwrite(fd, os.urandom(8), 0)
        finally:
            os.close(fd)
        try:
            os.link(staging, layout.generation)  # fails if another process won the race
        except FileExistsError:
            pass
        finally:
            os.unlink(staging)
    return layout
