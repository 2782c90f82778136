"""The ``.npy`` format: building headers, parsing them fast, validating sources.

Entries are stored as standard ``.npy`` files, so any tool can read them. The hot
path parses the header numpy itself writes with one regular expression (about a
microsecond) instead of ``ast.literal_eval`` (about 20 us), and falls back to numpy's
own parser for anything unusual.
"""

from __future__ import annotations

import io
import math
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, NamedTuple

import numpy as np
import numpy.lib.format as npy_format

from ..errors import CorruptEntryError, CorruptSourceError, ShmCacheError, UnsupportedDataError
from .shapes import checked_shape

if TYPE_CHECKING:
    import zipfile

__all__ = [
    "NpyHeader",
    "NpzMember",
    "build_header",
    "check_storable_dtype",
    "check_written_header",
    "header_length",
    "iter_npz_members",
    "parse_header_bytes",
    "read_source_header",
    "read_source_header_fd",
    "source_header",
    "zip_data_offset",
]

_MAGIC = b"\x93NUMPY"
_MAX_HEADER_SIZE = 1 << 20  # numpy's default (10000) rejects wide structured dtypes
_CANONICAL_HEADER = re.compile(
    rb"\{'descr': '([^']+)', 'fortran_order': (False|True), 'shape': \(([0-9, ]*)\), \} *\n\Z"
)
_CANONICAL_DIMS = re.compile(rb"\A(?:[0-9]+,|[0-9]+(?:, [0-9]+)+)?\Z")  # (), (3,), (2, 3)
_MAX_NESTING = 64  # a dtype nested 30 structs deep still fits
_QUOTED = re.compile(rb"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"([{)]}")
_OPENERS = np.frombuffer(b"([{", dtype=np.uint8)
_SOURCE_HEAD = 4096  # first read of a source: its whole header, nearly always
_MEMO_LIMIT = 4096
_DTYPES: dict[bytes, np.dtype] = {}  # descr text -> dtype
_SHAPES: dict[bytes, tuple[int, ...]] = {}  # shape text -> shape
# Whole header -> parsed (entries of one dataset share theirs): a cold open of another
# key skips the regex. Only what parsed is kept; the buffer-size check stays per file.
_HEADERS: dict[bytes, tuple[np.dtype, tuple[int, ...], bool, int]] = {}


class NpyHeader(NamedTuple):
    """What a ``.npy`` header says, plus where its payload starts (a tuple: cheap to make)."""

    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool
    data_offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def file_size(self) -> int:
        return self.data_offset + self.nbytes


def check_storable_dtype(dtype: np.dtype, what: str) -> None:
    """Refuse dtypes that would need pickling (objects, also inside structured fields)."""
    if dtype.hasobject:
        raise UnsupportedDataError(
            f"{what} has dtype {dtype!r}, which holds Python objects and cannot be shared "
            "without pickling; convert it to numbers or fixed-width strings first "
            "(e.g. arr.astype('U') or shmcache strings/records)"
        )


def build_header(dtype: np.dtype, shape: tuple[int, ...], fortran_order: bool) -> bytes:
    """The ``.npy`` header numpy would write for an array of this dtype/shape/order."""
    fields = {
        "descr": npy_format.dtype_to_descr(dtype),
        "fortran_order": fortran_order,
        "shape": tuple(shape),
    }
    for write in (npy_format.write_array_header_1_0, npy_format.write_array_header_2_0):
        buffer = io.BytesIO()
        try:
            write(buffer, fields)
        except UnicodeEncodeError as exc:  # (a ValueError too: must come first)
            raise UnsupportedDataError(
                f"dtype {dtype!r} has field names that are not latin-1 (that needs .npy "
                "format 3.0, which shmcache does not write); rename the fields"
            ) from exc
        except ValueError:  # header too long for format 1.0
            continue
        return buffer.getvalue()
    raise UnsupportedDataError(f"dtype {dtype!r} is too large to describe in a .npy header")


def _dtype_from_descr(descr: bytes, where: str) -> np.dtype:
    dtype = _DTYPES.get(descr)
    if dtype is None:
        try:
            dtype = np.dtype(descr.decode("ascii"))
        except (TypeError, ValueError, UnicodeDecodeError) as exc:
            raise CorruptEntryError(f"{where} has a damaged .npy header (dtype {descr!r})") from exc
        if len(_DTYPES) >= _MEMO_LIMIT:
            _DTYPES.clear()
        _DTYPES[descr] = dtype
    return dtype


def header_length(head: bytes, where: str) -> int:
    """Total header bytes (magic included) from the first 12 bytes of a ``.npy`` file."""
    if len(head) < 12 or head[:6] != _MAGIC:
        raise CorruptEntryError(f"{where} is not a .npy file (bad magic); evict and put it again")
    if head[6] == 1:
        return 10 + (head[8] | head[9] << 8)
    return 12 + int.from_bytes(head[8:12], "little")


def parse_header_bytes(head: bytes, end: int, where: str) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """Parse a ``.npy`` header of ``end`` bytes (``head`` holds at least that many).

    Returns ``(dtype, shape, fortran_order, data_offset)`` as a plain tuple (this is
    the attach hot path). Damage raises :class:`CorruptEntryError`.
    """
    raw = head if len(head) == end else head[:end]
    parsed = _HEADERS.get(raw)
    if parsed is not None:  # the same header bytes parse the same (a pure function of them)
        return parsed
    match = _CANONICAL_HEADER.match(head, 10 if head[6] == 1 else 12, end)
    if match is None:
        return tuple(_parse_header_slowly(raw, where))  # type: ignore[return-value]
    descr, fortran, dims = match.groups()
    shape = _SHAPES.get(dims)
    if shape is None:
        shape = _shape_from_text(dims)
    parsed = (_dtype_from_descr(descr, where), shape, fortran == b"True", end)
    if len(_HEADERS) >= _MEMO_LIMIT:
        _HEADERS.clear()
    _HEADERS[raw] = parsed
    return parsed


def _shape_from_text(dims: bytes) -> tuple[int, ...]:
    """``b"64, 256"`` -> ``(64, 256)``, remembered (a pure function of the text)."""
    digits = dims.replace(b" ", b"").rstrip(b",")
    shape = tuple(map(int, digits.split(b","))) if digits else ()
    if len(_SHAPES) >= _MEMO_LIMIT:
        _SHAPES.clear()
    _SHAPES[dims] = shape
    return shape


def _parse_header_slowly(raw: bytes, where: str) -> NpyHeader:
    try:
        return _read_header(io.BytesIO(raw))
    except ValueError as exc:
        raise CorruptEntryError(f"{where} has a damaged .npy header ({exc})") from exc


def _read_header(fp: BinaryIO) -> NpyHeader:
    """Read magic and header from ``fp`` with ``allow_pickle=False`` semantics.

    Whatever numpy's parser raises on damaged input (ValueError, SyntaxError,
    tokenize.TokenError, EOFError...) comes out as ValueError. A header nested deeper
    than any dtype is refused before numpy's parser sees it (``_check_nesting``).
    """
    try:
        version = npy_format.read_magic(fp)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f".npy format version {version[0]}.{version[1]} is not supported")
        length_bytes = fp.read(2 if version == (1, 0) else 4)
        header = fp.read(min(int.from_bytes(length_bytes, "little"), _MAX_HEADER_SIZE + 1))
        _check_nesting(header)
        read = npy_format.read_array_header_1_0 if version == (1, 0) else npy_format.read_array_header_2_0
        buffer = io.BytesIO(length_bytes + header)
        shape, fortran, dtype = read(buffer, _MAX_HEADER_SIZE)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from exc
    _check_shape(tuple(shape), dtype)
    return NpyHeader(dtype, tuple(shape), bool(fortran), npy_format.MAGIC_LEN + buffer.tell())


