"""One exception hierarchy for shmcache.

Every error derives from :class:`ShmCacheError` and also from the built-in that an
existing ``except`` clause would expect (``KeyError``, ``ValueError``, ``OSError``...).
Each is constructible from its message alone, so PyTorch can re-raise a DataLoader
worker's exception in the main process as ``type(exc)(message)``, and the HTTP client
can turn a daemon's ``{"error": <class name>, "detail": <message>}`` back into the class.

The tree (built-in bases in brackets)::

    ShmCacheError
    ├── KeyNotFoundError            [KeyError]          no entry under the key
    ├── KeyExistsError              [FileExistsError]   put without overwrite
    ├── InvalidKeyError             [ValueError]        not a valid key
    ├── UnsupportedDataError        [TypeError]         object dtypes, wrong entry kind...
    ├── CacheFullError              [OSError]           tmpfs or budget has no room
    │   ├── NoRoomError                                 not even evicting makes room in the budget
    │   └── QuotaExceededError                          a team member's byte quota has no room
    ├── TooManyOpenFilesError       [OSError]           the descriptor limit is exhausted
    ├── MappingRefusedError         [MemoryError]       the kernel refused a private mapping
    ├── LockTimeoutError            [TimeoutError]      another process holds a lock too long
    ├── GPUUnavailableError         [RuntimeError]      CUDA (or read-only host registration) is missing
    ├── CorruptEntryError           [ValueError]        a published entry was damaged
    ├── CacheRootError              [PermissionError]   the root is unusable or not ours
    ├── TeamConfigError             [ValueError]        the teams file is malformed
    ├── UnknownTeamError            [LookupError]       no such team declared (or no teams file)
    ├── InvalidSourceError                              a source cannot be loaded
    │   ├── SourceNotFoundError     [FileNotFoundError]
    │   ├── CorruptSourceError      [ValueError]
    │   ├── SourceKindError         [ValueError]        put_file's as_ names no kind it makes
    │   └── SourceNotAllowedError   [PermissionError]   outside the daemon's --allow-source
    │   (control plane: raised by the daemon, re-raised by shmcache.client)
    ├── DaemonUnavailableError      [ConnectionError]   no daemon answers
    │   └── DaemonBusyError                             a team daemon had no write session for 10 min
    ├── DaemonRunningError          [RuntimeError]      another daemon serves the root
    ├── UntrustedDaemonError        [PermissionError]   another user listens on the daemon's socket
    ├── UnauthorizedError           [PermissionError]   missing or wrong TCP token
    ├── NotPermittedError           [PermissionError]   a team member acting on another's entry
    ├── InvalidRequestError         [ValueError]        the daemon could not parse a request
    ├── JobNotFoundError            [LookupError]
    ├── JobConflictError                                the key is being loaded from elsewhere
    ├── JobFinishedError                                nothing left to cancel
    └── JobCancelledError                               a load was cancelled; nothing published
"""

from __future__ import annotations

__all__ = [
    "CacheFullError",
    "CacheRootError",
    "CorruptEntryError",
    "CorruptSourceError",
    "DaemonBusyError",
    "DaemonRunningError",
    "DaemonUnavailableError",
    "GPUUnavailableError",
    "InvalidKeyError",
    "InvalidRequestError",
    "InvalidSourceError",
    "JobCancelledError",
    "JobConflictError",
    "JobFinishedError",
    "JobNotFoundError",
    "KeyExistsError",
    "KeyNotFoundError",
    "LockTimeoutError",
    "MappingRefusedError",
    "NoRoomError",
    "NotPermittedError",
    "QuotaExceededError",
    "ShmCacheError",
    "SourceKindError",
    "SourceNotAllowedError",
    "SourceNotFoundError",
    "TeamConfigError",
    "TooManyOpenFilesError",
    "UnauthorizedError",
    "UnknownTeamError",
    "UnsupportedDataError",
    "UntrustedDaemonError",
]


class ShmCacheError(Exception):
    """Base class of every error shmcache raises on purpose."""

    def __str__(self) -> str:
        # KeyError (and OSError with errno) would decorate the message; we want it verbatim.
        return str(self.args[0]) if self.args else ""


class KeyNotFoundError(ShmCacheError, KeyError):
    """No entry is published under the key (or the requested version is gone)."""


class KeyExistsError(ShmCacheError, FileExistsError):
    """An entry already exists under the key and ``overwrite`` was not given."""


class InvalidKeyError(ShmCacheError, ValueError):
    """The key is not a path of ``[A-Za-z0-9._-]+`` segments joined by ``/``."""


