"""What a remote put will publish: :class:`RemoteItem`, one entry read from an object (a
whole ``.npy``, or a byte range of it behind a built header, or decoded), and
:class:`RemotePlan`, every item of one URL with its filesystem. Items carry what their entry
is made of beyond the fetched data file (a Megatron pair's ragged entry: the ``.bin`` as
``values.npy``, ``offsets.npy`` computed from the index), so the store writes every item's
``meta.json`` alike."""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .._disk.layout import ARRAY_FILE
from .._disk.npy import NpyHeader

if TYPE_CHECKING:
    from .blobs import BlobSources

__all__ = ["RemoteItem", "RemotePlan", "object_identity", "object_md5"]


@dataclass
class RemoteItem:
    """One object a remote put will publish as one array entry."""

    key: str
    path: str
    """The object's path in its filesystem (never shown: may carry a query)."""
    url: str
    """The redacted URL: what messages and ``meta.json`` name."""
    size: int
    identity: str
    """What tells this content from another (ETag, MD5, else modification time)."""
    md5: str | None
    header: NpyHeader | None = None
    """Validated header: read by the plan (``plan_file``), else from the first part fetched."""
    version: str = ""
    crc: int = 0
    ready: threading.Event = field(default_factory=threading.Event, repr=False)
    prefix: bytes | None = None
    """A byte range of the object rather than a ``.npy`` object: this built ``.npy`` header
    (``header``'s, known from the object's index when planned) is written first, then the
    header's ``nbytes`` from ``offset`` of the object (see ``remote_files``)."""
    offset: int = 0
    member: str | None = None
    """The tensor or archive member the range holds (named in ``source``)."""
    suffix: str = ".npy"
    """The object's suffix (lower case), which says how it is read."""
    decoder: Callable[[], Iterator[bytes | memoryview]] | None = None
    """For a range whose bytes must be decoded (a compressed ``.npz`` member): the whole
    ``.npy``, in order, in chunks (``prefix`` is empty then, and ``offset`` unused)."""
    kind: str = "array"
    """The entry's kind: ``array``, or ``ragged`` (a Megatron pair's documents)."""
    file_name: str = ARRAY_FILE
    """The file the fetched bytes become (``values.npy`` of a ragged entry)."""
    files: dict[str, np.ndarray] = field(default_factory=dict)
    """Arrays written beside the fetched file (a ragged entry's ``offsets``), from the index."""
    extra: dict[str, Any] = field(default_factory=dict)
    """What ``meta.json`` says beyond the files (a ragged entry's length, dtype, shape)."""
    companion: RemoteItem | None = None
    """Another object the entry is planned from (a Megatron ``.bin``'s ``.idx``): read when
    planned, looked up again before anything is published."""
    hasher: Any = field(default=None, repr=False)
    """The ``TrailingHash`` of the data file while it is fetched (``remote.fetch_remote``)."""
    written: dict[str, tuple[NpyHeader, int]] = field(default_factory=dict)
    """Header and CRC-32 of each of ``files`` once written (``fetch_remote``)."""

    @property
    def file_bytes(self) -> int:
        """Bytes of the entry's data file: the object's (a ``.npy``: its tail cut later), or
        the built header's and the range's."""
        return self.size if self.prefix is None else self.checked_header.file_size

    @property
    def range_bytes(self) -> int:
        """Bytes of the object a range item copies (after its built header, if any)."""
        return self.file_bytes - len(self.prefix or b"")

    @property
    def source(self) -> str:
        """What ``meta.json`` records: the redacted URL, ``[member]`` after it for a range."""
        return self.url if self.member is None else f"{self.url}[{self.member}]"

    def entry_files(self) -> tuple[dict[str, NpyHeader], dict[str, int]]:
        """Headers and CRC-32s of the entry's files by name (without ``.npy``), after the
        fetch: what ``meta.json`` records."""
        name = self.file_name.removesuffix(".npy")
        headers = {name: self.checked_header} | {k: h for k, (h, _) in self.written.items()}
        crcs = {name: self.crc} | {k: c for k, (_, c) in self.written.items()}
        return headers, crcs

    @property
    def checked_header(self) -> NpyHeader:
        assert self.header is not None, "the object's header was not validated"
        return self.header


@dataclass
class RemotePlan:
    """Every object of a remote source; ``fs`` is the fsspec filesystem."""

    fs: Any
    url: str
    path: str
    directory: bool
    items: list[RemoteItem]
    secrets: list[str]
    blobs: BlobSources | None = None
    """Objects as one blobs entry instead of items (a prefix of other files, tar shards)."""

    @property
    def is_table(self) -> bool:
        """Whether the objects are table files (one object, or a prefix of them without
        arrays): one table entry, read by ``remote_files.read_remote_table``."""
        from .._containers.table_arrow import TABLE_SUFFIXES

        return all(item.suffix in TABLE_SUFFIXES for item in self.items)

    @property
    def object_bytes(self) -> int:
        """Bytes of the entries' data files (at most: a ``.npy`` object may have a tail)."""
        return sum(item.file_bytes for item in self.items)


def object_identity(info: Mapping[str, Any]) -> str:
    """What tells an object's content from another's, from its listing."""
    # blob_id: the Hugging Face Hub's git blob hash (hf://), which changes with the content
    names: tuple[str, ...] = ("ETag", "etag", "md5Hash", "content_md5", "crc32c", "blob_id")
    names += ("LastModified", "mtime", "last_modified")
    for field_name in names:
        value = info.get(field_name)
        if value:
            return f"{field_name}={value}"
    return ""


def object_md5(info: Mapping[str, Any]) -> str | None:
    """The object's MD5 when the store gives it: an S3 ETag of a single-part upload, or
    GCS's ``md5Hash`` (multipart ETags and others are not MD5s of the content)."""
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"').lower()
    if len(etag) == 32 and all(c in "0123456789abcdef" for c in etag):
        return etag
    md5 = info.get("md5Hash")
    if isinstance(md5, str):
        try:
            return base64.b64decode(md5).hex()
        except ValueError:
            return None
    return None
