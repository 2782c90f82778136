"""Module-level functions over a per-process :class:`Store` for each root.

``root=None`` means the default root (``$SHMCACHE_ROOT`` or ``/dev/shm/shmcache-<uid>``).
``team="vision"`` (or ``$SHMCACHE_TEAM`` without a root) means that team's root, as the
administrator's teams file declares it (``docs/team.md``); not with ``root``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ._disk.layout import ENV_ROOT, ENV_TEAM, ENV_TEAMS_FILE, Layout, default_root
from ._store.reading import Reader, reader_of
from ._store.timeouts import STORE_TIMEOUT, StoreTimeout
from ._team.config import team_of

if TYPE_CHECKING:  # the open path of a fresh process imports what reading needs, no more
    from ._containers.group import SharedGroup
    from ._containers.shared import SharedBlobs, SharedMapping, SharedRagged, SharedRecords, SharedStrings
    from ._containers.table import SharedTable
    from ._store.member_writes import MemberWriter
    from ._store.records import EntryInfo, StoreStats
    from ._store.store import Store

Root = str | os.PathLike[str] | None

__all__ = [
    "cache",
    "cache_remote",
    "cleanup",
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
]

_stores: dict[str | None, Store] = {}
_default_by_env: dict[str | None, Store] = {}
_teams: dict[tuple[str, str | None], Store] = {}
_members: dict[Path, MemberWriter] = {}
_ENVIRON_DATA = getattr(os.environ, "_data", None)
"""CPython's bytes-keyed dict behind ``os.environ`` (kept in step with it): looking up a
missing name there costs a dict miss, where ``os.environ.get`` raises and catches a
KeyError (about 0.5 us, on every default-root open_array)."""
_TEAM_KEY = os.fsencode(ENV_TEAM)
_readers: dict[str, Reader] = {}
_default_readers: dict[str | None, Reader] = {}


def _team_variable_set() -> bool:
    if isinstance(_ENVIRON_DATA, dict):
        return bool(_ENVIRON_DATA.get(_TEAM_KEY))
    return bool(os.environ.get(ENV_TEAM))  # pragma: no cover - another interpreter


def get_store(root: str | os.PathLike[str] | None = None, *, team: str | None = None) -> Store:
    """The shared per-process store of ``root`` (so attachments are reused), or of
    ``team`` (``$SHMCACHE_TEAM`` when neither is given)."""
    if team is not None or (root is None and _team_variable_set()):
        team = team_of(root, team)  # refuses both a root and a team
        assert team is not None
        known = (team, os.environ.get(ENV_TEAMS_FILE))
        store = _teams.get(known)
        if store is None:
            from ._store.store import Store

            store = _teams.setdefault(known, Store(team=team))
        return store
    if root is None:
        env = os.environ.get(ENV_ROOT)
        store = _default_by_env.get(env)
        if store is None:
            store = _default_by_env[env] = get_store(default_root())
        return store
    name = os.fspath(root)
    store = _stores.get(name)
    if store is None:
        from ._store.store import Store  # the write side: loaded by the first call that needs it

        store = Store(name)
        store = _stores.setdefault(str(store.root), store)
        store._share_reader(_reader(store.root))
        _stores[name] = store
    return store


def _reader(root: Root, team: str | None = None) -> Reader:
    """The per-process reader of ``root`` (the one ``get_store(root)`` uses too): opens
    need neither the store nor its write side. A team's root is read through its store,
    which resolves it through the teams file only."""
    if team is not None or (root is None and _team_variable_set()):
        return get_store(root, team=team)._reader
    if root is None:
        env = os.environ.get(ENV_ROOT)
        reader = _default_readers.get(env)
        if reader is None:
            reader = _default_readers[env] = _reader(default_root())
        return reader
    name = os.fspath(root)
    reader = _readers.get(name)
    if reader is None:
        reader = _readers[name] = reader_of(Layout(Path(os.path.abspath(name))))
    return reader


def open_array(key: str, *, root: Root = None, team: str | None = None, raw: bool = False) -> np.ndarray:
    """Read-only array over the shared entry ``key`` (pickles by reference).

    The mapping is copy-on-write: an in-place write through ``torch.from_numpy`` of it
    (torch ignores numpy's read-only flag) copies the touched pages into this process,
    where this array shows them too; other processes and the cache keep the original.
    For tensors use ``shmcache.torch.as_tensor(key)``: the same shared pages, with
    writes private to the tensor.

    A bfloat16/float8 entry comes as an ``ml_dtypes`` array (the ``ml_dtypes`` extra);
    ``raw=True`` gives its raw bits (uint16/uint8) with or without it.
    """
    if raw:
        return _reader(root, team).open_array(key, raw=True)
    return _reader(root, team).open_array(key)


def put_array(
    key: str,
    array: Any,
    *,
    root: str | os.PathLike[str] | None = None,
    team: str | None = None,
    overwrite: bool = False,
    pin: bool = False,
) -> EntryInfo:
    """Publish ``array`` under ``key`` atomically (into a team's root through its daemon:
    the member writes the bytes once, into the file the daemon made)."""
    return _writer(root, team).put_array(key, array, overwrite=overwrite, pin=pin)


def put_file(
    key: str,
    path: str | os.PathLike[str],
    *,
    root: str | os.PathLike[str] | None = None,
    team: str | None = None,
    overwrite: bool = False,
    pin: bool = False,
    as_: str = "auto",
    storage_options: Mapping[str, Any] | None = None,
    dtype: Any = None,
) -> list[str]:
    """Publish a ``.npy``, ``.npz``, ``.safetensors``, torch ``.pt``/``.pth`` state dict,
    ``.h5``/``.hdf5`` or a directory of them; returns the keys. A directory of other files
    (or any directory with ``as_="blobs"``) becomes one blobs entry. ``path`` may be an
    fsspec URL (``s3://bucket/prefix/``...), with ``storage_options`` for its filesystem.
    ``dtype`` (e.g. ``"uint16"``): a raw token file as one 1-D array; a Megatron ``.bin``/
    ``.idx`` pair: a ragged entry of its documents.

    With ``team``, this process reads the file (a file only you can read is fine) and
    fills the entry's file the team's daemon made; the daemon never opens your path."""
    store, member = _writers(root, team)
    if member is not None:
        return member.put_file(key, path, overwrite=overwrite, pin=pin, as_=as_, dtype=dtype)
    return store.put_file(
        key, path, overwrite=overwrite, pin=pin, as_=as_, storage_options=storage_options, dtype=dtype
    )


def cache(
    key: str,
    loader: Callable[[], Any],
    *,
    version: Any = None,
    root: str | os.PathLike[str] | None = None,
    team: str | None = None,
    timeout: float | StoreTimeout | None = STORE_TIMEOUT,
) -> np.ndarray:
    """Get-or-create ``key``: ``loader`` runs once across all processes. ``version`` (a str,
    an int, a file path or a tuple of those) is recorded: another version loads again.
    In a team's root the daemon holds the key's lock for the member who loads; the others
    wait, then open its entry."""
    store, member = _writers(root, team)
    if member is not None:
        from ._store.loading import cache_version_token

        wanted = None if version is None else cache_version_token(version)
        return member.cache(key, loader, store.open_array, wanted)
    return store.cache(key, loader, version=version, timeout=timeout)


def cache_remote(
    key: str,
    url: str,
    *,
    root: str | os.PathLike[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    timeout: float | StoreTimeout | None = STORE_TIMEOUT,
) -> np.ndarray | SharedGroup | SharedTable:
    """Get-or-create ``key`` from ``url``: one download per machine (every rank of a node
    may call it), then an array (one ``.npy`` or token object), a table (table objects) or
    a group (a checkpoint's tensors, an archive's members, a prefix)."""
    return get_store(root).cache_remote(key, url, storage_options=storage_options, timeout=timeout)


def evict(key: str, *, root: str | os.PathLike[str] | None = None, team: str | None = None) -> int:
    """Remove ``key``; readers that mapped it keep their version. In a team's root, through
    its daemon, and only your own entries (the team's admins: any)."""
    return _writer(root, team).evict(key)


def list_entries(
    prefix: str | None = None, *, root: Root = None, team: str | None = None
) -> list[EntryInfo]:
    """Entries under ``prefix`` (all when None)."""
    return get_store(root, team=team).list(prefix)


def stats(*, root: Root = None, team: str | None = None) -> StoreStats:
    """Capacity, use, budget and entry count of the cache root."""
    return get_store(root, team=team).stats()


def get_budget(*, root: Root = None) -> int | None:
    """The root's byte budget (None: none), as every writer of the root keeps it."""
    return get_store(root).budget


def set_budget(max_bytes: int | str | None, *, root: Root = None) -> None:
    """Record the root's byte budget (bytes or ``"100GiB"``; None removes it): every writer
    of the root keeps it from now on (see :meth:`Store.set_budget`)."""
    get_store(root).set_budget(max_bytes)


def cleanup(*, root: str | os.PathLike[str] | None = None) -> int:
    """Remove partial writes and orphans of dead writers; returns bytes freed."""
    return get_store(root).cleanup()


def open(key: str, *, root: Root = None, team: str | None = None) -> Any:
    """Open an entry of any kind (array, strings, ragged, records or mapping)."""
    return _reader(root, team).open(key)


def put_strings(
    key: str,
    strings: Iterable[str],
    *,
    root: Root = None,
    team: str | None = None,
    overwrite: bool = False,
    pin: bool = False,
) -> EntryInfo:
    """Publish a list of ``str``; ``open_strings(key)[i]`` gives them back."""
    return _writer(root, team).put_strings(key, strings, overwrite=overwrite, pin=pin)


def open_strings(key: str, *, root: Root = None, team: str | None = None) -> SharedStrings:
    """Read-only ``Sequence[str]`` (with hash ``index``/``in``) over shared memory."""
    return _reader(root, team).open(key, "strings")  # type: ignore[no-any-return]


def put_ragged(
    key: str,
    arrays: Iterable[Any],
    *,
    root: Root = None,
    team: str | None = None,
    overwrite: bool = False,
    pin: bool = False,
) -> EntryInfo:
    """Publish arrays of one dtype with varying first dimension (boxes per image...)."""
    return _writer(root, team).put_ragged(key, arrays, overwrite=overwrite, pin=pin)


def open_ragged(key: str, *, root: Root = None, team: str | None = None) -> SharedRagged:
    """Read-only sequence of read-only array views over shared memory."""
    return _reader(root, team).open(key, "ragged")  # type: ignore[no-any-return]


def put_records(
    key: str,
    records: Iterable[Any],
    *,
    root: Root = None, team: str | None = None,
    overwrite: bool = False,
    pin: bool = False,
    allow_nan: bool = False,
) -> EntryInfo:
    """Publish JSON-compatible records (annotation dicts)."""
    return _writer(root, team).put_records(key, records, overwrite=overwrite, pin=pin, allow_nan=allow_nan)


def open_records(key: str, *, root: Root = None, team: str | None = None) -> SharedRecords:
    """Read-only sequence whose items are decoded fresh on every access."""
    return _reader(root, team).open(key, "records")  # type: ignore[no-any-return]


def put_mapping(
    key: str,
    mapping: Mapping[str,
    Any],
    *,
    root: Root = None,
    team: str | None = None,
    overwrite: bool = False,
    pin: bool = False,
) -> EntryInfo:
    """Publish a ``dict`` from str to arrays/numbers, str, or records."""
    return _writer(root, team).put_mapping(key, mapping, overwrite=overwrite, pin=pin)


def open_mapping(key: str, *, root: Root = None, team: str | None = None) -> SharedMapping:
    """Read-only ``Mapping[str, X]`` with hash lookup in shared memory."""
    return _reader(root, team).open(key, "mapping")  # type: ignore[no-any-return]


def open_group(prefix: str, *, root: Root = None, team: str | None = None) -> SharedGroup:
    """Lazy read-only ``Mapping`` of the entries under ``prefix`` (e.g. a put directory)."""
    return get_store(root, team=team).open_group(prefix)


def share(key: str, obj: Any, *, root: Root = None, team: str | None = None, overwrite: bool = False) -> Any:
    """Put ``obj`` in the shared form that fits it (reusing identical content) and open it;
    other content under ``key`` is a ``KeyExistsError`` unless ``overwrite=True``.

    The one-line fix for a Dataset's big lists and dicts::

        self.paths = shmcache.share("paths", self.paths)
    """
    store, member = _writers(root, team)
    if member is not None:
        member.share(key, obj, overwrite=overwrite)
        return store.open(key)
    return store.share(key, obj, overwrite=overwrite)


def put_blobs(
    key: str,
    source: str | os.PathLike[str] | Iterable[str | os.PathLike[str]] | Mapping[str, Any],
    *,
    root: Root = None,
    overwrite: bool = False,
    pin: bool = False,
) -> EntryInfo:
    """Publish many files (a directory, an iterable of paths) or byte strings (a mapping
    name -> bytes-like) as one entry: images, audio, any encoded files."""
    return get_store(root).put_blobs(key, source, overwrite=overwrite, pin=pin)


def open_blobs(key: str, *, root: Root = None, team: str | None = None) -> SharedBlobs:
    """Read-only blobs: ``blobs[i]`` or ``blobs["dir/name.jpg"]`` is a zero-copy uint8 view."""
    return _reader(root, team).open(key, "blobs")  # type: ignore[no-any-return]
def put_table(
    key: str,
    data: Any,
    *,
    root: Root = None,
    team: str | None = None,
    overwrite: bool = False,
    pin: bool = False,
) -> EntryInfo:
    """Publish a table (pyarrow Table, DataFrame, dict of columns, list of dicts, or a
    .parquet/.feather/.arrow/.csv/.jsonl path); ``open_table(key)`` gives it back."""
    return _writer(root, team).put_table(key, data, overwrite=overwrite, pin=pin)


def open_table(key: str, *, root: Root = None, team: str | None = None) -> SharedTable:
    """Read-only table: ``table[i]`` a fresh dict, ``column(name)`` zero-copy, ``to_arrow()``."""
    return _reader(root, team).open(key, "table")  # type: ignore[no-any-return]


def _writer(root: Root, team: str | None) -> Store | MemberWriter:
    """Who writes into the root, for the calls both writers take alike (see :func:`_writers`)."""
    store, member = _writers(root, team)
    return store if member is None else member


def _writers(root: Root, team: str | None) -> tuple[Store, MemberWriter | None]:
    """The root's store and who writes into it: None for this process (a personal root),
    or, for a team's root (``team``, or ``$SHMCACHE_TEAM`` without a root), the writer
    through its daemon, with this process filling the files it makes."""
    store = get_store(root, team=team)
    if store.team is None:
        return store, None
    member = _members.get(store.root)
    if member is None:
        from ._store.member_writes import MemberWriter  # write side: on first use

        member = _members.setdefault(store.root, MemberWriter(store.root, team=store.team))
    return store, member
