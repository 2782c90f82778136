"""Blobs: a directory, a list of files or a mapping of byte strings as one entry.

On disk (kind ``"blobs"``): ``bytes.npy`` (uint8, every blob back to back), ``offsets.npy``
(int64, n + 1) and the names as a strings container (``names.*``, with its hash index).

Every source file is checked before any byte is copied (a regular file, readable, beneath
the allowed directories if any, its size from ``fstat``); the caller then reserves the
total, and a few threads copy the files with the kernel, each straight to its own offset,
while a trailing thread checksums the bytes written in order. Tar shards the kernel cannot
copy (another file system) go in order through one buffer, checksummed there, as ``tar -xf``
would. A file that changes between its check and the end of its copy fails the put;
nothing is published.

Names are relative POSIX paths: beneath a directory, the path inside it; for a list of
files, the base names if they are unique, else the paths relative to the files' common
parent directory. A symlink to a file is stored as that file (with allowed directories:
only if it points beneath them); a symlink to a directory is refused.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._containers.encode import encode_strings
from .._disk.checksum import TrailingCrc, crc32
from .._disk.fs import copy_range_at, out_of_descriptors, too_many_open_files, write_all
from .._disk.npy import NpyHeader, build_header, parse_header_bytes
from .._disk.writer import VersionWriter
from ..errors import CorruptSourceError, InvalidSourceError, SourceNotFoundError, UnsupportedDataError
from .files import ArrayFiles, list_array_files
from .source_files import SourceFile, check_unchanged, open_checked, reopen
from .source_files import descriptors_to_hold as _descriptors_to_hold  # tests patch it here

__all__ = [
    "AS_KINDS",
    "COPY_THREADS",
    "BlobSources",
    "directory_fingerprint",
    "plan_blobs",
    "put_kind",
    "tree_fingerprint",
    "write_bytes",
]

AS_KINDS = ("auto", "arrays", "blobs")
"""What a ``put_file`` produces: ``auto`` (blobs for a directory without array files),
``arrays`` (an entry per array file) or ``blobs`` (one entry holding every file)."""

COPY_THREADS = 4
"""Threads copying files: measured 1/2/4/8 on 2 cores (kernel copies and opens overlap)."""
_CRC_BATCH = 1 << 20
_BUFFER = 1 << 20
"""The reused buffer of shards copied in order (where the kernel cannot copy)."""
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)
_kernel_copy: dict[tuple[int, int], bool] = {}
"""``(source device, cache device)`` -> whether ``copy_file_range`` works between them."""

BlobSource = str | os.PathLike[str] | Iterable[str | os.PathLike[str]] | Mapping[str, Any]
Progress = Callable[[int, int], None]
Fetch = Callable[[int, int, Path, TrailingCrc, "Progress | None"], None]


@dataclass
class BlobSources:
    """What a blobs entry will hold, checked: names, sizes, and the files or buffers."""

    source: str | None
    """The directory (or file) packed, for ``meta.json``; None for a list or a mapping."""
    names: list[str]
    sizes: list[int]
    files: list[SourceFile] | None
    """The checked files (None when the blobs come from memory)."""
    buffers: list[memoryview] | None
    arrays: dict[str, np.ndarray]
    """``offsets`` and the ``names.*`` strings files, ready to write."""
    held: list[int] = field(default_factory=list)
    """Descriptors of the first files as they were checked (-1 once used): copying from
    them costs no second open (opens dominate small files); :meth:`close` closes them."""
    spans: list[int] | None = None
    """Where each blob starts in its file (tar members: ``files[i]`` is then the shard, the
    same object for every member of it); None: each blob is a whole file."""
    fetch: Fetch | None = None
    """Blobs read from a URL's objects (``remote_blobs``): ``fetch(dst, base, target, crc,
    progress)`` writes every blob at ``base`` + its offset of ``dst`` and advances ``crc``
    over the bytes in order; ``files`` and ``buffers`` are None then."""

    def close(self) -> None:
        for i, fd in enumerate(self.held):
            if fd >= 0:
                os.close(fd)
                self.held[i] = -1

    def __enter__(self) -> BlobSources:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def size(self) -> int:
        """Bytes the entry's files will take (headers aside)."""
        return sum(self.sizes) + sum(int(a.nbytes) for a in self.arrays.values())


