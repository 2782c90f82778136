"""shmcache: datasets loaded once into shared memory, opened by every process in microseconds.

Data plane: entries are ``.npy`` files under a tmpfs root, opened read-only with
``mmap`` by any process without talking to a daemon. See README.md.
"""

from __future__ import annotations

from ._api import (
    cache,
    cleanup,
    evict,
    get_store,
    list_entries,
    open,
    open_array,
    open_group,
    open_mapping,
    open_ragged,
    open_records,
    open_strings,
    put_array,
    put_file,
    put_mapping,
    put_ragged,
    put_records,
    put_strings,
    share,
    stats,
)
from ._api import open_table, put_table
from ._containers.group import SharedGroup
from ._containers.shared import SharedMapping, SharedRagged, SharedRecords, SharedStrings
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
    DaemonRunningError,
    DaemonUnavailableError,
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
    ShmCacheError,
    SourceNotAllowedError,
    SourceNotFoundError,
    TooManyOpenFilesError,
    UnauthorizedError,
    UnsupportedDataError,
)

__version__ = "0.1.0"

__all__ = [
    "MAX_KEY_LENGTH",
    "CacheFullError",
    "CacheRootError",
    "CorruptEntryError",
    "CorruptSourceError",
    "DaemonRunningError",
    "DaemonUnavailableError",
    "EntryInfo",
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
    "MappingScan",
    "PlannedEntry",
    "SharedGroup",
    "SharedMapping",
    "SharedRagged",
    "SharedRecords",
    "SharedStrings",
    "ShmCacheError",
    "SourceNotAllowedError",
    "SourceNotFoundError",
    "Store",
    "StoreStats",
    "TooManyOpenFilesError",
    "UnauthorizedError",
    "UnsupportedDataError",
    "__version__",
    "cache",
    "cleanup",
    "default_root",
    "evict",
    "get_store",
    "list_entries",
    "open",
    "open_array",
    "open_group",
    "open_mapping",
    "open_ragged",
    "open_records",
    "open_strings",
    "put_array",
    "put_file",
    "put_mapping",
    "put_ragged",
    "put_records",
    "put_strings",
    "share",
    "stats",
    "validate_key",
    "SharedTable",
    "open_table",
    "put_table",
]
