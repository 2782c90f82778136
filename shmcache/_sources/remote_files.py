"""Formats other than ``.npy`` from URLs: each remote object is opened through fsspec as a
seekable file-like (``fs.open(path, "rb", block_size=...)``: every read a ranged GET) and
handed to the same index readers a local file goes through, so each format is checked
exactly as it is locally, before any byte of it is written.

- ``.safetensors``, torch ``.pt``/``.pth`` (contiguous tensors), stored ``.npz`` members,
  raw token files (``dtype=``): only the index is read here (the safetensors header; the
  zip's central directory and pickle; the ``.npz`` members' headers). Each tensor or member
  becomes a :class:`~shmcache._sources.remote.RemoteItem` holding a built ``.npy`` header
  and the object's byte range, which ``remote.fetch_remote`` streams into the version file
  at its offset in parallel parts, as it does ``.npy`` objects: memory stays flat (no copy
  of the object in RAM beside the cache).
- Compressed ``.npz`` members (``np.savez_compressed``): inflated by zipfile from the
  remote file-like as it reads it, written in order (one stream per member, 4 MiB chunks).
- HDF5 (``.h5``/``.hdf5``, h5py needed): h5py reads the remote file-like (its seeks are
  ranged reads); every dataset is checked first, then each decoded in slabs written in order.
- Table objects (``.parquet``, ``.feather``/``.arrow``, ``.csv``, ``.jsonl``): planned here
  (a Parquet footer read), loaded by ``remote_tables`` (streamed into a scratch file in the
  root's ``tmp/``, decoded from it batch by batch); :func:`read_remote_table` (the objects
  fetched whole into memory and decoded) is its fallback for tables of several objects
  whose later batches need another layout.

Every object's size and ETag listed at the start are looked up again after the load (the
ranges of an object are not its whole bytes, so no MD5 can prove them): an object changed
meanwhile fails the load and nothing is published.
"""

from __future__ import annotations

import io
import math
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, cast

import numpy as np

from .._containers.table_arrow import read_table_file, require_pyarrow
from .._disk.array_parts import FileArray
from .._disk.keys import validate_key
from .._disk.npy import NpyHeader, build_header, iter_npz_members
from ..errors import CorruptSourceError, InvalidSourceError, ShmCacheError, UnsupportedDataError
from .planned import PlannedEntry
from .remote import (
    DEFAULT_WORKERS,
    RemoteItem,
    RemotePlan,
    check_objects_unchanged,
    list_remote,
    read_npy_headers,
    remote_errors,
)
from .remote_parts import read_range
from .token_files import token_dtype

__all__ = [
    "BLOCK_SIZE",
    "plan_object",
    "plan_remote",
    "plan_remote_table",
    "read_remote_table",
]

BLOCK_SIZE = 1 << 20
"""Bytes per ranged read of the file-like the index readers read through."""
_INFLATE_CHUNK = 4 << 20


def plan_remote(
    key: str,
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    read_headers: bool = True,
    workers: int = DEFAULT_WORKERS,
    dtype: Any = None,
    as_: str = "auto",
) -> RemotePlan:
    """List the objects under ``url`` (``key`` is valid already) and read the index of every
    object that is not a ``.npy`` (with ``dtype``: one raw token file), each in a thread.
    With ``read_headers``, also read and validate every ``.npy`` header now (a dry run);
    without, ``fetch_remote`` validates each from the object's first part before writing a
    byte of it: one request fewer per object."""
    plan = list_remote(key, url, storage_options, dtype, as_)
    if plan.items[0].kind in ("blob", "shard"):  # one blobs entry: a prefix of other files, tar shards
        from .remote_blobs import plan_remote_blobs

        plan.blobs = plan_remote_blobs(plan, f"blobs for key {key!r}")
        return plan
    if plan.is_table:
        _check_tables(plan)
        return plan
    indexed = [obj for obj in plan.items if dtype is not None or obj.suffix != ".npy"]
    items = [obj for obj in plan.items if dtype is None and obj.suffix == ".npy"]
    if indexed:
        with ThreadPoolExecutor(min(workers, len(indexed)), thread_name_prefix="shmcache-index") as pool:
            for planned in pool.map(lambda obj: plan_object(plan.fs, obj, plan.secrets, dtype), indexed):
                items += planned
    items.sort(key=lambda item: item.key)
    seen: dict[str, str] = {}
    for item in items:
        if item.key in seen:
            raise InvalidSourceError(f"{seen[item.key]} and {item.source} would both become key {item.key!r}")
        seen[item.key] = item.source
    plan.items = items
    if read_headers:
        read_npy_headers(plan, workers)
    return plan


