"""shmcache: datasets loaded once into shared memory, opened by every process in microseconds.

Data plane: entries are ``.npy`` files under a tmpfs root, opened read-only with
``mmap`` by any process without talking to a daemon. See README.md.
"""

from __future__ import annotations

from importlib import import_module as _import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any

    from ._api import (
        cache,
        cache_remote,
        cleanup,
        evict,
        get_budget,
        get_store,
        list_entries,
        open,
        open_array,
        open_blobs,
        open_group,
        open_mapping,
        open_ragged,
        open_records,
        open_strings,
        open_table,
        put_array,
        put_blobs,
        put_file,
        put_mapping,
        put_ragged,
        put_records,
        put_strings,
        put_table,
        set_budget,
        share,
        stats,
    )
    from ._containers.group import SharedGroup
    from ._containers.shared import SharedBlobs, SharedMapping, SharedRagged, SharedRecords, SharedStrings
    from ._containers.table import SharedTable
    from ._disk.keys import MAX_KEY_LENGTH, validate_key
    from ._disk.layout import default_root
    from ._disk.procmaps import MappingScan
    from ._store import EntryInfo, PlannedEntry, Store, StoreStats
    from .errors import (
        CacheFullError,
        CacheRootError,
        CorruptEntryError,
        CorruptSourceError,
        DaemonBusyError,
        DaemonRunningError,
        DaemonUnavailableError,
        GPUUnavailableError,
        InvalidKeyError,
        InvalidRequestError,
        InvalidSourceError,
        JobCancelledError,
        JobConflictError,
        JobFinishedError,
        JobNotFoundError,
        KeyExistsError,
        KeyNotFoundError,
        LockTimeoutError,
        MappingRefusedError,
        NoRoomError,
        NotPermittedError,
        QuotaExceededError,
        ShmCacheError,
        SourceKindError,
        SourceNotAllowedError,
        SourceNotFoundError,
        TeamConfigError,
        TooManyOpenFilesError,
        UnauthorizedError,
        UnknownTeamError,
        UnsupportedDataError,
    )

__version__ = "0.1.0"

__all__ = [
    "MAX_KEY_LENGTH",
    "CacheFullError",
    "CacheRootError",
    "CorruptEntryError",
    "CorruptSourceError",
    "DaemonBusyError",
    "DaemonRunningError",
    "DaemonUnavailableError",
    "EntryInfo",
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
    "MappingScan",
    "NoRoomError",
    "NotPermittedError",
    "PlannedEntry",
    "QuotaExceededError",
    "SharedBlobs",
    "SharedGroup",
    "SharedMapping",
    "SharedRagged",
    "SharedRecords",
    "SharedStrings",
    "SharedTable",
    "ShmCacheError",
    "SourceKindError",
    "SourceNotAllowedError",
    "SourceNotFoundError",
    "Store",
    "StoreStats",
    "TeamConfigError",
    "TooManyOpenFilesError",
    "UnauthorizedError",
    "UnknownTeamError",
    "UnsupportedDataError",
    "UntrustedDaemonError",
    "__version__",
    "cache",
    "cache_remote",
    "cleanup",
    "default_root",
    "evict",
    "get_budget",
    "get_store",
    "list_entries",
    "open",
    "open_array",
    "open_blobs",
    "open_group",
    "open_mapping",
    "open_ragged",
    "open_records",
    "open_strings",
    "open_table",
    "put_array",
    "put_blobs",
    "put_file",
    "put_mapping",
    "put_ragged",
    "put_records",
    "put_strings",
    "put_table",
    "set_budget",
    "share",
    "stats",
    "validate_key",
]


# Where each public name lives, imported on first use (PEP 562): `import shmcache` loads
# this file alone, and a spawned worker pays only for what it touches. Add a new public
# name here and to `__all__` (and to the TYPE_CHECKING imports above, for type checkers).
_HOMES: dict[str, str] = {
    "cache": "._api",
    "cache_remote": "._api",
    "cleanup": "._api",
    "evict": "._api",
    "get_budget": "._api",
    "get_store": "._api",
    "list_entries": "._api",
    "open": "._api",
    "open_array": "._api",
    "open_blobs": "._api",
    "open_group": "._api",
    "open_mapping": "._api",
    "open_ragged": "._api",
    "open_records": "._api",
    "open_strings": "._api",
    "open_table": "._api",
    "put_array": "._api",
    "put_blobs": "._api",
    "put_file": "._api",
    "put_mapping": "._api",
    "put_ragged": "._api",
    "put_records": "._api",
    "put_strings": "._api",
    "put_table": "._api",
    "set_budget": "._api",
    "share": "._api",
    "stats": "._api",
    "SharedBlobs": "._containers.shared",
    "SharedGroup": "._containers.group",
    "SharedMapping": "._containers.shared",
    "SharedRagged": "._containers.shared",
    "SharedRecords": "._containers.shared",
    "SharedStrings": "._containers.shared",
    "SharedTable": "._containers.table",
    "MAX_KEY_LENGTH": "._disk.keys",
    "validate_key": "._disk.keys",
    "default_root": "._disk.layout",
    "MappingScan": "._disk.procmaps",
    "EntryInfo": "._store",
    "PlannedEntry": "._store",
    "Store": "._store",
    "StoreStats": "._store",
    "CacheFullError": ".errors",
    "CacheRootError": ".errors",
    "CorruptEntryError": ".errors",
    "CorruptSourceError": ".errors",
    "DaemonRunningError": ".errors",
    "DaemonBusyError": ".errors",
    "DaemonUnavailableError": ".errors",
    "GPUUnavailableError": ".errors",
    "InvalidKeyError": ".errors",
    "InvalidRequestError": ".errors",
    "InvalidSourceError": ".errors",
    "JobCancelledError": ".errors",
    "JobConflictError": ".errors",
    "JobFinishedError": ".errors",
    "JobNotFoundError": ".errors",
    "KeyExistsError": ".errors",
    "KeyNotFoundError": ".errors",
    "LockTimeoutError": ".errors",
    "MappingRefusedError": ".errors",
    "NotPermittedError": ".errors",
    "NoRoomError": ".errors",
    "QuotaExceededError": ".errors",
    "ShmCacheError": ".errors",
    "SourceKindError": ".errors",
    "SourceNotAllowedError": ".errors",
    "SourceNotFoundError": ".errors",
    "TeamConfigError": ".errors",
    "TooManyOpenFilesError": ".errors",
    "UnauthorizedError": ".errors",
    "UnknownTeamError": ".errors",
    "UnsupportedDataError": ".errors",
    "UntrustedDaemonError": ".errors",
}


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first access, then keep it bound here."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
