"""The manifest of a directory put: one file describing every entry of one batch version,
and holding the bytes of its small entries.

A directory put writes its entries into one version directory ``objects/<batch>/``. An
entry whose ``.npy`` is small (at most :data:`PACK_MAX` bytes) is PACKED into the
manifest file itself: its version is ``<batch>/<n>.<offset>.<length>`` (``layout.
packed_range``); the open path ``pread``s its header and live byte, and its array is a
view into the process's one mapping of its 64 MiB window of the manifest
(``_disk/mapped.SharedManifest``; its own range where that is refused, and for
``pin``/``private_view``). A
published manifest never grows. A bigger one keeps a directory of its own,
``objects/<batch>/<n>/`` (its ``.npy`` files, no ``meta.json``), version ``<batch>/<n>``.
(A file and a directory per 1 KiB entry cost twice what ``cp -r`` does; a batch may mix
both.) Why the manifest and not a file of its own beside it: an older shmcache's
``cleanup`` removes any other unlinked name in a live batch directory. Format 2::

    bytes 0..64     b"SHMCMF2\\n", then N (the number of entries), C (the length of the
                    common part), T (where the offsets table starts), L (where the live
                    bitmap starts): uint64, little-endian, as every number here; zeros
    bytes 64..T     the data region: each packed entry's ``.npy`` at a 64-byte aligned
                    offset (its array data keeps the alignment a file of its own has)
    bytes T..       N + 1 offsets (from the start of the file): entry n's JSON object is
                    bytes offsets[n]..offsets[n + 1]
    then            the common part (a JSON object every entry shares), the entries (each
                    a JSON object and a newline)
    bytes L..L+N    the live bitmap: 1 for a packed entry not yet evicted, else 0

The head is written last. Evicting a packed entry clears its live byte (never its bytes:
a process that mapped it keeps reading them, as it keeps an unlinked file's); the batch
goes once no entry directory is left and no live byte is 1, so a packed entry's memory
returns with its batch's last entry. Format 1 (``SHMCMF1\\n``: N, C, then the offsets at
byte 24, no data region, no bitmap) is read as before.

An entry's metadata is the common object updated with its own, and its ``version``. One
entry is read with four ``pread`` calls whatever N is: no reader parses the whole manifest
for one key, and the open path reads none of it (as it reads no ``meta.json``).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from itertools import accumulate
from typing import Any, NamedTuple

from .layout import MANIFEST_FILE, object_path, packed_range

__all__ = [
    "MANIFEST_MAGIC",
    "MANIFEST_MAGIC_V1",
    "PACK_ALIGN",
    "PACK_MAX",
    "ManifestWriter",
    "clear_live",
    "encode_manifest",
    "live_entries",
    "open_packed",
    "read_manifest_entry",
    "read_manifest_keys",
    "split_batch_version",
]

MANIFEST_MAGIC = b"SHMCMF2\n"
MANIFEST_MAGIC_V1 = b"SHMCMF1\n"
PACK_MAX = 64 << 10
"""Entries of a directory put whose ``.npy`` is at most this big are packed into the
manifest (the bound under which planning reads a file whole, ``_sources.files._KEEP``)."""
PACK_ALIGN = 64
"""Each packed entry starts at a multiple of this (numpy pads headers to 64 bytes: the
array data stays 64-byte aligned, as in a file of its own)."""
_FLUSH = 4 << 20  # the data region is written in pieces of about this size
_ZEROS = bytes(PACK_ALIGN)
_PADS = tuple(bytes(n) for n in range(PACK_ALIGN))  # the padding before an entry, by its length
_HEAD = struct.Struct("<8sQQ")  # format 1's head, and the first 24 bytes of format 2's
_HEAD2 = struct.Struct("<8sQQQQ24x")
_PAIR = struct.Struct("<QQ")


def split_batch_version(version: str) -> tuple[str, int] | None:
    """``(batch, n)`` of an entry inside a directory put's version (``<batch>/<n>``, or a
    packed ``<batch>/<n>.<offset>.<length>``), or None for a version of its own."""
    batch, slash, index = version.partition("/")
    if not slash:
        return None
    if index.isascii() and index.isdigit():  # int() refuses other digits ("²")
        return batch, int(index)
    packed = packed_range(version)
    return None if packed is None else (batch, packed[1])


class ManifestWriter:
    """Writes a format 2 manifest to ``fd`` (a new, empty file; ``path`` names it in
    errors): packed entries first (:meth:`add`, :meth:`add_all`, in any order of their
    numbers; streamed: what is buffered is flushed once it reaches 4 MiB, so it stays a
    few MiB while each :meth:`add_all` is given a few MiB), then :meth:`finish` writes
    the tables, the bitmap and the head."""

    def __init__(self, fd: int, path: str, count: int) -> None:
        from .fs import write_all  # deferred: the read side (meta, the open path) loads no write side

        self._write_all = write_all
        self.fd, self.path, self.count = fd, path, count
        self.live = bytearray(count)
        self._buffer = bytearray(_HEAD2.size)  # the head's place, written last
        self._end = _HEAD2.size  # the file offset the buffer ends at

    def add(self, index: int, data: bytes) -> str:
        """Append entry ``index``'s ``.npy`` bytes; returns its version's tail
        ``<n>.<offset>.<length>``."""
        offset = self._end
        buffer = self._buffer
        pad = -offset % PACK_ALIGN
        if pad:
            buffer += _ZEROS[:pad]
            offset += pad
        buffer += data
        length = len(data)
        self._end = offset + length
        self.live[index] = 1
        if len(buffer) >= _FLUSH:
            self._flush()
        return f"{index}.{offset}.{length}"

    def add_all(self, indices: Sequence[int], datas: Sequence[bytes], prefix: str = "") -> list[str]:
        """:meth:`add` of each ``(indices[i], datas[i])``, in one pass and one copy into
        the buffer (a directory put packs 100,000 entries: a call and a concatenation
        each cost more than the arithmetic); returns their versions' tails, each after
        ``prefix`` (the batch and a slash: their whole versions). ``datas`` are joined,
        then copied into the buffer: give it a few MiB at a time
        (``_store.writing._pack_small`` does)."""
        offset = self._end
        pieces: list[bytes] = []
        tails: list[str] = []
        append, tail, live, pads = pieces.append, tails.append, self.live, _PADS
        for index, data in zip(indices, datas, strict=True):
            pad = -offset % PACK_ALIGN
            if pad:
                append(pads[pad])
                offset += pad
            append(data)
            length = len(data)
            tail(f"{prefix}{index}.{offset}.{length}")
            offset += length
            live[index] = 1
        self._buffer += b"".join(pieces)
        self._end = offset
        if len(self._buffer) >= _FLUSH:
            self._flush()
        return tails

    def _flush(self) -> None:
        self._write_all(self.fd, self._buffer, self.path)
        self._buffer = bytearray()

    def finish(self, common: Mapping[str, Any], entries: Sequence[bytes]) -> None:
        """Write the offsets, the common part, ``entries`` (each entry's JSON object,
        encoded, newline included, in the order of their numbers), the live bitmap, then
        the head at byte 0."""
        assert len(entries) == self.count
        pad = -self._end % 8
        if pad:
            self._buffer += bytes(pad)
        table = self._end + pad
        head = json.dumps(common).encode() + b"\n"
        offsets = list(accumulate(map(len, entries), initial=table + 8 * (self.count + 1) + len(head)))
        start = offsets[-1]
        self._buffer += struct.pack(f"<{self.count + 1}Q", *offsets)
        self._buffer += head
        self._buffer += b"".join(entries)
        self._buffer += self.live
        self._flush()
        done = os.pwrite(self.fd, _HEAD2.pack(MANIFEST_MAGIC, self.count, len(head), table, start), 0)
        if done != _HEAD2.size:
            raise OSError(f"short write of the head of {self.path}")


def open_packed(root: str, version: str) -> tuple[int, int, int]:
    """``(descriptor, offset, length)`` of a packed entry's bytes in its batch's manifest
    (the caller closes the descriptor); FileNotFoundError if the batch is gone,
    ``ValueError`` if the range is not inside the file (damaged)."""
    packed = packed_range(version)
    if packed is None:
        raise ValueError(f"{version!r} is not a packed entry's version")
    batch, _, offset, length = packed
    fd = os.open(object_path(root, batch, MANIFEST_FILE), os.O_RDONLY | os.O_CLOEXEC)
    if offset < _HEAD2.size or offset + length > os.fstat(fd).st_size:
        os.close(fd)
        raise ValueError(
            f"the manifest of {batch} is truncated: it does not hold bytes {offset}..{offset + length}"
        )
    return fd, offset, length


def clear_live(root: str, batch: str, indices: Iterable[int]) -> int | None:
    """Clear the live bytes of packed entries ``indices`` of ``batch`` (their links are
    gone); returns how many live bytes are left, None if the manifest is gone, of
    format 1, or damaged (its batch then goes when its directories do, or by ``cleanup``)."""
    try:
        fd = os.open(object_path(root, batch, MANIFEST_FILE), os.O_RDWR | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        head = _Head.read(fd, batch)
        if head.live is None:
            return None
        for index in indices:
            if 0 <= index < head.entries:
                os.pwrite(fd, b"\0", head.live + index)
        return os.pread(fd, head.entries, head.live).count(1)
    except ValueError:
        return None
    finally:
        os.close(fd)


def live_entries(root: str, batch: str) -> set[int] | None:
    """The numbers of ``batch``'s packed entries whose live byte is 1 (empty for a format
    1 manifest); None if the manifest is gone. ``ValueError`` if it is damaged."""
    fd = _open(root, batch)
    if fd is None:
        return None
    try:
        head = _Head.read(fd, batch)
        if head.live is None:
            return set()
        bitmap = os.pread(fd, head.entries, head.live)
    finally:
        os.close(fd)
    return {index for index, byte in enumerate(bitmap) if byte}


def encode_manifest(common: Mapping[str, Any], entries: Sequence[bytes]) -> list[bytes]:
    """A format 1 manifest's bytes (in pieces; what shmcache wrote before packing, kept for
    tests of old roots): ``entries`` are the entries' JSON objects, encoded, newline
    included, in the order of their numbers."""
    head = json.dumps(common).encode() + b"\n"
    count = len(entries)
    start = _HEAD.size + 8 * (count + 1) + len(head)
    offsets = [start]
    for line in entries:
        start += len(line)
        offsets.append(start)
    table = struct.pack(f"<{count + 1}Q", *offsets)
    return [_HEAD.pack(MANIFEST_MAGIC_V1, count, len(head)), table, head, *entries]


def read_manifest_entry(root: str, version: str) -> dict[str, Any] | None:
    """The metadata object of entry ``<batch>/<n>`` (or of a packed ``<batch>/<n>.<offset>.
    <length>``); None if the batch or its manifest is gone, or the packed entry was evicted
    (its live byte cleared). ``ValueError`` if the manifest is damaged (not this format,
    short, not JSON)."""
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
        if "." in version.partition("/")[2]:  # packed
            if head.live is None:
                raise ValueError(f"the manifest of {batch} is of format 1, which packs no entry")
            if os.pread(fd, 1, head.live + index) != b"\x01":
                return None  # evicted
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
    """A manifest's head (format 1 or 2), checked against the file's size: a damaged
    number costs an error, never a huge allocation."""

    batch: str
    entries: int  # how many
    table: int  # where the offsets start
    body: int  # where the common part starts
    common_length: int
    size: int
    live: int | None  # where the live bitmap starts (None: format 1)

    @classmethod
    def read(cls, fd: int, batch: str) -> _Head:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _HEAD2.size, 0)
        if len(head) < _HEAD.size:
            raise ValueError(f"the manifest of {batch} is truncated")
        magic, count, common_length = _HEAD.unpack_from(head)
        if magic == MANIFEST_MAGIC_V1:
            table, live = _HEAD.size, None
        elif magic == MANIFEST_MAGIC and len(head) == _HEAD2.size:
            _, _, _, table, live = _HEAD2.unpack(head)
        else:
            raise ValueError(f"the manifest of {batch} is not a shmcache manifest")
        body = table + 8 * (count + 1)
        if body + common_length > size or (
            # format 2: the table after the head, 8-byte aligned; the live bitmap last, after
            # the JSON, exactly N bytes (a damaged L must not aim an evict's write at data)
            live is not None
            and (table < _HEAD2.size or table % 8 or live < body + common_length or live + count != size)
        ):
            raise ValueError(f"the manifest of {batch} is truncated or its offsets are wrong")
        return cls(batch, count, table, body, common_length, size, live)

    def common(self, fd: int) -> bytes:
        common = os.pread(fd, self.common_length, self.body)
        if len(common) != self.common_length:
            raise ValueError(f"the manifest of {self.batch} is truncated or its offsets are wrong")
        return common

    def entry(self, fd: int, index: int) -> bytes:
        """Entry ``index``'s own bytes (``index`` < ``count``)."""
        pair = os.pread(fd, _PAIR.size, self.table + 8 * index)
        if len(pair) < _PAIR.size:
            raise ValueError(f"the manifest of {self.batch} is truncated")
        start, end = _PAIR.unpack(pair)
        if not self.body + self.common_length <= start < end <= self.size:
            raise ValueError(f"the manifest of {self.batch} is truncated or its offsets are wrong")
        own = os.pread(fd, end - start, start)
        if len(own) != end - start:
            raise ValueError(f"the manifest of {self.batch} is truncated or its offsets are wrong")
        return own
