"""The manifest of a directory put: one file describing every entry of one batch version.

A directory put writes its entries into one version directory ``objects/<batch>/``, entry
``n`` in ``objects/<batch>/<n>/`` (its ``.npy`` files, no ``meta.json``); the entry's
version is ``<batch>/<n>`` and its link points there. What ``meta.json`` would say of each
entry is in ``objects/<batch>/manifest``, written once, before the batch is published::

    bytes 0..8      b"SHMCMF1\\n"
    bytes 8..16     N, the number of entries (uint64, little-endian, as every number here)
    bytes 16..24    C, the length of the common part
    bytes 24..      N + 1 offsets (from the start of the file): entry n is bytes
                    offsets[n]..offsets[n + 1]
    then            the common part (a JSON object: what every entry shares), then the
                    entries (each a JSON object and a newline)

An entry's metadata is the common object updated with its own, and its ``version``. One
entry is read with four ``pread`` calls whatever N is: no reader parses the whole manifest
for one key, and the open path reads none of it (as it reads no ``meta.json``).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from .layout import MANIFEST_FILE, object_path

__all__ = [
    "MANIFEST_MAGIC",
    "encode_manifest",
    "read_manifest_entry",
    "read_manifest_keys",
    "split_batch_version",
]

MANIFEST_MAGIC = b"SHMCMF1\n"
_HEAD = struct.Struct("<8sQQ")
_PAIR = struct.Struct("<QQ")


def split_batch_version(version: str) -> tuple[str, int] | None:
    """``(batch, n)`` of an entry inside a directory put's version (``<batch>/<n>``), or
    None for a version of its own."""
    batch, slash, index = version.partition("/")
    if not slash or not index.isdigit():
        return None
    return batch, int(index)


def encode_manifest(common: Mapping[str, Any], entries: Sequence[bytes]) -> list[bytes]:
    """The manifest's bytes (in pieces, for one ``writev``-like loop): ``entries`` are the
    entries' JSON objects, encoded, newline included, in the order of their numbers."""
    head = json.dumps(common).encode() + b"\n"
    count = len(entries)
    start = _HEAD.size + 8 * (count + 1) + len(head)
    offsets = [start]
    for line in entries:
        start += len(line)
        offsets.append(start)
    table = struct.pack(f"<{count + 1}Q", *offsets)
    return [_HEAD.pack(MANIFEST_MAGIC, count, len(head)), table, head, *entries]


def read_manifest_entry(root: str, version: str) -> dict[str, Any] | None:
    """The metadata object of entry ``<batch>/<n>``; None if the batch or its manifest is
    gone. ``ValueError`` if the manifest is damaged (not this format, short, not JSON)."""
    found = split_batch_version(version)
    if found is None:
        raise ValueError(f"{version!r} is not an entry of a directory put's version")
    batch, index = found
    fd = _open(root, batch)
    if fd is None:
        return None
    try:
        head = _Head.read(fd, batch)
        if index >= head.entries:
            raise ValueError(f"the manifest of {batch} lists {head.entries} entries, not entry {index}")
        common = head.common(fd)
        own = head.entry(fd, index)
    finally:
        os.close(fd)
    meta = json.loads(common)
    entry = json.loads(own)
    if not isinstance(meta, dict) or not isinstance(entry, dict):
        raise ValueError(f"the manifest of {batch} holds no JSON object for entry {index}")
    meta.update(entry)
    meta["version"] = version
    return meta


def read_manifest_keys(root: str, batch: str, indices: Iterable[int]) -> dict[int, str | None]:
    """The key each entry ``n`` of ``indices`` records in ``batch``'s manifest (None: none),
    the manifest opened and its head read once for all (a replace of many keys checks what
    each replaced version records). An index it does not list is left out; empty if the
    manifest is gone. ``ValueError`` if it is damaged."""
    fd = _open(root, batch)
    if fd is None:
        return {}
    keys: dict[int, str | None] = {}
    try:
        head = _Head.read(fd, batch)
        common: dict[str, Any] | None = None
        for index in indices:
            if not 0 <= index < head.entries:
                continue
            own = head.entry(fd, index)
            if own.startswith(b'{"key":"'):  # how array_line writes it (keys need no escape)
                end = own.find(b'"', 8)
                if end > 0 and b"\\" not in own[8:end]:
                    keys[index] = own[8:end].decode()
                    continue
            entry = json.loads(own)
            if common is None:
                common = json.loads(head.common(fd))
            if not isinstance(entry, dict) or not isinstance(common, dict):
                raise ValueError(f"the manifest of {batch} holds no JSON object for entry {index}")
            key = entry.get("key", common.get("key"))
            keys[index] = key if isinstance(key, str) else None
    finally:
        os.close(fd)
    return keys


def _open(root: str, batch: str) -> int | None:
    """A descriptor of ``batch``'s manifest; None if the batch or its manifest is gone."""
    try:
        return os.open(object_path(root, batch, MANIFEST_FILE), os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None


class _Head(NamedTuple):
    """A manifest's head, checked against the file's size: a damaged number costs an
    error, never a huge allocation."""

    batch: str
    entries: int  # how many
    body: int  # where the common part starts
    common_length: int
    size: int

    @classmethod
    def read(cls, fd: int, batch: str) -> _Head:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _HEAD.size, 0)
        if len(head) < _HEAD.size:
            raise ValueError(f"the manifest of {batch} is truncated")
        magic, count, common_length = _HEAD.unpack(head)
        if magic != MANIFEST_MAGIC:
            raise ValueError(f"the manifest of {batch} is not a shmcache manifest")
        body = _HEAD.size + 8 * (count + 1)
        if body + common_length > size:
            raise ValueError(f"the manifest of {batch} is truncated or its offsets are wrong")
        return cls(batch, count, body, common_length, size)

    def common(self, fd: int) -> bytes:
        common = os.pread(fd, self.common_length, self.body)
        if len(common) != self.common_length:
            raise ValueError(f"the manifest of {self.batch} is truncated or its offsets are wrong")
        return common

    def entry(self, fd: int, index: int) -> bytes:
        """Entry ``index``'s own bytes (``index`` < ``count``)."""
        pair = os.pread(fd, _PAIR.size, _HEAD.size + 8 * index)
        if len(pair) < _PAIR.size:
            raise ValueError(f"the manifest of {self.batch} is truncated")
        start, end = _PAIR.unpack(pair)
        if not self.body + self.common_length <= start < end <= self.size:
            raise ValueError(f"the manifest of {self.batch} is truncated or its offsets are wrong")
        own = os.pread(fd, end - start, start)
        if len(own) != end - start:
            raise ValueError(f"the manifest of {self.batch} is truncated or its offsets are wrong")
        return own