def open_object(fs: Any, item: RemoteItem, secrets: list[str]) -> BinaryIO:
    """The object as a seekable file-like of the size it was listed with; a different size
    now means it changed since it was listed."""
    with remote_errors(item.url, secrets):
        fp = fs.open(item.path, "rb", block_size=BLOCK_SIZE, cache_type="readahead")
    size = getattr(fp, "size", None)
    if isinstance(size, int) and size != item.size:
        fp.close()
        raise CorruptSourceError(
            f"{item.url} changed while loading (it was {item.size} bytes, now {size}); "
            "nothing was published, load it again"
        )
    return cast(BinaryIO, _ObjectFile(fp))  # a seekable binary file, as the readers take


class _ObjectFile(io.RawIOBase):
    """An fsspec file as the readers expect a file: a seek before its start is an
    ``OSError`` (zipfile probes for a zip64 record so), not fsspec's ``ValueError``."""

    def __init__(self, fp: Any) -> None:
        super().__init__()
        self._fp = fp

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        try:
            return int(self._fp.seek(offset, whence))
        except ValueError as exc:
            raise OSError(str(exc)) from None

    def tell(self) -> int:
        return int(self._fp.tell())

    def read(self, size: int | None = -1) -> bytes:
        return bytes(self._fp.read(-1 if size is None else size))

    def readinto(self, buffer: Any) -> int:
        data = self._fp.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._fp.close()
        super().close()


