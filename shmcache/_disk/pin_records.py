"""Which processes pinned which entries with CUDA: one small file per process per root,
``<root>/pins/<pid>``, flocked for as long as the process lives.

``shmcache.torch.pin`` keeps a ``MAP_SHARED`` mapping of the entry (so the budget, which
never evicts a mapped entry, keeps it), but a mapping does not say that CUDA registered
it: this record does, for ``ls``, ``top`` and ``doctor``. The lock is the liveness test,
not the pid (pids are reused): a record whose lock can be taken belongs to a process that
is gone, however it ended (``kill -9`` included), and the reader that finds it removes it.
``flock`` rather than ``fcntl`` byte-range locks: a ``fcntl`` lock is the process's, so
a reader in the same process would see it free, and closing any descriptor of the file
in the owner would drop it. A record is created under a temporary name, locked, then
renamed into place, so no reader sees it unlocked. Cheap: one small write per pin or
last release of an entry, and a directory listing per ``ls``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["PINS_DIR", "PinRecord", "PinnedEntry", "live_pins"]

PINS_DIR = "pins"
_RETRIES = 3  # a reader may catch a record between its truncation and its write


@dataclass(frozen=True)
class PinnedEntry:
    """One entry one process holds for CUDA."""

    version: str
    key: str
    registered: bool
    """False: mapped only, batches go through a pinned staging buffer (see ``error``)."""
    error: str = ""
    """Why it is not registered: a CUDA error name, or "" (registered, or no read-only
    registration on this GPU)."""


_OPEN: set[PinRecord] = set()
_OPEN_LOCK = threading.Lock()


def _forget_in_child() -> None:
    """A forked child shares its parent's locked file description: closing its copy of
    the descriptor keeps the parent's lock, and the child is not taken for the parent."""
    for record in list(_OPEN):
        with contextlib.suppress(OSError):
            os.close(record.fd)
        record.fd = -1
    _OPEN.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class PinRecord:
    """This process's record in one root's ``pins/`` directory (made on first write)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.directory = self.root / PINS_DIR
        self.path = self.directory / str(os.getpid())
        self.fd = -1
        self.pid = os.getpid()

    def _open(self) -> None:
        self.pid = os.getpid()
        self.path = self.directory / str(self.pid)
        with contextlib.suppress(FileExistsError):
            mode = os.stat(self.root).st_mode & 0o777
            self.directory.mkdir(mode=mode)
        if not stat.S_ISDIR(os.lstat(self.directory).st_mode):  # a symlink or a file: not ours
            raise NotADirectoryError(f"{self.directory} is not a directory")
        temporary = self.directory / f".{os.getpid()}.{threading.get_ident()}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)  # left by a namesake that died between create and rename
        flags = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR | os.O_CLOEXEC
        fd = os.open(temporary, flags, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(temporary, self.path)  # a dead namesake's record (pid reuse) is replaced
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        self.fd = fd
        with _OPEN_LOCK:
            _OPEN.add(self)

    def write(self, entries: list[PinnedEntry]) -> None:
        """Record ``entries`` (all this process holds in the root); none: remove the record."""
        if not entries:
            self.close()
            return
        if self.fd < 0:
            self._open()
        data = json.dumps({"pid": os.getpid(), "pins": [asdict(e) for e in entries]}).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def close(self) -> None:
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)
        self.fd = -1
        with _OPEN_LOCK:
            _OPEN.discard(self)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_temporary(path: Path) -> None:
    """A ``.<pid>.<thread>`` file left by a process that died between create and rename."""
    try:
        pid = int(path.name[1:].split(".")[0])
    except ValueError:
        return
    if not _alive(pid):
        with contextlib.suppress(OSError):
            os.unlink(path)


def _read_live(path: Path) -> list[PinnedEntry] | None:
    """The entries of a live process's record; None (and the record removed) if its
    process is gone, or if it cannot be read."""
    try:  # never follow a link, never block on a FIFO: only a plain file is a record
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: its process lives
            for attempt in range(_RETRIES):
                try:
                    found = json.loads(os.pread(fd, 1 << 20, 0))
                    return [PinnedEntry(**pin) for pin in found["pins"]]
                except (ValueError, KeyError, TypeError):
                    time.sleep(0.001 * (attempt + 1))  # caught between truncate and write
            return None
        except OSError:
            return None
        with contextlib.suppress(OSError):  # free: a dead process's record
            if os.stat(path).st_ino == os.fstat(fd).st_ino:  # not a new namesake's
                os.unlink(path)
        return None
    finally:
        os.close(fd)


def live_pins(root: str | os.PathLike[str]) -> dict[int, list[PinnedEntry]]:
    """pid -> what it holds for CUDA in ``root``, for live processes only (the records of
    dead ones are swept on the way)."""
    directory = Path(root) / PINS_DIR
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    found: dict[int, list[PinnedEntry]] = {}
    for name in names:
        path = directory / name
        if name.startswith("."):
            _sweep_temporary(path)
            continue
        if not name.isdigit():
            continue
        entries = _read_live(path)
        if entries:
            found[int(name)] = entries
    return found
