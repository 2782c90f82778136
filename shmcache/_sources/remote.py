"""Remote sources of ``put_file`` (``s3://``, ``gs://``, ``az://``, ``hf://``, ``http(s)://``)
through fsspec, streamed into the staging files: never a full local copy first.

Planning lists the objects (a URL ending in ``/``, or naming a prefix, is a directory:
``key/<relative name without .npy>``). Fetching splits every object into parts (default
:func:`auto_part_size`), read with ranged reads on a thread pool and written with ``pwrite``
at their offsets: a big object loads in parallel, many small ones concurrently, and the
process holds at most ``IN_FLIGHT_BYTES`` of parts at once. Each object's first part comes
first: its ``.npy`` header is validated like a local file's (no object dtypes, a size that
matches) before a byte is written, and the other parts wait for that. (``plan_file``, a dry
run, reads the headers alone with one ranged read each.) A trailing hasher per object
computes the CRC-32 recorded for ``verify`` and, where the store offers a plain-MD5 ETag,
the MD5, compared before publishing: bytes that match the ETag listed at the start are
that version, whole. Objects without one are looked up again after the fetch, and one
whose size or ETag changed fails the load (:class:`CorruptSourceError`). Nothing is
published unless every object passed.

Credentials come from each filesystem's own chain (environment, config files, instance
roles) or ``storage_options``; they never reach a message (every text from a backend is
scrubbed of them), a log line or ``meta.json`` (the recorded source is the redacted URL).
``.npz`` archives are refused: their members would need the whole archive's central
directory and inflation; unpack them into ``.npy`` objects (or download and put the file).
"""

from __future__ import annotations

import io
import os
import posixpath
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any
from urllib.parse import urlsplit

from .._disk.fs import full_is_cache_full
from .._disk.keys import validate_key
from .._disk.npy import NpyHeader, check_written_header, header_length, read_source_header
from .._disk.writer import VersionWriter
from ..errors import (
    CorruptEntryError,
    CorruptSourceError,
    InvalidSourceError,
    ShmCacheError,
    SourceNotFoundError,
)
from .remote_pairs import megatron_pair, pair_item
from .remote_parts import ByteBudget, TrailingHash, object_spans, pwrite_all, read_range, remote_errors
from .remote_plan import RemoteItem, RemotePlan
from .remote_plan import object_identity as _identity
from .remote_plan import object_md5 as _md5_of
from .tar_shards import expand_braces, is_shard_source
from .urls import BACKEND_EXTRAS, redact_url, scrub, secret_strings

__all__ = [
    "DEFAULT_PART_SIZE",
    "DEFAULT_WORKERS",
    "REMOTE_SUFFIXES",
    "RemoteItem",
    "RemotePlan",
    "auto_part_size",
    "check_objects_unchanged",
    "fetch_remote",
    "list_remote",
    "read_npy_headers",
    "remote_errors",
    "remote_identities",
    "remote_suffix",
]

DEFAULT_PART_SIZE = 8 << 20
"""Bytes per ranged read: big enough to amortise a request, small enough to bound memory."""
DEFAULT_WORKERS = 16
"""Ranged reads in flight at once (threads; fsspec's event loop does the I/O)."""
MAX_PART_SIZE = 64 << 20
"""The largest automatic part (a 1 GiB object: 16 parts of 64 MiB)."""
IN_FLIGHT_BYTES = 256 << 20
"""Bytes of parts being fetched at once, at most (a part bigger than this goes alone): what
bounds the loader's memory, whatever the objects' sizes."""
REMOTE_SUFFIXES = (".h5", ".hdf5", ".npy", ".npz", ".pt", ".pth", ".safetensors")
"""Object suffixes a remote put takes as arrays (a prefix collects these; ``.npy`` objects are
fetched whole, the others planned by ``remote_files``)."""
_HEAD = 4096  # the first read of every object: a numpy header is almost always shorter


