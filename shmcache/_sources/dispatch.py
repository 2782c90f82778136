"""One dispatch over every kind of source ``put_file`` takes: a URL (``remote``), a table
file (``tables``), files packed as blobs (``blobs``), tar shards as blobs
(``tar_shards``), ``datasets`` folders as tables (``hf_datasets``), or array files and
directories of them (``files``, whose ``PLANNERS`` name each suffix's planner).
``Store.put_file``, ``Store.plan_file`` (the dry run the daemon checks loads with) and the
daemon's preloads (is what was loaded still current?) all decide here, so a new kind is
decided once."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import InvalidSourceError, SourceKindError, SourceNotFoundError
from .blobs import AS_KINDS, directory_fingerprint, plan_blobs, put_kind
from .files import ArrayFiles, array_files_under, plan_sources
from .hf_datasets import hf_fingerprint, is_hf_folder, plan_hf_folder, planned_entries
from .planned import PlannedEntry
from .source_files import stat_fingerprint
from .tables import is_table_file, plan_table_file
from .tar_shards import ShardSource, is_shard_source, plan_shards, shards_fingerprint
from .token_files import refuse_dtype_for
from .urls import is_url, local_path_of, redact_url

__all__ = ["Loaded", "Source", "classify_source", "is_current", "plan_source"]

SourceKind = Literal["remote", "table", "blobs", "shards", "hf", "arrays"]


@dataclass(frozen=True)
class Source:
    """What ``put_file(key, location, as_=...)`` makes: ``kind``, and where it reads from
    (a URL for ``remote``; a local path otherwise, ``file://`` URLs made paths; for
    ``shards``, a ``.tar`` path, a glob or brace pattern of them, or a list)."""

    kind: SourceKind
    location: ShardSource
    listing: ArrayFiles | None = None
    """A directory's walk when its files decided its kind: what ``plan_sources`` plans."""


def classify_source(path: ShardSource, as_: str = "auto", dtype: Any = None) -> Source:
    """The kind of source ``path`` is: a URL, a table file, blobs (``as_``, or a directory
    without array files), tar shards (``.tar`` files, a pattern or a list of them: one blobs
    entry) or array files (a raw token file when ``dtype`` is given)."""
    if as_ not in AS_KINDS:
        raise SourceKindError(
            f"{_shown(path)}: as_={as_!r} is no kind put_file makes; as_ is 'auto' (a table file "
            "is a table, array files arrays, a directory of other files blobs), 'arrays' (an "
            "entry per array file) or 'blobs' (every file as bytes in one entry)"
        )
    if dtype is not None and as_ == "blobs":
        raise SourceKindError(
            "dtype= reads a raw token file as one array; as_='blobs' keeps files as bytes: "
            "pass one or the other"
        )
    if dtype is not None and is_shard_source(path):
        shown = _shown(path)
        raise InvalidSourceError(
            f"dtype= is for a raw token file (e.g. nanoGPT's train.bin); {shown} names tar shards, "
            "whose bytes are archive headers and members, not tokens: put it without dtype (one "
            "blobs entry, a blob per member), or extract the token file and put that with dtype"
        )
    if not isinstance(path, (str, os.PathLike)):
        if any(isinstance(p, str) and is_url(p) for p in path):
            raise InvalidSourceError(
                "put_file takes local .tar shards as a list; name shards at a URL with one brace pattern "
                "or glob instead (s3://bucket/shards/{000..099}.tar)"
            )
        if as_ == "arrays" or dtype is not None or not is_shard_source(path):
            raise InvalidSourceError(
                "put_file takes a list of .tar shards only (one blobs entry, members as blobs); "
                "put other files with put_blobs(key, paths), or one put_file per path"
            )
        return Source("shards", list(path))
    refuse_dtype_for(path, dtype)
    if is_url(path):
        local = local_path_of(str(path))
        if local is None:
            return Source("remote", str(path))
        path = local
    if as_ == "auto" and dtype is None and is_shard_source(path):  # as_="blobs": the .tar file itself
        return Source("shards", path)
    _refuse_too_long(path)
    if as_ == "auto" and dtype is None and is_hf_folder(path):  # save_to_disk: tables, not 3 blobs
        return Source("hf", path)
    kind, listing = put_kind(Path(path), as_)
    if kind != "blobs" and is_table_file(path) and not os.path.isdir(path) and dtype is None:  # one table
        return Source("table", path)
    if kind == "blobs":
        return Source("blobs", path)
    return Source("arrays", path, listing)