class UnsupportedDataError(ShmCacheError, TypeError):
    """The data cannot live in shared memory without pickling (object dtypes...)."""


class CacheFullError(ShmCacheError, OSError):
    """The tmpfs or the cache's byte budget has no room for the write."""


class NoRoomError(CacheFullError):
    """Evicting cannot make room within the budget: it stays exceeded with every entry that
    may go (neither pinned nor mapped) gone, so nothing was evicted for this request (a
    put that grows as it writes may have evicted for its earlier parts). A Parquet table
    whose row groups say it cannot fit is refused so before its first batch, with every
    entry still there."""


class QuotaExceededError(CacheFullError):
    """A put would take a team member past their byte quota (``user_quota`` of the team):
    the message says "quota", the limit and the usage; nothing was written."""


class TooManyOpenFilesError(ShmCacheError, OSError):
    """The process ran out of file descriptors while attaching an entry."""


class MappingRefusedError(ShmCacheError, MemoryError):
    """The kernel refused the private copy-on-write mapping a writable tensor needs
    (strict overcommit, ``vm.overcommit_memory=2``, or ``RLIMIT_DATA``), or any mapping of
    an entry at all (``RLIMIT_AS``: no address space left in the process)."""


class GPUUnavailableError(ShmCacheError, RuntimeError):
    """A GPU function of ``shmcache.torch`` found no CUDA: a CPU-only PyTorch build, no
    usable device or driver, or (for ``cuda_view``) no read-only host registration.
    Never raised over HTTP: the daemon has no GPU functions."""


class LockTimeoutError(ShmCacheError, TimeoutError):
    """Waiting for another process's lock took longer than the timeout."""


class DaemonUnavailableError(ShmCacheError, ConnectionError):
    """The shmcache daemon is not reachable."""


class DaemonBusyError(DaemonUnavailableError):
    """A team's daemon served as many writes at once as it takes (in all, or from you)
    for as long as the caller waited: members' writes wait their turn, and this says the
    wait ran out."""


class DaemonRunningError(ShmCacheError, RuntimeError):
    """Another daemon already serves this root."""


class InvalidSourceError(ShmCacheError):
    """A source path given to ``put_file`` cannot be loaded."""


class SourceNotFoundError(InvalidSourceError, FileNotFoundError):
    """A source path given to ``put_file`` does not exist."""


class CorruptSourceError(InvalidSourceError, ValueError):
    """A source file is truncated, corrupt or not an ``.npy``/``.npz`` file."""


class SourceKindError(InvalidSourceError, ValueError):
    """``put_file``'s ``as_`` names no kind of entry it makes from the source: the message
    names the source and the kinds it takes (a ValueError, as the check raised before)."""


class CorruptEntryError(ShmCacheError, ValueError):
    """A published entry's files were damaged behind the cache's back."""


class CacheRootError(ShmCacheError, PermissionError):
    """The cache root is unusable: a symlink, another user's, writable by others, not a
    directory... (refused on reads as on writes: another user could have planted it)."""


class TeamConfigError(ShmCacheError, ValueError):
    """The administrator's teams file (``/etc/shmcache/teams.toml``) cannot be used as
    written: not TOML, a required field missing, an unknown group or account, a bad size."""


class UnknownTeamError(ShmCacheError, LookupError):
    """No team of that name is declared in the teams file (or there is no teams file)."""


class UnauthorizedError(ShmCacheError, PermissionError):
    """The daemon refused the request: a TCP client sent no token or the wrong one."""


# Errors of the control plane (daemon and client share these very classes).


class SourceNotAllowedError(InvalidSourceError, PermissionError):
    """The source (after resolving symlinks and ``..``) is outside the daemon's ``--allow-source``."""


class JobNotFoundError(ShmCacheError, LookupError):
    """No load job with that id (the daemon keeps the last 1000 finished jobs)."""


class JobConflictError(ShmCacheError):
    """Another load of the same key, from a different source, is queued or running."""


class JobFinishedError(ShmCacheError):
    """The job already finished; there is nothing to cancel."""


class JobCancelledError(ShmCacheError):
    """The load was cancelled (on request, or because the daemon stopped); nothing was published."""


class NotPermittedError(ShmCacheError, PermissionError):
    """A team daemon refused an operation to this member: e.g. evicting an entry another
    member loaded (only the team's ``admins`` may)."""


class UntrustedDaemonError(ShmCacheError, PermissionError):
    """The process listening on the daemon's socket is not the user whose daemon serves the
    root (its ``SO_PEERCRED`` says so): nothing was sent to it."""


class InvalidRequestError(ShmCacheError, ValueError):
    """The daemon could not parse the request (a client bug, or a daemon of another version)."""
