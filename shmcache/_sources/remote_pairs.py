"""Megatron ``.bin`` + ``.idx`` pairs from URLs: the same ragged entry of documents a local
pair makes (``token_files``), from the same index reader and checks.

A URL names a pair as a local path does: the ``.idx``, the ``.bin`` with an ``.idx`` beside
it, or their common prefix (``s3://b/corpus_text_document``). The ``.idx`` object is read
when planned (by ranged reads; its header's counts are checked against its listed size
before the rest is read, so a hostile count reads or allocates nothing more); the ``.bin``
is then a byte range streamed into ``values.npy`` as every other range is
(``remote.fetch_remote``), ``offsets.npy`` computed from the index. Both objects are looked
up again before anything is published: either one changed fails the load.
"""

from __future__ import annotations

import posixpath
from typing import Any

from .._disk.npy import NpyHeader, build_header
from ..errors import CorruptSourceError, SourceNotFoundError
from .remote_parts import read_range
from .remote_plan import RemoteItem, object_identity, object_md5
from .token_files import megatron_documents, read_megatron_index

__all__ = ["PAIR_SUFFIXES", "megatron_pair", "pair_item", "plan_pair"]

PAIR_SUFFIXES = (".bin", ".idx")

Pair = tuple[tuple[str, str, dict[str, Any]], tuple[str, str, dict[str, Any]]]
"""``((bin path, bin URL, bin info), (idx path, idx URL, idx info))``."""


def megatron_pair(fs: Any, path: str, shown: str, info: dict[str, Any] | None) -> Pair | None:
    """The ``.bin`` and ``.idx`` objects of the Megatron pair ``path`` names (``info``: its
    listing; None when nothing is at ``path``: then a prefix of the pair), or None when
    ``path`` names no pair (a ``.bin`` without ``.idx`` beside it is a raw token file).
    An ``.idx`` without its ``.bin`` is a :class:`SourceNotFoundError`, as locally."""
    suffix = posixpath.splitext(path)[1].lower()
    if info is not None and suffix not in PAIR_SUFFIXES:
        return None
    stem = path[: -len(suffix)] if info is not None else path
    shown_stem = shown[: -len(suffix)] if info is not None and shown.lower().endswith(suffix) else shown
    infos: dict[str, dict[str, Any] | None] = {}
    for end in PAIR_SUFFIXES:
        known = info if info is not None and suffix == end else None
        try:
            infos[end] = known if known is not None else fs.info(stem + end)
        except FileNotFoundError:
            infos[end] = None
    if infos[".idx"] is None:
        return None
    if infos[".bin"] is None:
        raise SourceNotFoundError(f"{shown_stem}.bin does not exist (the data of index {shown_stem}.idx)")
    return (
        (stem + ".bin", shown_stem + ".bin", infos[".bin"]),  # type: ignore[return-value]
        (stem + ".idx", shown_stem + ".idx", infos[".idx"]),
    )


def pair_item(key: str, pair: Pair) -> RemoteItem:
    """The ``.bin``'s item (its ``.idx`` as ``companion``), planned by :func:`plan_pair`."""
    items = []
    for path, url, info in pair:
        size = info.get("size")
        if not isinstance(size, int) or size < 0:
            raise CorruptSourceError(f"{url}: the server does not say how large it is; it cannot be streamed")
        items.append(RemoteItem(key, path, url, size, object_identity(info), object_md5(info), suffix=".bin"))
    items[0].companion = items[1]
    items[1].suffix = ".idx"
    return items[0]


def plan_pair(fs: Any, obj: RemoteItem, secrets: list[str], dtype: Any = None) -> list[RemoteItem]:
    """Read and check ``obj.companion`` (the index) and make ``obj`` (the ``.bin``) the ragged
    entry's ``values``: a built header, then the whole object. (The caller turns a backend's
    errors into typed ones: ``remote.remote_errors``.)"""
    index = obj.companion
    assert index is not None
    parsed = read_megatron_index(_reader(fs, index, secrets), index.size, index.url)
    tokens, offsets, extra = megatron_documents(parsed, dtype, obj.size, obj.url, index.url)
    obj.prefix = build_header(parsed[3], (tokens,), False)
    obj.header = NpyHeader(parsed[3], (tokens,), False, len(obj.prefix))
    obj.kind, obj.file_name, obj.files = "ragged", "values.npy", {"offsets": offsets}
    obj.extra = extra | {"shape": [extra["length"]]}
    return [obj]


def _reader(fs: Any, index: RemoteItem, secrets: list[str]) -> Any:
    """``read(n, offset)`` of the index: short past its listed size only (the index reader
    names a truncated index)."""

    def read(nbytes: int, offset: int) -> bytes:
        return bytes(read_range(fs, index, offset, min(offset + nbytes, index.size), secrets))

    return read