def put_kind(path: Path, as_: str) -> tuple[str, ArrayFiles | None]:
    """``arrays`` or ``blobs``: what ``put_file(path, as_=...)`` makes; and for a directory
    decided by its files (``as_="auto"``), the walk that decided (its array files: what the
    put then plans, with no second walk)."""
    if as_ not in AS_KINDS:
        raise ValueError(f"as_ must be one of {', '.join(AS_KINDS)}; got {as_!r}")
    if as_ != "auto" or not path.is_dir():
        return ("arrays" if as_ == "auto" else as_), None
    listing = list_array_files(path)
    if listing.named and listing.others:
        raise InvalidSourceError(
            f"directory {path} mixes array files and other files; pass --as arrays "
            "(as_='arrays': one entry per array file, the others ignored) or --as blobs "
            "(as_='blobs': every file as bytes in one entry)"
        )
    return ("blobs" if listing.others else "arrays"), listing


def plan_blobs(source: BlobSource, what: str, allowed: Sequence[str | os.PathLike[str]] = ()) -> BlobSources:
    """Check every blob of ``source`` (a directory or file, an iterable of file paths, or
    a mapping of name -> bytes-like) before anything is written."""
    tops = tuple(os.path.realpath(top) for top in allowed)
    if isinstance(source, Mapping):
        return _plan_buffers(source, what)
    if isinstance(source, (str, os.PathLike)):
        path = Path(os.path.abspath(source))
        if path.is_dir():
            found = sorted((name, full) for full, name, _ in _walk(path, ""))
            if not found:
                raise InvalidSourceError(f"directory {path} holds no files to store as blobs")
            return _plan_files(
                [full for _, full in found], [name for name, _ in found], str(path), tops, what
            )
        if not os.path.lexists(path):
            raise SourceNotFoundError(f"source {path} does not exist")
        return _plan_files([str(path)], [path.name], str(path), tops, what)
    if isinstance(source, (bytes, bytearray, memoryview)):
        raise UnsupportedDataError(f"{what}: pass a directory, a list of paths or a mapping name -> bytes")
    paths = [os.path.abspath(os.fspath(p)) for p in source]
    if not paths:
        raise InvalidSourceError(f"{what}: the list of files is empty")
    return _plan_files(paths, _list_names(paths), None, tops, what)


def tree_fingerprint(files: Iterable[SourceFile]) -> dict[str, int]:
    """What ``meta.json`` records of a packed directory so a preload can tell it unchanged:
    how many files, their total size and the latest modification time (and ``"racy": 1``
    if one of them was racily clean: ``source_files.RACY_NS``)."""
    listed = list(files)
    fingerprint = {
        "files": len(listed),
        "size": sum(f.size for f in listed),
        "mtime_ns": max((f.mtime_ns for f in listed), default=0),
    }
    if any(f.racy for f in listed):
        fingerprint["racy"] = 1
    return fingerprint


def directory_fingerprint(path: Path) -> dict[str, int] | None:
    """:func:`tree_fingerprint` of a directory as it is now (stat only, nothing opened);
    None if it cannot be walked."""
    try:
        stats = [os.stat(full) for full, _, _ in _walk(path, "")]
    except (OSError, InvalidSourceError):
        return None
    return {
        "files": len(stats),
        "size": sum(st.st_size for st in stats),
        "mtime_ns": max((st.st_mtime_ns for st in stats), default=0),
    }