def plan_object(fs: Any, obj: RemoteItem, secrets: list[str], dtype: Any = None) -> list[RemoteItem]:
    """The entries one listed object becomes, from its index alone (``obj.key`` is valid):
    a Megatron pair's ragged entry, a raw token file with ``dtype``, else by its suffix."""
    if obj.companion is not None:
        from .remote_pairs import plan_pair

        with remote_errors(obj.companion.url, secrets):
            return plan_pair(fs, obj, secrets, dtype)
    if dtype is not None:
        token = token_dtype(dtype)
        if obj.size % token.itemsize:
            raise CorruptSourceError(
                f"{obj.url} holds {obj.size} bytes, not a whole number of {token} tokens "
                f"({token.itemsize} bytes each): wrong dtype, or a truncated object"
            )
        return [_range(obj, obj.key, None, token, (obj.size // token.itemsize,), 0)]
    suffix = obj.suffix
    if suffix in (".h5", ".hdf5"):
        return _plan_hdf5(fs, obj, secrets)
    with open_object(fs, obj, secrets) as fp, remote_errors(obj.url, secrets):
        if suffix == ".safetensors":
            from .safetensors import read_safetensors_index

            tensors = read_safetensors_index(fp, obj.size, obj.url)
            return [
                _range(obj, _member_key(obj, t.name), t.name, t.dtype, t.shape, t.offset) for t in tensors
            ]
        if suffix in (".pt", ".pth"):
            from .torch_zip import read_torch_index

            planned = []
            for t in read_torch_index(fp, obj.url):
                item = _range(obj, _member_key(obj, t.name), t.name, t.dtype, t.shape, t.start)
                if not t.contiguous:  # a strided view: gathered from ranged reads, as from pread locally
                    item.decoder = _gather(fs, obj, secrets, t, item)
                planned.append(item)
            return planned
        if suffix == ".npz":
            members = []
            for member in iter_npz_members(fp, obj.url):
                item = _range(obj, _member_key(obj, member.name), f"{member.name}.npy", None, (), 0)
                item.header, item.prefix = member.header, b""
                if member.stored_offset is None:  # compressed: inflated from the remote file-like
                    item.decoder = _inflater(fs, obj, secrets, f"{member.name}.npy", item.source)
                else:
                    item.offset = member.stored_offset
                members.append(item)
            if not members:
                raise InvalidSourceError(f"{obj.url}: the .npz archive holds no .npy arrays")
            return members
    raise AssertionError(f"no remote planner for {suffix}")  # _items takes REMOTE_SUFFIXES only


def _plan_hdf5(fs: Any, obj: RemoteItem, secrets: list[str]) -> list[RemoteItem]:
    """Every dataset of an HDF5 object, checked by h5py reading the remote file-like; each
    then decoded by h5py from a file-like of its own, in slabs written in order."""
    from . import hdf5

    try:
        import h5py  # type: ignore[import-untyped]
    except ImportError:
        raise UnsupportedDataError(
            f"{obj.url}: reading HDF5 needs h5py; install it with pip install 'shmcache[hdf5]'"
        ) from None
    planned = []
    with open_object(fs, obj, secrets) as fp, remote_errors(obj.url, secrets), _h5(h5py, fp, obj.url) as h5:
        for name, dataset in hdf5.walk_datasets(h5py, h5, obj.url):  # every name; no external link
            where = f"{obj.url}[{name}]"
            hdf5._check_storage(h5py, dataset, where)
            if h5py.check_string_dtype(dataset.dtype) is not None and dataset.dtype.kind == "O":
                files, extra = hdf5.decode_strings(dataset, where)  # decoded now, as locally
                planned.append(_decoded_item(obj, _member_key(obj, name), name, "strings", files, extra))
                continue
            dtype, shape = hdf5._check_dataset(h5py, dataset, where)
            item = _range(obj, _member_key(obj, name), name, dtype, shape, 0)
            item.decoder = _slabs(fs, obj, secrets, h5py, name, item)
            planned.append(item)
    if not planned:
        raise CorruptSourceError(f"{obj.url}: the HDF5 file holds no datasets")
    return planned


def _decoded_item(
    obj: RemoteItem, key: str, member: str, kind: str, files: dict[str, np.ndarray], extra: dict[str, Any]
) -> RemoteItem:
    """An entry decoded when planned (an HDF5 strings dataset): its largest file written as the
    item's data file, the others beside it; ``obj`` is still looked up again before publishing."""
    main = max(files, key=lambda name: files[name].nbytes)
    array = np.ascontiguousarray(files[main])
    item = _range(obj, key, member, array.dtype, array.shape, 0)
    item.kind, item.file_name = kind, f"{main}.npy"
    item.files = {name: files[name] for name in files if name != main}
    item.extra = extra | {"shape": [extra["length"]], "dtype": "str"}
    assert item.prefix is not None
    chunks: list[bytes | memoryview] = [item.prefix, array.reshape(-1).view(np.uint8).data]
    item.decoder = lambda: iter(chunks)
    return item


def _h5(h5py: Any, fp: BinaryIO, url: str) -> Any:
    try:
        return h5py.File(fp, "r")
    except (OSError, ValueError) as exc:
        raise CorruptSourceError(f"{url}: not a valid HDF5 file ({exc})") from None


def _slabs(fs: Any, obj: RemoteItem, secrets: list[str], h5py: Any, name: str, item: RemoteItem) -> Any:
    """The built header, then dataset ``name`` read by h5py in slabs of rows (as ``hdf5``)."""
    from . import hdf5

    header = item.checked_header
    assert item.prefix is not None
    prefix, shape, where = item.prefix, header.shape, item.source
    row_bytes = math.prod(shape[1:]) * header.dtype.itemsize
    per_slab = max(1, hdf5._SLAB_BYTES // max(1, row_bytes))

    def chunks() -> Iterator[bytes]:
        yield prefix
        with open_object(fs, obj, secrets) as fp, _h5(h5py, fp, obj.url) as h5:
            dataset = h5.get(name)
            if not isinstance(dataset, h5py.Dataset) or tuple(dataset.shape or ()) != shape:
                raise CorruptSourceError(f"{where} changed after it was checked; nothing was published")
            slabs = [()] if not shape else [slice(i, i + per_slab) for i in range(0, shape[0], per_slab)]
            for slab in slabs:
                yield hdf5._read(dataset, slab, header.dtype, where)  # type: ignore[misc]

    return chunks


def _gather(fs: Any, obj: RemoteItem, secrets: list[str], tensor: Any, item: RemoteItem) -> Any:
    """The built header, then strided ``tensor``'s elements in C order, gathered by
    ``torch_zip.gather_slabs`` (the local reader's slabs) from ranged reads of the object."""
    from .torch_zip import gather_slabs

    assert item.prefix is not None
    prefix, where = item.prefix, item.source

    def read(count: int, offset: int) -> bytes:
        return bytes(read_range(fs, obj, offset, offset + count, secrets, where))

    def chunks() -> Iterator[bytes | memoryview]:
        yield prefix
        yield from gather_slabs(tensor, read)

    return chunks


def _inflater(fs: Any, obj: RemoteItem, secrets: list[str], member: str, where: str) -> Any:
    """The chunks of compressed ``.npz`` member ``member``, inflated from the remote file-like
    as they are read (zipfile checks its CRC at the end): no local copy of the archive."""

    def chunks() -> Iterator[bytes]:
        try:
            with (
                open_object(fs, obj, secrets) as fp,
                zipfile.ZipFile(fp) as archive,
                archive.open(member) as stream,
            ):
                while chunk := stream.read(_INFLATE_CHUNK):
                    yield chunk
        except (zipfile.BadZipFile, EOFError, KeyError, zlib.error) as exc:
            raise CorruptSourceError(f"{where}: {exc}; nothing was published") from None

    return chunks


def _member_key(obj: RemoteItem, name: str) -> str:
    try:
        return validate_key(f"{obj.key}/{name}")
    except ShmCacheError as exc:
        raise type(exc)(f"{obj.url}: {name!r} does not make a valid key ({exc})") from None


def _range(
    obj: RemoteItem,
    key: str,
    member: str | None,
    dtype: np.dtype | None,
    shape: tuple[int, ...],
    offset: int,
) -> RemoteItem:
    """An entry of ``obj``: a built header for ``dtype``/``shape``, then bytes from ``offset``."""
    item = RemoteItem(
        key, obj.path, obj.url, obj.size, obj.identity, None, member=member, offset=offset, suffix=obj.suffix
    )
    if dtype is not None:
        item.prefix = build_header(dtype, shape, False)
        item.header = NpyHeader(dtype, shape, False, len(item.prefix))
    return item


def _check_tables(plan: RemotePlan) -> None:
    """A table plan's objects are all of one format (one table is made of them)."""
    suffixes = sorted({item.suffix for item in plan.items})
    if len(suffixes) > 1:
        raise InvalidSourceError(
            f"{plan.url} holds table objects of several formats ({', '.join(suffixes)}); one table "
            "is made of one format: load each format's objects by a prefix of their own"
        )


def plan_remote_table(key: str, plan: RemotePlan) -> list[PlannedEntry]:
    """Check a table plan without loading it: pyarrow there, and (Parquet) every footer
    readable; the size estimate is the objects'."""
    require_pyarrow(f"table object {plan.url}")
    for item in plan.items:
        if item.suffix == ".parquet":
            import pyarrow.parquet as pq

            with open_object(plan.fs, item, plan.secrets) as fp, remote_errors(item.url, plan.secrets):
                try:
                    pq.ParquetFile(fp)
                except (OSError, ValueError) as exc:  # pyarrow's errors for a bad footer vary by version
                    raise CorruptSourceError(f"{item.url} is not a readable parquet file: {exc}") from None
    return [PlannedEntry(key, plan.url, plan.url, plan.object_bytes)]


def read_remote_table(
    plan: RemotePlan, part_size: int | None = None
) -> tuple[dict[str, FileArray], dict[str, Any]]:
    """A table plan's objects as one table entry's files and meta (several objects: their
    rows in name order, one schema); the redacted URL is its source, with the objects'
    bytes and (one object) its ETag. Each object is one GET, or parallel ranged reads of
    ``part_size``. An object changed while it was read raises."""
    if len(plan.items) == 1:
        item = plan.items[0]
        with _table_bytes(plan, item, part_size) as fp, remote_errors(item.url, plan.secrets):
            files, meta = read_table_file(fp, item.url, item.suffix)
        identity = item.identity
    else:
        files, meta = _read_tables(plan, part_size)
        identity = ""
    check_objects_unchanged(plan, plan.items)
    extra = {"source": plan.url, "source_fingerprint": {"size": plan.object_bytes}}
    extra["source_identity"] = identity
    return files, meta | extra


def _read_tables(plan: RemotePlan, part_size: int | None) -> tuple[dict[str, FileArray], dict[str, Any]]:
    from .._containers.table_arrow import encode_arrow_parts, nullable_schema, read_arrow_table

    pa = require_pyarrow(f"table objects under {plan.url}")
    tables = []
    for item in plan.items:
        with _table_bytes(plan, item, part_size) as fp, remote_errors(item.url, plan.secrets):
            tables.append(read_arrow_table(fp, item.url, item.suffix))
    try:  # fields that differ in their nullable flag only: one table (nullability is not recorded)
        schema = nullable_schema(tables[0].schema) if tables else None
        tables = [t.cast(schema) if nullable_schema(t.schema).equals(schema) else t for t in tables]
        table = pa.concat_tables(tables)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise InvalidSourceError(
            f"{plan.url}: its table objects do not share one schema ({exc}); load each by its own URL"
        ) from None
    return encode_arrow_parts(table, plan.url)


def _table_bytes(plan: RemotePlan, item: RemoteItem, part_size: int | None = None) -> BinaryIO:
    """A table object's bytes in memory, as a file (pyarrow's zero-copy reader where it is
    installed): ONE GET of the whole object, or with ``part_size`` parallel ranged reads of
    that size into one buffer. A table is decoded in memory whole anyway, so the bytes are
    needed at once; reading them through the remote file-like costs a request per block
    pyarrow asks for (measured 0.11x ``s3fs get`` on a 32 MiB Parquet). One stream is what
    ``s3fs get`` does; parallel parts are faster on a store that serves ranges cheaply (S3)
    and far slower on one that copies the whole object for each ranged GET (moto: 0.19x at
    256 MiB with 8 MiB parts). Size and ETag are looked up again after the load."""
    if part_size is not None and 0 < part_size < item.size:
        return _reader(_fetch_parts(plan, item, part_size))
    with remote_errors(item.url, plan.secrets):
        data = plan.fs.cat_file(item.path, start=0, end=item.size) if item.size else b""
    if len(data) != item.size:
        raise CorruptSourceError(
            f"{item.url}: its {item.size} bytes came back as {len(data)} (it was truncated or changed "
            "while loading); nothing was published, load it again"
        )
    return _reader(data)


def _fetch_parts(plan: RemotePlan, item: RemoteItem, part_size: int) -> bytearray:
    """The object's bytes by parallel ranged reads of ``part_size`` into one buffer."""
    buffer = bytearray(item.size)
    view = memoryview(buffer)

    def fetch(start: int) -> None:
        end = min(start + part_size, item.size)
        view[start:end] = read_range(plan.fs, item, start, end, plan.secrets)

    starts = range(0, item.size, part_size)
    with ThreadPoolExecutor(min(DEFAULT_WORKERS, len(starts)), thread_name_prefix="shmcache-table") as pool:
        list(pool.map(fetch, starts))
    return buffer


def _reader(data: bytes | bytearray) -> BinaryIO:
    try:
        import pyarrow as pa
    except ImportError:  # JSON lines without pyarrow: read by the standard library
        return io.BytesIO(data)
    return cast(BinaryIO, pa.BufferReader(pa.py_buffer(data)))