def _check_nesting(header: bytes) -> None:
    """Refuse a header whose brackets nest over ``_MAX_NESTING`` deep (outside its quoted
    names): numpy's parser takes seconds per 100 KB of them, then refuses anyway."""
    brackets = _QUOTED.sub(b"", header).translate(None, _NOT_BRACKETS)
    if len(brackets) <= _MAX_NESTING:
        return
    codes = np.frombuffer(brackets, dtype=np.uint8)
    depth = np.cumsum(np.where(np.isin(codes, _OPENERS), 1, -1))
    if int(depth.max()) > _MAX_NESTING:
        raise ValueError(f"the header nests brackets over {_MAX_NESTING} deep")


def _check_shape(shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Refuse what numpy cannot make an array of, even an empty one (``shapes``)."""
    checked_shape(shape, dtype.itemsize, "the header", ValueError)


def check_written_header(path: str | os.PathLike[str], expected: NpyHeader, source: str) -> None:
    """The header written at the start of ``path`` is ``expected``, the one the entry's
    metadata is built from: a source rewritten between its check and its copy could
    otherwise publish bytes ``meta.json`` misdescribes. :class:`CorruptSourceError` naming
    ``source`` if not."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        head = os.pread(fd, expected.data_offset, 0)
    finally:
        os.close(fd)
    try:
        written: NpyHeader | None = read_source_header(io.BytesIO(head), expected.file_size, source)
    except ShmCacheError:
        written = None
    if written != expected:
        raise CorruptSourceError(f"{source} changed while loading; nothing was published, load it again")


def read_source_header(fp: BinaryIO, size: int, where: str) -> NpyHeader:
    """Validate a source ``.npy`` stream of ``size`` bytes; return its header.

    Truncation, a corrupt header and object dtypes raise typed errors naming ``where``.
    """
    try:
        header = _read_header(fp)
    except ValueError as exc:
        raise CorruptSourceError(f"{where}: not a valid .npy file ({exc})") from exc
    return _checked_source(header, size, where)


def source_header(head: bytes, size: int, where: str) -> NpyHeader:
    """:func:`read_source_header` of a source whose first bytes (its whole header at
    least, or the whole file) are ``head``. Headers as numpy writes them are parsed with
    one regular expression (~5 us, not ~50 us for ``ast.literal_eval``); anything else goes
    through numpy's strict parser, so both accept and refuse the same files."""
    if len(head) >= 12 and head[:6] == _MAGIC and head[6] in (1, 2) and head[7] == 0:
        end = header_length(head, where)
        match = _CANONICAL_HEADER.match(head, 10 if head[6] == 1 else 12, end) if end <= len(head) else None
        if match is not None and _CANONICAL_DIMS.match(match[3]):
            try:
                dtype = np.dtype(match[1].decode("ascii"))
                shape = tuple(int(d) for d in match[3].split(b",") if d.strip())
                _check_shape(shape, dtype)
            except (TypeError, ValueError, UnicodeDecodeError):
                pass  # numpy's parser says why
            else:
                return _checked_source(NpyHeader(dtype, shape, match[2] == b"True", end), size, where)
    return read_source_header(io.BytesIO(head), size, where)


def read_source_header_fd(fd: int, size: int, where: str) -> NpyHeader:
    """:func:`read_source_header` of the source open as ``fd`` (read with ``pread``)."""
    head = os.pread(fd, min(size, _SOURCE_HEAD), 0)
    if len(head) >= 12 and head[:6] == _MAGIC:
        end = header_length(head, where)
        if len(head) < end <= min(size, _MAX_HEADER_SIZE + 12):
            head += os.pread(fd, end - len(head), len(head))
    return source_header(head, size, where)


def _checked_source(header: NpyHeader, size: int, where: str) -> NpyHeader:
    check_storable_dtype(header.dtype, where)
    if size < header.file_size:
        raise CorruptSourceError(
            f"{where}: truncated .npy file: the header promises {header.file_size} bytes "
            f"({header.shape} of {header.dtype}) but the file has {size}"
        )
    return header


@dataclass(frozen=True)
class NpzMember:
    """One ``.npy`` inside an ``.npz``: where its bytes are, and its header."""

    name: str
    header: NpyHeader
    stored_offset: int | None
    """Offset of the member's ``.npy`` in the zip file when stored uncompressed, else None."""


def pread_from(src: int | BinaryIO, nbytes: int, offset: int) -> bytes:
    """``nbytes`` from ``offset`` of a descriptor (``pread``) or of a seekable file-like (a
    remote object opened through fsspec: one ranged read)."""
    if isinstance(src, int):
        return os.pread(src, nbytes, offset)
    src.seek(offset)
    return src.read(nbytes)


def zip_data_offset(fd: int | BinaryIO, info: zipfile.ZipInfo) -> int:
    """Where the stored bytes of zip member ``info`` start in the file open as ``fd`` (a
    descriptor or a seekable file-like)."""
    import zipfile  # deferred: only .npz and torch sources need it (import time of the open path)

    local = pread_from(fd, 30, info.header_offset)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"bad local header for {info.filename}")
    name_len = int.from_bytes(local[26:28], "little")
    extra_len = int.from_bytes(local[28:30], "little")
    return info.header_offset + 30 + name_len + extra_len