def _walk(top: Path, prefix: str, dir_links: bool = True) -> Iterable[tuple[str, str, os.DirEntry[str]]]:
    """``(full path, relative name, entry)`` of every non-directory under ``top``; a link to
    a directory is refused (or, without ``dir_links``, skipped as the arrays walk does)."""
    try:
        with os.scandir(top) as entries:
            listed = list(entries)
    except OSError as exc:
        if out_of_descriptors(exc):
            raise too_many_open_files(exc, f"listing {top}") from exc
        raise
    for entry in listed:
        name = f"{prefix}{entry.name}"
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(Path(entry.path), name + "/", dir_links)
        elif entry.is_symlink() and entry.is_dir():
            if not dir_links:
                continue
            raise InvalidSourceError(
                f"{entry.path} is a symlink to a directory; blobs follow links to files only "
                "(copy the directory in, or pack the directory it points to)"
            )
        else:
            yield entry.path, name, entry


def _list_names(paths: list[str]) -> list[str]:
    names = [os.path.basename(p) for p in paths]
    if len(set(names)) == len(names):
        return names
    parent = os.path.commonpath([os.path.dirname(p) for p in paths])
    names = [os.path.relpath(p, parent) for p in paths]
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise InvalidSourceError(f"{os.path.join(parent, twice)} is listed twice")
    return names