def list_remote(
    key: str, url: str, storage_options: Mapping[str, Any] | None = None, dtype: Any = None, as_: str = "auto"
) -> RemotePlan:
    """The objects under ``url`` a put takes, from one listing: one item per object (``key``,
    or ``key/<relative name without suffix>`` under a prefix; of kind ``blob`` or ``shard``
    for a blobs entry), nothing read from them yet (``remote_files.plan_remote`` reads their
    headers and indexes)."""
    fs, shown, path, directory, objects, secrets = _objects(key, url, storage_options, dtype, as_)
    return RemotePlan(fs, shown, path, directory, objects, secrets)


def read_npy_headers(plan: RemotePlan, workers: int = DEFAULT_WORKERS) -> None:
    """Read and validate the header of every ``.npy`` object of ``plan`` not read yet (one
    ranged read each, in parallel): what a dry run checks."""
    unread = [item for item in plan.items if item.header is None]
    with ThreadPoolExecutor(max(1, min(workers, len(unread))), thread_name_prefix="shmcache-head") as pool:
        headers = pool.map(lambda it: _read_header(plan.fs, it, plan.secrets), unread)
        for item, header in zip(unread, headers, strict=True):
            item.header = header


def _objects(
    key: str, url: str, storage_options: Mapping[str, Any] | None, dtype: Any = None, as_: str = "auto"
) -> tuple[Any, str, str, bool, list[RemoteItem], list[str]]:
    """The filesystem, the redacted URL, the path, whether it is a prefix, and one item per
    object it takes (``key`` or ``key/<relative name without suffix>``), from one listing."""
    secrets = secret_strings(url, storage_options)
    shown = redact_url(url)
    fs, path = _filesystem(url, storage_options, secrets)
    with remote_errors(shown, secrets):
        fs.invalidate_cache()  # a listing cached by an earlier load would hide changes
        if dtype is None and as_ == "auto" and is_shard_source(urlsplit(url).path):
            return fs, shown, path, False, _shard_objects(fs, key, path, shown), secrets
        listing = {}
        directory = urlsplit(url).path.endswith("/")
        if directory:  # a prefix: one listing (no lookup of the prefix itself)
            listing = _list_objects(fs, path)
        if not listing:  # an object, or a prefix without a "/", or nothing (FileNotFoundError)
            try:
                info = fs.info(path)
            except FileNotFoundError:  # a Megatron pair named by its prefix, as Megatron does
                if dtype is None and (pair := megatron_pair(fs, path, shown, None)) is not None:
                    return fs, shown, path, False, [pair_item(key, pair)], secrets
                raise
            directory = info.get("type") == "directory"
            listing = _list_objects(fs, path) if directory else {path: info}
            if not directory and (pair := megatron_pair(fs, path, shown, info)) is not None:
                return fs, shown, path, False, [pair_item(key, pair)], secrets
    if dtype is not None and directory:
        raise InvalidSourceError(
            f"dtype= takes one raw token file (e.g. nanoGPT's train.bin); {shown} is a prefix: "
            "put each token file with its own key"
        )
    return fs, shown, path, directory, _items(key, shown, path, directory, listing, dtype, as_), secrets


def _shard_objects(fs: Any, key: str, path: str, shown: str) -> list[RemoteItem]:
    """The ``.tar`` objects a shard URL names: one, or a brace pattern's names in order, each
    glob's matches sorted (``tar_shards.shard_paths``' rules); a name that matches nothing is
    an error. Items of kind ``shard`` (``remote_blobs`` reads their member headers)."""
    literal = [i for i in (path.find(c) for c in "{*?[") if i >= 0]
    cut = min(literal, default=len(path))
    shown_cut = len(shown) - (len(path) - cut)  # the same literal text ends both
    found: dict[str, dict[str, Any]] = {}
    for name in expand_braces(path):
        if any(c in name for c in "*?["):
            matches = fs.glob(name, detail=True)
            if not matches:
                raise SourceNotFoundError(f"no tar shard matches {shown[:shown_cut]}{name[cut:]}")
            found |= {k: matches[k] for k in sorted(matches)}
        else:
            found[name] = fs.info(name)
    items = []
    for name, info in found.items():
        url = shown[:shown_cut] + name[cut:] if name.startswith(path[:cut]) else f"{shown[:shown_cut]}{name}"
        size = info.get("size")
        if not isinstance(size, int) or size < 0 or info.get("type", "file") != "file":
            raise InvalidSourceError(f"{url}: the server does not say how large it is; it cannot be streamed")
        md5 = _md5_of(info)
        items.append(RemoteItem(key, name, url, size, _identity(info), md5, kind="shard", suffix=".tar"))
    return items