def _descriptor_or(fp: BinaryIO) -> int | BinaryIO:
    """``fp``'s descriptor when it has one (``pread`` leaves its position alone), else ``fp``."""
    try:
        return fp.fileno()
    except (OSError, AttributeError):  # io.UnsupportedOperation: a remote file-like
        return fp


def iter_npz_members(fp: BinaryIO, path: str) -> Iterator[NpzMember]:
    """Validate every ``.npy`` member of the ``.npz`` open as ``fp`` (a file; non-``.npy``
    members are skipped); errors name ``path``."""
    import zipfile  # deferred: only .npz sources need it (import time of the open path)

    try:
        with zipfile.ZipFile(fp) as archive:
            seen: set[str] = set()
            for info in archive.infolist():
                if info.is_dir() or not info.filename.endswith(".npy"):
                    continue
                if info.filename in seen:  # the copy opens members by name: the last of them
                    raise CorruptSourceError(
                        f"{path}: the archive holds two members named {info.filename!r}: crafted or corrupt"
                    )
                seen.add(info.filename)
                where = f"{path}[{info.filename}]"
                with archive.open(info) as member:
                    header = read_source_header(member, info.file_size, where)  # type: ignore[arg-type]
                stored = None
                if info.compress_type == zipfile.ZIP_STORED:
                    stored = zip_data_offset(_descriptor_or(fp), info)
                yield NpzMember(info.filename[: -len(".npy")], header, stored)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error) as exc:
        raise CorruptSourceError(f"{path}: not a valid .npz archive ({exc})") from exc
    except NotImplementedError as exc:  # unsupported compression method
        raise CorruptSourceError(f"{path}: {exc}") from exc