def _check_name(name: Any, where: str) -> str:
    if not isinstance(name, str):
        raise UnsupportedDataError(f"{where}: a blob name must be str, not {type(name).__name__}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidSourceError(f"{where}: the name {name!r} is not valid UTF-8; rename it") from None
    parts = name.split("/")
    if "\0" in name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise InvalidSourceError(
            f"{where}: {name!r} is not a relative path (no NUL, no leading '/', no empty, '.' or '..' part)"
        )
    return name


def _names_arrays(names: list[str], sizes: list[int], what: str) -> dict[str, np.ndarray]:
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(np.asarray(sizes, dtype=np.int64), out=offsets[1:])
    return encode_strings(names, f"{what} names", prefix="names.") | {"offsets": offsets}


def _plan_files(
    paths: list[str], names: list[str], source: str | None, tops: tuple[str, ...], what: str
) -> BlobSources:
    files: list[SourceFile] = []
    held: list[int] = []
    keep = _descriptors_to_hold()
    try:
        "/".join(names).encode("utf-8")  # names from paths are relative already: only UTF-8 to check
    except UnicodeEncodeError:
        for path, name in zip(paths, names, strict=True):
            _check_name(name, path)
    try:
        for path in paths:
            fd, file = open_checked(path, tops)
            if len(held) < keep:
                held.append(fd)
            else:
                os.close(fd)
            files.append(file)
        sizes = [f.size for f in files]
        arrays = _names_arrays(names, sizes, what)
    except BaseException:
        for fd in held:
            os.close(fd)
        raise
    return BlobSources(source, names, sizes, files, None, arrays, held)


def _plan_buffers(mapping: Mapping[str, Any], what: str) -> BlobSources:
    if not mapping:
        raise InvalidSourceError(f"{what}: the mapping is empty")
    names, buffers = [], []
    for name, value in mapping.items():
        _check_name(name, what)
        try:
            view = memoryview(value)
        except TypeError:
            raise UnsupportedDataError(
                f"{what}[{name!r}] is a {type(value).__name__}, not bytes-like "
                "(bytes, bytearray, a uint8 array)"
            ) from None
        if not view.contiguous:
            raise UnsupportedDataError(f"{what}[{name!r}] is not contiguous; pass a contiguous copy")
        names.append(name)
        buffers.append(view.cast("B") if view.ndim != 1 or view.format != "B" else view)
    sizes = [len(b) for b in buffers]
    return BlobSources(None, names, sizes, None, buffers, _names_arrays(names, sizes, what))


def write_bytes(
    writer: VersionWriter,
    version: str,
    plan: BlobSources,
    progress: Progress | None,
    threads: int | None = None,
) -> tuple[int, NpyHeader]:
    """Write ``bytes.npy`` of ``plan`` into ``version`` (``threads`` copying files, default
    :data:`COPY_THREADS`); returns its CRC-32 and header."""
    total = sum(plan.sizes)
    target = writer.path(version, "bytes.npy")
    header = build_header(np.dtype(np.uint8), (total,), False)
    parsed = NpyHeader(*parse_header_bytes(header, len(header), str(target)))
    dst = writer.create_file(version, "bytes.npy")
    try:
        write_all(dst, header, target)
        if plan.spans is not None and plan.files is not None and not _kernel_copies(plan.files, dst):
            if progress is not None:
                progress(0, total)
            return _copy_shards_in_order(plan, dst, header, target, progress), parsed
        crc = TrailingCrc(target)
        try:
            crc.advance(len(header))
            if progress is not None:
                progress(0, total)
            if plan.buffers is not None:
                done = 0
                for buffer in plan.buffers:
                    write_all(dst, buffer, target)
                    crc.advance(len(buffer))
                    done += len(buffer)
                    if progress is not None:
                        progress(done, total)
            elif plan.fetch is not None:
                plan.fetch(dst, len(header), target, crc, progress)
            else:
                assert plan.files is not None
                _FileCopy(plan, dst, len(header), target, crc, progress).run(threads or COPY_THREADS)
            return crc.result(), parsed
        finally:
            crc.close()
    finally:
        os.close(dst)


def _kernel_copies(files: list[SourceFile], dst: int) -> bool:
    """Whether the kernel copies from every shard's file system to ``dst``'s: asked once
    per pair of devices (a copy of 0 bytes), not refused again for every member."""
    dst_dev = os.fstat(dst).st_dev
    for file in dict.fromkeys(files):
        works = _kernel_copy.get((file.dev, dst_dev))
        if works is None:
            src = reopen(file)
            try:
                os.copy_file_range(src, dst, 0)  # nothing copied: only the refusal matters
                works = True
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                works = False
            finally:
                os.close(src)
            _kernel_copy[(file.dev, dst_dev)] = works
        if not works:
            return False
    return True


def _copy_shards_in_order(
    plan: BlobSources, dst: int, header: bytes, target: Path, progress: Progress | None
) -> int:
    """Every member, in order, through one reused buffer in this thread: ``preadv`` of
    members until it is full, its CRC-32, one ``write`` (what ``tar -xf`` does, plus the
    CRC on bytes in cache; threads and a read-back cost more where the kernel cannot copy).
    The bytes checksummed are the bytes written; returns the CRC-32 of the whole file."""
    assert plan.files is not None and plan.spans is not None
    total = sum(plan.sizes)
    view = memoryview(bytearray(max(1, min(_BUFFER, total))))
    crc = crc32(header)
    filled = copied = 0
    shard: SourceFile | None = None
    src = -1

    def flush() -> None:
        nonlocal crc, filled, copied
        chunk = view[:filled]
        crc = crc32(chunk, crc)
        write_all(dst, chunk, target)
        copied += filled
        filled = 0
        if progress is not None:
            progress(copied, total)

    try:
        for file, offset, left in zip(plan.files, plan.spans, plan.sizes, strict=True):
            if file is not shard:
                if shard is not None:
                    check_unchanged(src, shard, same_path=False)  # src is the checked file
                    os.close(src)
                    src = -1
                src, shard = reopen(file), file
            while left:
                if filled == len(view):
                    flush()
                got = os.preadv(src, [view[filled : filled + min(left, len(view) - filled)]], offset)
                if got == 0:
                    raise CorruptSourceError(
                        f"{file.path} changed while loading (it ended at byte {offset}); "
                        "nothing was published, load it again"
                    )
                filled += got
                offset += got
                left -= got
        if filled:
            flush()
        if shard is not None:
            check_unchanged(src, shard, same_path=False)
    finally:
        if src >= 0:
            os.close(src)
    return crc


class _FileCopy:
    """Files copied by a few threads, each to its own offset; the checksum thread is told
    about the prefix of files that are complete, so it reads them in order."""

    def __init__(
        self,
        plan: BlobSources,
        dst: int,
        base: int,
        target: Path,
        crc: TrailingCrc,
        progress: Progress | None,
    ) -> None:
        assert plan.files is not None
        self.files = plan.files
        self.held = plan.held
        self.sizes = plan.sizes
        self.dst, self.base, self.target, self.crc, self.progress = dst, base, target, crc, progress
        self.total = sum(plan.sizes)
        self.starts = np.concatenate(([0], np.cumsum(plan.sizes, dtype=np.int64))).tolist()
        self.complete = bytearray(len(self.files))
        self.frontier = 0  # files [0, frontier) are complete
        self.checksummed = 0  # bytes of them reported to the checksum thread
        self.copied = 0
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.todo = iter(range(len(self.files)))
        self.spans = plan.spans
        self.open: dict[SourceFile, int] = {}
        """Shards being copied from: opened once (checked as when planned), closed after their last member."""
        self.members_left: dict[SourceFile, int] = {}
        if self.spans is not None:
            for file in self.files:
                self.members_left[file] = self.members_left.get(file, 0) + 1

    def run(self, threads: int) -> None:
        workers = [threading.Thread(target=self._work, daemon=True) for _ in range(max(1, threads) - 1)]
        for worker in workers:
            worker.start()
        self._work()
        for worker in workers:
            worker.join()
        for fd in self.open.values():  # after a failure: shards left half copied
            os.close(fd)
        self.open.clear()
        if self.error is not None:
            raise self.error

    def _work(self) -> None:
        try:
            for i in self.todo:
                if self.error is not None:
                    return
                self._copy(i)
                self._done(i)
        except BaseException as exc:
            with self.lock:
                if self.error is None:
                    self.error = exc

    def _copy(self, i: int) -> None:
        file = self.files[i]
        if self.spans is not None:
            self._copy_span(i, file)
            return
        if i < len(self.held):  # the very descriptor that was checked: no second open
            src, self.held[i] = self.held[i], -1
        else:
            src = reopen(file)
        try:
            copy_range_at(src, self.dst, self.base + self.starts[i], self.sizes[i], self.target)
            check_unchanged(src, file, same_path=False)  # src is the checked file (reopen compared it)
        except EOFError as exc:
            raise CorruptSourceError(
                f"{file.path} changed while loading ({exc}); nothing was published"
            ) from exc
        finally:
            os.close(src)

    def _copy_span(self, i: int, file: SourceFile) -> None:
        """Copy blob ``i``, a byte range of ``file`` (a tar member), from the shard's one
        descriptor; after its last member, check the shard is unchanged and close it."""
        assert self.spans is not None
        with self.lock:
            src = self.open.get(file)
            if src is None:
                src = self.open[file] = reopen(file)
        try:
            start, size = self.base + self.starts[i], self.sizes[i]
            copy_range_at(src, self.dst, start, size, self.target, self.spans[i])
        except EOFError as exc:
            raise CorruptSourceError(
                f"{file.path} changed while loading ({exc}); nothing was published"
            ) from exc
        with self.lock:
            self.members_left[file] -= 1
            last = self.members_left[file] == 0
            if last:
                del self.open[file]
        if last:
            try:
                check_unchanged(src, file, same_path=False)  # src is the checked file (reopen compared it)
            finally:
                os.close(src)

    def _done(self, i: int) -> None:
        with self.lock:
            self.complete[i] = 1
            while self.frontier < len(self.complete) and self.complete[self.frontier]:
                self.frontier += 1
            ready = self.starts[self.frontier] - self.checksummed
            if ready >= _CRC_BATCH or (ready and self.frontier == len(self.complete)):
                self.crc.advance(ready)  # in batches: a wake-up per file costs more than its CRC
                self.checksummed += ready
            self.copied += self.sizes[i]
            if self.progress is not None:
                self.progress(self.copied, self.total)