def remote_suffix(name: str) -> str:
    """``name``'s suffix (lower case) as a remote put reads it."""
    return posixpath.splitext(name)[1].lower()


def auto_part_size(size: int, workers: int = DEFAULT_WORKERS) -> int:
    """Parts of ``DEFAULT_PART_SIZE`` to ``MAX_PART_SIZE``, as few as ``workers`` when they
    fit: a big object is read as parallel streams, each request large (a server that pays
    per request, or, like moto, copies the whole object for every range, pays least)."""
    return min(max(DEFAULT_PART_SIZE, -(-size // max(workers, 1))), MAX_PART_SIZE)


def remote_identities(
    url: str, storage_options: Mapping[str, Any] | None = None
) -> dict[str, tuple[int, str]]:
    """``{object URL (redacted): (size, identity)}`` of the ``.npy`` objects under ``url``,
    from one listing (no header read): whether loaded entries are still current."""
    objects = _objects("k", url, storage_options)[4]  # (no index read)
    return {item.url: (item.size, item.identity) for item in objects}


def fetch_remote(
    plan: RemotePlan,
    writer: VersionWriter,
    advance: Callable[[int], None],
    part_size: int | None = None,
    workers: int = DEFAULT_WORKERS,
) -> None:
    """Fetch every planned object into a new version of ``writer`` (sets ``item.version``,
    ``item.header`` and ``item.crc``); raises if a header is invalid, a part fails or an
    object changed meanwhile.

    Every object is split into parts over its size; the first part of each is fetched
    first, and its header validated before anything is written; the other parts wait for
    that (the pool runs tasks in order, so the first part is always already running).
    ``part_size`` None: :func:`auto_part_size` per object."""
    if part_size is not None and part_size < 1:
        raise ValueError(f"part_size must be at least 1 byte, got {part_size}")
    stop = threading.Event()
    progress_lock = threading.Lock()
    budget = ByteBudget(IN_FLIGHT_BYTES)

    def progressed(nbytes: int) -> None:
        with progress_lock:
            advance(nbytes)

    hashers: list[TrailingHash] = []
    for item in plan.items:
        item.version = writer.new_version()
        for name, array in item.files.items():  # from the index (a ragged entry's offsets)
            crc, written = writer.write_array(item.version, f"{name}.npy", array)
            item.written[name] = (written, crc)
        target = writer.path(item.version, item.file_name)
        fd = writer.create_file(item.version, item.file_name)
        try:
            if item.file_bytes:
                with full_is_cache_full(target):  # a full tmpfs is an error now, never mid-fetch
                    os.posix_fallocate(fd, 0, item.file_bytes)
        finally:
            os.close(fd)
        hashers.append(TrailingHash(target, item.md5 is not None and item.prefix is None))
        if item.prefix is not None:  # a range: its header is known from the object's index
            hashers[-1].size = item.file_bytes
            item.ready.set()
    by_object: dict[str, list[RemoteItem]] = {}  # byte ranges: read per object, not per item
    for item, hasher in zip(plan.items, hashers, strict=True):
        item.hasher = hasher
        if item.prefix is not None and item.decoder is None:
            _write_part(item, hasher, item.prefix, 0, len(item.prefix))  # the built header
            progressed(len(item.prefix))
            by_object.setdefault(item.path, []).append(item)
    spans = [
        span
        for items in by_object.values()
        for span in object_spans(items, lambda size: part_size or auto_part_size(size, workers))
    ]
    tasks = [
        (item, hasher, start, min(start + part, item.file_bytes))
        for item, hasher in zip(plan.items, hashers, strict=True)
        for part in [part_size or auto_part_size(item.file_bytes, workers)]
        for start in range(0, max(item.file_bytes, 1), part)
        if (item.decoder is None or start == 0) and (item.prefix is None or item.decoder is not None)
    ]  # a decoder writes the whole file from one task
    tasks = [
        (item, hasher, start, item.file_bytes if item.decoder is not None else end)
        for item, hasher, start, end in tasks
    ]

    def fetch_span(start: int, end: int, items: list[RemoteItem]) -> None:
        if not stop.is_set():
            with budget.holding(end - start):
                progressed(_fetch_span(plan, items, start, end))

    def fetch(item: RemoteItem, hasher: TrailingHash, start: int, end: int) -> None:
        if item.decoder is not None:
            _fetch_decoded(plan, item, hasher, budget, stop, progressed)
            return
        if start == 0:
            try:
                if stop.is_set():
                    return
                with budget.holding(end):
                    _fetch_first(plan, item, hasher, end)
            finally:
                item.ready.set()  # on failure or stop too: the other parts then return
        else:
            item.ready.wait()
            if stop.is_set() or item.header is None:
                return
            fetched = min(end, item.header.file_size)
            if start < fetched:  # (not a part of the tail beyond the array)
                with budget.holding(fetched - start):
                    if stop.is_set():
                        return
                    data = read_range(plan.fs, item, start, fetched, plan.secrets)
                    _write_part(item, hasher, data, start, fetched)
                    del data
        progressed(end - start)

    threads = max(1, min(workers, len(tasks) + len(spans)))
    with ThreadPoolExecutor(threads, thread_name_prefix="shmcache-fetch") as pool:
        futures: list[Future[None]] = [pool.submit(fetch, *task) for task in tasks]
        futures += [pool.submit(fetch_span, *span) for span in spans]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f.done() and f.exception() is not None), None)
            if failed is not None:
                raise failed.exception()  # type: ignore[misc]
        except BaseException:  # a part failed, or Ctrl+C here: the parts left return at once
            stop.set()
            for future in futures:
                future.cancel()
            raise
    unproven: list[RemoteItem] = []
    for item, hasher in zip(plan.items, hashers, strict=True):
        header = item.checked_header
        item.crc, md5 = hasher.result()
        if item.md5 is not None and item.prefix is None and header.file_size == item.size:
            if md5 != item.md5:
                raise CorruptSourceError(
                    f"{item.url}: the bytes read do not match the object's MD5 (it changed while "
                    "loading, or was damaged in transit); nothing was published, load it again"
                )
        else:
            unproven.append(item)
        if item.prefix is None and header.file_size < item.size:  # a tail beyond the array: not published
            os.truncate(hasher.path, header.file_size)
        check_written_header(hasher.path, item.checked_header, item.url)
    # Bytes whose MD5 is the ETag listed at the start are that version, whole: only the
    # other objects are looked up again.
    unproven += [item.companion for item in plan.items if item.companion is not None]
    if unproven:
        check_objects_unchanged(plan, unproven)


def _fetch_first(plan: RemotePlan, item: RemoteItem, hasher: TrailingHash, end: int) -> None:
    """Fetch an object's first part, validate its header (against the plan's, if read) and
    only then write the part."""
    data = head = read_range(plan.fs, item, 0, end, plan.secrets)
    if len(head) >= 12 and head[:6] == b"\x93NUMPY" and end < item.size:
        try:
            needed = min(header_length(head, item.url), item.size)
        except CorruptEntryError:
            needed = len(head)
        head = head + read_range(plan.fs, item, len(head), needed, plan.secrets)  # a longer header
    header = read_source_header(io.BytesIO(head), item.size, item.url)
    if item.header is not None and header != item.header:
        raise CorruptSourceError(f"{item.url} changed while loading; nothing was published, load it again")
    item.header = header
    hasher.size = header.file_size
    _write_part(item, hasher, data, 0, min(end, header.file_size))


def _fetch_decoded(
    plan: RemotePlan,
    item: RemoteItem,
    hasher: TrailingHash,
    budget: ByteBudget,
    stop: threading.Event,
    progressed: Callable[[int], None],
) -> None:
    """A decoded item's bytes, written in order as its decoder yields them."""
    assert item.decoder is not None
    done = 0
    with remote_errors(item.url, plan.secrets):
        for chunk in item.decoder():
            if stop.is_set():
                return
            end = done + len(chunk)
            if end > item.file_bytes:
                raise CorruptSourceError(f"{item.source}: longer than its header says; nothing was published")
            with budget.holding(len(chunk)):
                _write_part(item, hasher, chunk, done, end)
            progressed(len(chunk))
            done = end
    if done != item.file_bytes:
        raise CorruptSourceError(
            f"{item.source}: ended at byte {done} of {item.file_bytes} (truncated); nothing was published"
        )


def _fetch_span(plan: RemotePlan, items: list[RemoteItem], start: int, end: int) -> int:
    """Bytes ``start:end`` of one object (one ranged read), written into every range item
    they overlap, after its built header; returns the bytes written."""
    data = read_range(plan.fs, items[0], start, end, plan.secrets)
    view, written = memoryview(data), 0
    for item in items:
        assert item.prefix is not None and item.hasher is not None
        low, high = max(start, item.offset), min(end, item.offset + item.range_bytes)
        at = len(item.prefix) + low - item.offset
        _write_part(item, item.hasher, view[low - start : high - start], at, at + high - low)
        written += high - low
    return written


def _write_part(
    item: RemoteItem, hasher: TrailingHash, data: bytes | memoryview, start: int, end: int
) -> None:
    """Write ``data``, at least ``end - start`` bytes (a ranged read checked by ``read_range``,
    or a decoder's chunk), at ``start`` of the item's staging file."""
    assert len(data) >= end - start, (item.url, start, end, len(data))
    part = memoryview(data)[: end - start]
    pwrite_all(hasher.path, part, start)
    hasher.done(start, end, part)


# ---------------------------------------------------------------------- planning


def _filesystem(url: str, options: Mapping[str, Any] | None, secrets: list[str]) -> tuple[Any, str]:
    scheme = urlsplit(url).scheme.lower()
    package, extra = BACKEND_EXTRAS.get(scheme, (None, None))
    hint = f": pip install 'shmcache[{extra}]'" if extra else ""
    try:
        import fsspec  # type: ignore[import-untyped]
        import fsspec.core  # type: ignore[import-untyped]
    except ImportError:
        raise InvalidSourceError(
            f"loading {scheme}:// sources needs fsspec{f' and {package}' if package else ''}{hint}"
        ) from None
    try:
        return fsspec.core.url_to_fs(url, **dict(options or {}))  # type: ignore[no-any-return]
    except ImportError:
        raise InvalidSourceError(
            f"loading {scheme}:// sources needs {package or 'an fsspec backend for ' + scheme}{hint}"
        ) from None
    except ValueError as exc:
        if "protocol" in str(exc).lower():
            raise InvalidSourceError(f"{redact_url(url)}: fsspec knows no {scheme}:// filesystem") from None
        raise InvalidSourceError(f"{redact_url(url)}: {scrub(str(exc), secrets)}") from None
    except TypeError as exc:  # a storage option the filesystem does not take
        raise InvalidSourceError(
            f"{redact_url(url)}: the {scheme}:// filesystem refused its storage options "
            f"({scrub(str(exc), secrets)})"
        ) from None


def _list_objects(fs: Any, path: str) -> dict[str, dict[str, Any]]:
    found = fs.find(path, detail=True)
    return {name: info for name, info in found.items() if info.get("type", "file") == "file"}


def _items(
    key: str,
    shown: str,
    path: str,
    directory: bool,
    listing: dict[str, dict[str, Any]],
    dtype: Any = None,
    as_: str = "auto",
) -> list[RemoteItem]:
    from .._containers.table_arrow import TABLE_SUFFIXES

    base = path.rstrip("/")
    items: list[RemoteItem] = []
    tables: list[RemoteItem] = []  # a prefix's table objects: one table, if it holds no arrays
    others: list[RemoteItem] = []  # its other objects: blobs, if it holds no arrays or tables
    seen: dict[str, str] = {}
    for name in sorted(listing):
        info = listing[name]
        if directory:
            relative = name[len(base) :].lstrip("/")
            url = f"{shown.rstrip('/')}/{relative}"
        else:  # the suffix of the URL's path (an HTTP path may end with a query)
            relative, url = urlsplit(shown).path, shown
        suffix = remote_suffix(relative)
        size = info.get("size")
        other = directory and suffix not in REMOTE_SUFFIXES + TABLE_SUFFIXES
        if dtype is None and (as_ == "blobs" or other) and isinstance(size, int) and size >= 0:
            member = relative if directory else posixpath.basename(relative)  # the blob's name
            others.append(RemoteItem(key, name, url, size, _identity(info), None, member=member, kind="blob"))
            continue
        if directory and dtype is None and suffix in TABLE_SUFFIXES:
            size = info.get("size")
            if isinstance(size, int) and size >= 0:
                tables.append(RemoteItem(key, name, url, size, _identity(info), None, suffix=suffix))
                continue
        if dtype is None and suffix not in REMOTE_SUFFIXES and (directory or suffix not in TABLE_SUFFIXES):
            if directory:
                continue
            raise CorruptSourceError(
                f"{url}: not a {', '.join(REMOTE_SUFFIXES)} or table object (or a prefix of them); "
                "a raw token file needs its dtype (dtype='uint16', `--dtype uint16`)"
            )
        child = key
        if directory:
            child = f"{key}/{relative[: len(relative) - len(suffix)]}"
            try:
                validate_key(child)
            except ShmCacheError as exc:
                raise type(exc)(f"{url}: its name does not make a valid key ({exc})") from None
        if child in seen:
            raise InvalidSourceError(f"{seen[child]} and {url} would both become key {child!r}")
        seen[child] = url
        size = info.get("size")
        if not isinstance(size, int) or size < 0:
            raise InvalidSourceError(f"{url}: the server does not say how large it is; it cannot be streamed")
        items.append(RemoteItem(child, name, url, size, _identity(info), _md5_of(info), suffix=suffix))
    if as_ == "blobs" and others:
        return others
    if not items and tables:  # a prefix of table files (a Hub dataset's Parquet shards): one table
        return tables
    if not items and others and as_ == "auto":  # a prefix of other files (images, texts): blobs
        return others
    if not items:
        raise InvalidSourceError(f"{shown} holds no {', '.join(REMOTE_SUFFIXES)} or table objects")
    return items


def _read_header(fs: Any, item: RemoteItem, secrets: list[str]) -> NpyHeader:
    head = read_range(fs, item, 0, min(item.size, _HEAD), secrets)
    if len(head) >= 12 and head[:6] == b"\x93NUMPY":
        try:
            needed = header_length(head, item.url)
        except CorruptEntryError:
            needed = len(head)
        if needed <= item.size:
            head = head + read_range(fs, item, len(head), needed, secrets)
    return read_source_header(io.BytesIO(head), item.size, item.url)


# ---------------------------------------------------------------------- after the fetch, and errors


def check_objects_unchanged(plan: RemotePlan, items: list[RemoteItem]) -> None:
    """Look ``items`` up again (one listing for a directory): a size or identity that
    differs from the plan's means the object changed during the load."""
    with remote_errors(plan.url, plan.secrets):
        plan.fs.invalidate_cache()
        if plan.directory:
            now = _list_objects(plan.fs, plan.path)
        else:  # one object, or a pair (a Megatron .bin and .idx)
            now = {path: plan.fs.info(path) for path in dict.fromkeys(item.path for item in items)}
    for item in items:
        info = now.get(item.path)
        if info is None or info.get("size") != item.size or _identity(info) != item.identity:
            raise CorruptSourceError(
                f"{item.url} changed while loading (its size or ETag is not what it was); "
                "nothing was published, load it again"
            )