def _refuse_too_long(path: str | os.PathLike[str]) -> None:
    """A name longer than the filesystem takes is a typed error, not the OSError of the
    first ``stat`` (a pattern is expanded first: its names are looked up one by one)."""
    try:
        os.lstat(path)
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            text = os.fspath(path)
            shown = text if len(text) <= 200 else text[:200] + "..."
            raise SourceNotFoundError(
                f"source {shown} does not exist: its name is too long for a file"
            ) from None


def _shown(path: ShardSource) -> str:
    """``path`` (a path, URL or list of them) as an error message names it: no URL secrets."""
    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    return ", ".join(redact_url(str(p)) if is_url(p) else os.fspath(p) for p in paths)


def _local(location: ShardSource) -> str | os.PathLike[str]:
    assert isinstance(location, (str, os.PathLike)), "only shards come as a list"
    return location


def plan_source(
    key: str,
    path: ShardSource,
    *,
    allowed: Sequence[str | os.PathLike[str]] = (),
    as_: str = "auto",
    storage_options: Mapping[str, Any] | None = None,
    dtype: Any = None,
) -> list[PlannedEntry]:
    """What ``put_file(key, path)`` would publish, validated (headers, dtypes, key names)
    without copying anything (``key`` is valid)."""
    source = classify_source(path, as_, dtype)
    if source.kind == "remote":
        from .remote_files import plan_remote, plan_remote_table  # threads: URLs only

        plan = plan_remote(key, str(source.location), storage_options, dtype=dtype, as_=as_)
        if plan.blobs is not None:
            return [PlannedEntry(key, plan.url, plan.url, plan.blobs.size)]
        if plan.is_table:
            return plan_remote_table(key, plan)
        return [PlannedEntry(i.key, i.source, i.url, i.checked_header.file_size) for i in plan.items]
    location = source.location
    if source.kind == "shards":
        shards = plan_shards(location, f"tar shards for key {key!r}", allowed)
        shown = shards.source or ", ".join(str(p) for p in location)  # type: ignore[union-attr]
        return [PlannedEntry(key, shown, shown, shards.size)]
    if source.kind == "hf":
        return planned_entries(plan_hf_folder(key, Path(_local(location)), allowed))
    if source.kind == "table":
        return [plan_table_file(key, Path(_local(location)), allowed)]
    if source.kind == "blobs":
        with plan_blobs(_local(location), f"blobs for key {key!r}", allowed) as blobs:
            pass
        return [PlannedEntry(key, str(location), str(location), blobs.size)]
    return [
        PlannedEntry(p.key, p.source, p.copy_from, p.header.file_size)
        for p in plan_sources(key, Path(_local(location)), allowed, dtype, listing=source.listing)
    ]


@dataclass(frozen=True)
class Loaded:
    """What an entry recorded of where it was loaded from (its ``meta.json``)."""

    source: str
    kind: str
    fingerprint: Mapping[str, Any] | None
    identity: Callable[[], str | None]
    """The remote object's identity (ETag), read only for a URL source."""


def is_current(source: Path | str, loaded: Sequence[Loaded]) -> bool:
    """Whether ``loaded`` (the entries under a key that record a source) came from
    ``source`` as it is now: the same files, sizes and modification times; for a URL
    (a ``str``), the same objects, sizes and ETags. What lets a preload be skipped."""
    if not loaded:
        return False
    if isinstance(source, str):
        from .remote import remote_identities

        now = remote_identities(source)
        objects = {e.source.rpartition("[")[0] if e.source.endswith("]") else e.source: e for e in loaded}
        return {url: ((e.fingerprint or {}).get("size"), e.identity()) for url, e in objects.items()} == now
    if len(loaded) == 1 and loaded[0].kind == "blobs":  # a packed directory or shards: one fingerprint
        entry = loaded[0]
        if is_shard_source(source):
            return entry.source == str(source) and entry.fingerprint == shards_fingerprint(source)
        return entry.source == str(source) and entry.fingerprint == directory_fingerprint(source)
    if is_hf_folder(source):  # a table per split, each fingerprinted by its data files
        return all(
            Path(e.source).is_relative_to(source) and e.fingerprint == hf_fingerprint(Path(e.source))
            for e in loaded
        ) and len(loaded) == len(plan_hf_folder("k", source))
    try:
        files = {str(p) for p in array_files_under(source)} if source.is_dir() else {str(source)}
    except OSError:  # a directory that cannot be listed: load again, and say why there
        return False
    seen = set()
    for entry in loaded:
        file = entry.source  # a member of a multi-array file: "<file>[<member>]"
        if file not in files and file.endswith("]"):
            file = file.rpartition("[")[0]
        if file not in files:
            return False
        try:
            st = os.stat(file)
        except OSError:
            return False
        if entry.fingerprint != stat_fingerprint(st):
            return False
        seen.add(file)
    return seen == files
