"""Sources of ``put_file``: every file is checked before any byte is copied (a regular file,
beneath the allowed directories if any are given, a valid header), then copied from the
same file (held open since, or reopened and compared; a directory's small ``.npy`` files
are read whole by the check, a snapshot, as ``cp`` takes one) through a buffer that the
CRC-32 recorded for ``verify`` is computed on (one pass, as ``cp`` reads and writes); a
file that changes while it is read fails the load. Compressed ``.npz`` members
are inflated. Which suffixes are taken, and what each file becomes, is :data:`PLANNERS`
(``array_files`` adds safetensors, torch checkpoints and HDF5)."""

from __future__ import annotations

import os
import stat
import zipfile
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

from .._disk.checksum import crc32
from .._disk.fs import write_all
from .._disk.keys import MAX_KEY_LENGTH, is_key, validate_key
from .._disk.npy import (
    NpyHeader,
    check_written_header,
    header_length,
    iter_npz_members,
    parse_header_bytes,
    read_source_header_fd,
    source_header,
)
from ..errors import CorruptSourceError, InvalidSourceError, ShmCacheError, SourceNotFoundError
from . import array_files
from .array_walk import ArrayFiles, walk_array_files
from .planned import Planned
from .source_files import (
    READ_FLAGS,
    SourceFile,
    check_unchanged,
    descriptors_to_hold,
    open_checked,
    open_plain,
    racy_after,
    reopen,
)
from .tables import is_table_file
from .token_files import is_token_source, plan_token_file

__all__ = [
    "PLANNERS",
    "ArrayFiles",
    "Planned",
    "Planner",
    "array_files_under",
    "copy_planned",
    "list_array_files",
    "plan_sources",
    "planned_bytes",
    "read_planned",
    "release_planned",
]

_SMALL = 4 << 20  # files up to this size are copied through a buffer in the calling thread
_HEAD = 4096  # a planned .npy's first read: its whole header, nearly always
_MAGIC = b"\x93NUMPY"
_KEEP = 64 << 10
"""A directory put's ``.npy`` files up to this size are read whole when checked and their
descriptors closed (``Planned.data``), a snapshot checked by one more ``fstat`` after
that read (no write began meanwhile; one already under way: ``SourceFile.racy``): the
copy is one ``write`` (no second look at the file)."""
_KEEP_TOTAL = 128 << 20
"""At most this many bytes of such files are kept per put (memory stays bounded whatever
the file count: the files beyond are held open, or reopened, as bigger ones are). 128 MiB:
a folder of 100,000 x 1 KiB arrays (115 MB) fits; at 64 MiB its last 42% went through a
reopen, a second ``pread`` and header parse and two more ``stat`` calls each (~13% of that
put's CPU time, measured)."""
_BUFFER = 1 << 20
"""Larger files: one copy through this buffer, checksummed there. It stays in the CPU's
cache between the read, the CRC and the write: a 256 MiB token file from /tmp to /dev/shm
took 0.90x ``cp``'s time, vs 0.62x for the kernel's copy with a trailing thread reading the
copy back for the CRC, and 0.62x with an 8 MiB buffer (7 interleaved runs, 2 busy cores)."""


Planner = Callable[[str, Path, SourceFile, BinaryIO], list[Planned]]
"""``planner(key, path, checked, fp)``: the entries one source file becomes (``fp`` reads
the checked file; ``key`` is valid)."""


def plan_sources(
    key: str,
    path: Path,
    allowed: Sequence[str | os.PathLike[str]] = (),
    dtype: object | None = None,
    *,
    hold: bool = False,
    listing: ArrayFiles | None = None,
) -> list[Planned]:
    """Validate every source file under ``path`` and name the entries they become
    (``key`` must be valid already). With ``allowed`` directories, every file must lie
    beneath one of them once links are resolved, and is later opened without following any.
    ``dtype``, or a Megatron ``.bin``/``.idx``: a token file (``token_files``). ``hold``:
    a directory's small ``.npy`` files are read whole when checked (``Planned.data``, up to
    ``_KEEP_TOTAL`` bytes in all) and the others stay open from their check to their copy
    (``Planned.fd``, up to half the descriptor limit); neither with ``allowed``; the caller
    must :func:`release_planned` the plan. ``listing``: the walk of directory ``path`` made
    when its kind was decided (:func:`list_array_files`), taken as its files."""
    path = Path(os.path.abspath(path))
    if dtype is None and not path.exists() and Path(f"{path}.idx").is_file():
        path = Path(f"{path}.idx")  # a Megatron pair named as Megatron does: by its prefix
    try:
        path.stat()
    except FileNotFoundError:
        raise SourceNotFoundError(f"source {path} does not exist") from None
    except OSError as exc:
        raise InvalidSourceError(f"source {path} cannot be read: {exc.strerror}") from exc
    tops = tuple(os.path.realpath(top) for top in allowed)
    if dtype is not None or is_token_source(path):
        if dtype is not None and (path.is_dir() or path.suffix.lower() in PLANNERS or is_table_file(path)):
            raise InvalidSourceError(
                f"dtype= is for a raw token file (e.g. nanoGPT's train.bin); {path} is a "
                f"{'directory' if path.is_dir() else path.suffix + ' file'}, which says its own dtypes: "
                "put it without dtype"
            )
        return plan_token_file(key, path, dtype, tops)
    plan: list[Planned] = []
    try:
        _plan_sources_unchecked(plan, key, path, tops, hold, listing)
        seen: dict[str, str] = {}
        for item in plan if len({item.key for item in plan}) < len(plan) else ():
            if item.key in seen:
                raise InvalidSourceError(
                    f"{seen[item.key]} and {item.source} would both become key {item.key!r}; "
                    "rename one of them"
                )
            seen[item.key] = item.source
    except BaseException:
        release_planned(plan)
        raise
    return plan


def planned_bytes(plan: Sequence[Planned]) -> int:
    """The bytes ``plan``'s entries will take (``header.file_size`` of each): each header
    object's size computed once (a directory's files share a few; computing one is a
    product over its shape)."""
    last: NpyHeader | None = None
    size = total = 0
    for item in plan:
        header = item.header
        if header is not last:
            last, size = header, header.file_size
        total += size
    return total


def release_planned(plan: Sequence[Planned]) -> None:
    """Close the descriptors ``plan`` still holds and drop the bytes it kept
    (``plan_sources(hold=True)``): after its put, whether the put copied every item or failed."""
    for item in plan:
        item.data = None
        if item.fd is not None:
            fd, item.fd = item.fd, None
            os.close(fd)


def _plan_sources_unchecked(
    plan: list[Planned], key: str, path: Path, tops: tuple[str, ...], hold: bool, listing: ArrayFiles | None
) -> None:
    """Append to ``plan`` (which holds the descriptors kept so far, should this raise)."""
    if not path.is_dir():
        single = str(path)
        if _suffix(path.name).lower() == ".npy":
            plan.append(_plan_npy_fd(key, single, tops, {}))
        else:
            plan.extend(_plan_file(key, path, tops))
        return
    top = str(path)
    # confined (``allowed``): reopened beneath the allowed directory, which refuses a
    # file swapped for a link out with SourceNotAllowedError rather than copy the old one
    budget = descriptors_to_hold() if hold and not tops else 0
    keep = _KEEP_TOTAL if hold and not tops else 0  # bytes of small files read whole
    headers: dict[bytes, tuple[NpyHeader, int]] = {}
    base = top if top.endswith("/") else f"{top}/"
    found = (listing if listing is not None and listing.top == top else walk_array_files(top, PLANNERS)).files
    children = _child_keys(key, found, base)
    if not tops:  # the common case: each .npy in a few calls, nothing per file but its plan
        _plan_plain(plan, found, children, base, budget, keep)
    for (relative, lower), child in zip(found, children, strict=True) if tops else ():
        file = base + relative  # absolute and normal: names from a walk
        if lower == ".npy":  # without a Path or a Python file object
            plan.append(_plan_npy_fd(child, file, tops, headers))
        else:
            plan.extend(_plan_file(child, Path(file), tops))
    if not plan:
        raise InvalidSourceError(f"directory {path} holds no {_suffixes()} files")


def array_files_under(top: Path) -> list[Path]:
    """The files under directory ``top`` that a ``put_file`` of it takes (their suffix has
    a planner), in the order it takes them."""
    base = str(top)
    return [Path(f"{base}/{relative}") for relative, _ in walk_array_files(base, PLANNERS).files]


def _suffix(name: str) -> str:
    """``name``'s suffix as ``put_file`` reads it (a leading dot starts no suffix)."""
    return name[name.rfind(".") :] if name.rfind(".") > 0 else ""


def list_array_files(top: str | os.PathLike[str]) -> ArrayFiles:
    """One walk of directory ``top`` (:class:`~.array_walk.ArrayFiles`): its files whose
    suffix has a planner, in the order a put takes them."""
    return walk_array_files(os.path.abspath(top), PLANNERS)


def _child_keys(key: str, found: Sequence[tuple[str, str]], base: str) -> list[str]:
    """``key/<relative path without suffix>`` of each file ``found`` under ``base``, all
    validated by one match of the joined names (a file name holds no ``/``, so the joined
    segments are the keys' own) and one length check; the first invalid one raises as
    :func:`_child_key` does, naming its file."""
    stems = [relative[: -len(lower)] for relative, lower in found]
    if stems and (len(key) + 1 + max(map(len, stems)) > MAX_KEY_LENGTH or not is_key("/".join(stems))):
        for relative, stem in zip(found, stems, strict=True):
            _child_key(key, stem, base + relative[0])
    return [f"{key}/{stem}" for stem in stems]


def _child_key(key: str, relative: str, file: str | Path) -> str:
    child = f"{key}/{relative}"
    try:
        return validate_key(child)
    except ShmCacheError as exc:
        raise type(exc)(f"{file}: its path does not make a valid key ({exc})") from None


def _plan_file(key: str, path: Path, tops: tuple[str, ...]) -> list[Planned]:
    planner = PLANNERS.get(path.suffix.lower())
    if planner is None:
        raise CorruptSourceError(
            f"{path}: not a {_suffixes()} file (or a directory of them); a raw token file needs "
            "its dtype (dtype='uint16', `--dtype uint16`)"
        )
    fd, file = open_checked(str(path), tops)
    with open(fd, "rb") as fp:  # closes fd
        return planner(key, path, file, fp)


def _plan_npy_fd(
    key: str, path: str, tops: tuple[str, ...], headers: dict[bytes, tuple[NpyHeader, int]]
) -> Planned:
    """A ``.npy`` checked through one ``open``, ``fstat`` and ``pread`` of its header (``path``
    is absolute and normal), then closed (a single file, or a confined directory's: the copy
    reopens it). ``headers``: those parsed so far in this plan, by their bytes."""
    fd, file = open_checked(path, tops, absolute=True) if tops else open_plain(path)
    try:
        head = os.pread(fd, min(file.size, _HEAD), 0)
        header, _ = _npy_header(fd, head, file.size, path, headers)
    finally:
        os.close(fd)
    return Planned(key, header, path, file, 0)


def _plan_plain(
    plan: list[Planned],
    found: Sequence[tuple[str, str]],
    children: Sequence[str],
    base: str,
    budget: int,
    keep: int,
) -> None:
    """Plan the files ``found`` under ``base`` (no allowed directories): each ``.npy`` is
    checked as :func:`_plan_npy_fd` checks one, then held open while ``budget`` descriptors
    last, or read whole while ``keep`` bytes last (``Planned.fd``, ``Planned.data``): one
    ``open``, ``fstat``, ``pread`` (and, read whole, an ``fstat`` showing the same size
    and time stamps: no write began meanwhile) and ``close`` (no ``close`` if held) and a look-up of its
    header bytes among those parsed already; anything unusual (not a regular file, an
    unseen header, a short read) goes through the checked calls, which raise the typed
    errors. Other suffixes: their planner."""
    headers: dict[bytes, tuple[NpyHeader, int]] = {}
    open_, fstat, pread, close, is_reg = os.open, os.fstat, os.pread, os.close, stat.S_ISREG
    new = tuple.__new__  # a SourceFile without its keyword-taking __new__: ~4x cheaper
    append = plan.append
    racy = racy_after()  # once for all: earlier than any file's read (SourceFile.racy)
    limit = min(keep, _KEEP)  # the largest file read whole now
    most = _KEEP
    last_raw, last = b"", None  # the header bytes the last file began with, and what they say
    for (relative, lower), child in zip(found, children, strict=True):
        path = base + relative  # absolute and normal: names from a walk
        if lower != ".npy":
            plan.extend(_plan_file(child, Path(path), ()))
            continue
        try:
            fd = open_(path, READ_FLAGS)
        except OSError:
            fd = -1
        if fd < 0:
            fd, file = open_checked(path, absolute=True)  # its typed error, or (a race) the file
        else:
            try:
                st = fstat(fd)
            except BaseException:
                close(fd)
                raise
            if not is_reg(st.st_mode):
                close(fd)
                fd, file = open_checked(path, absolute=True)
            else:
                mt = st.st_mtime_ns
                fields = (path, path, None, st.st_dev, st.st_ino, st.st_size, mt, st.st_ctime_ns, mt > racy)
                file = new(SourceFile, fields)
        size = file.size
        whole = size <= limit
        try:
            head = pread(fd, size if whole else min(size, _HEAD), 0)
            # bytes equal to a header parsed already (format 1.0: its length at 8-9) are valid:
            # those the last file began with (nearly always: one test, no slice), or any
            if last is not None and head.startswith(last_raw) and size >= last[1]:
                header, file_size = last
            else:
                known = None
                if len(head) >= 12 and head[6] == 1:
                    raw = head[: 10 + (head[8] | head[9] << 8)]
                    known = headers.get(raw)
                    if known is not None:
                        last_raw, last = raw, known
                if known is None or size < known[1]:
                    known = _npy_header(fd, head, size, path, headers)
                header, file_size = known
            if whole:
                if len(head) != file_size:
                    head = _whole_file(head, file_size, file)
                after = fstat(fd)  # no write began since the fstat (one under way: file.racy)
                if after.st_mtime_ns != file.mtime_ns or after.st_ctime_ns != file.ctime_ns:
                    raise _changed_while_read(file)
                if after.st_size != size:
                    raise _changed_while_read(file)
        except BaseException:
            close(fd)
            raise
        if whole:
            close(fd)
            keep -= file_size
            limit = keep if keep < most else most
            append(Planned(child, header, path, file, 0, None, "", None, None, None, None, head))
        elif budget > 0:
            budget -= 1
            append(Planned(child, header, path, file, 0, None, "", None, None, None, fd))
        else:
            close(fd)
            append(Planned(child, header, path, file, 0))


def _changed_while_read(file: SourceFile) -> CorruptSourceError:
    return CorruptSourceError(
        f"{file.path} changed while loading (it was written to while read); nothing was "
        "published, load it again"
    )


def _whole_file(head: bytes, size: int, file: SourceFile) -> bytes:
    """The entry's bytes out of a small file read whole: its first ``size`` (the header's
    ``file_size``; a file that shrank while read fails as changed)."""
    if len(head) < size:
        raise CorruptSourceError(
            f"{file.path} changed while loading (it ended at byte {len(head)}, expected {size}); "
            "nothing was published, load it again"
        )
    return head if len(head) == size else head[:size]


def _npy_header(
    fd: int, head: bytes, size: int, where: str, headers: dict[bytes, tuple[NpyHeader, int]]
) -> tuple[NpyHeader, int]:
    """``read_source_header_fd`` given the file's first bytes ``head``, and the header's
    ``file_size``; each distinct header parsed once per plan (and its size computed once):
    a directory's files mostly share a few (parsing one is ~15 us, more than the rest of
    its check). The same bytes give the same header; only the file's size is checked again."""
    if len(head) >= 12 and head[:6] == _MAGIC and head[6] in (1, 2) and head[7] == 0:
        end = header_length(head, where)
        if end <= len(head):
            raw = head[:end]
            known = headers.get(raw)
            if known is not None and size >= known[1]:
                return known
            header = source_header(head, size, where)
            found = headers[raw] = (header, header.file_size)
            return found
    header = read_source_header_fd(fd, size, where)
    return header, header.file_size


def _plan_npy(key: str, path: Path, file: SourceFile, fp: BinaryIO) -> list[Planned]:
    header = read_source_header_fd(fp.fileno(), file.size, str(path))
    return [Planned(key, header, str(path), file, 0)]


def _plan_npz(key: str, path: Path, file: SourceFile, fp: BinaryIO) -> list[Planned]:
    members = [
        Planned(
            key=_child_key(key, member.name, path),
            header=member.header,
            source=f"{path}[{member.name}.npy]",
            file=file,
            copy_offset=member.stored_offset,
            member=member.name,
        )
        for member in iter_npz_members(fp, str(path))
    ]
    if not members:
        raise InvalidSourceError(f"{path}: the .npz archive holds no .npy arrays")
    return members


PLANNERS: dict[str, Planner] = {
    ".npy": _plan_npy,
    ".npz": _plan_npz,
    **array_files.PLANNERS,
}
"""Every file suffix ``put_file`` takes (lower case), and what makes its entries; a
directory put collects the files whose suffix is here."""


def _suffixes() -> str:
    names = sorted(PLANNERS)
    return ", ".join(names[:-1]) + " or " + names[-1]


def copy_planned(
    item: Planned, dst: int, target: str | Path, advance: Callable[[int], None], *, check_header: bool = True
) -> int:
    """Copy one planned ``.npy`` to the end of ``dst`` from the very file that was checked;
    returns the CRC-32 of the bytes written (``target`` names ``dst`` in errors). A source
    that changed since it was checked, or while it was copied, raises
    :class:`CorruptSourceError`. ``check_header=False``: the writer cannot read ``target``
    back (a team member fills a daemon's file, which the daemon checks itself). A
    descriptor the plan held (``item.fd``) is copied from and closed; its file is the one
    checked by construction. Bytes the plan read whole (``item.data``) are written as they
    are: a snapshot of the file (its header parsed from these very bytes, its size and time
    stamps the same before and after that one read: no write began meanwhile; one already
    under way is caught by the racily-clean rule, ``SourceFile.racy``, at the next
    up-to-date check); a later change of the file does not alter the entry, whose
    recorded fingerprint is that of the snapshot."""
    if item.data is not None:  # read whole and checked when planned (``_plan_plain``)
        data, item.data = item.data, None
        crc = crc32(data)
        _write_small(dst, data, target)
        advance(len(data))
        return crc
    held, item.fd = item.fd, None
    src = reopen(item.file) if held is None else held
    try:
        if item.write is not None:
            crc = item.write(src, dst, Path(target), advance)
        elif item.copy_offset is not None and item.header.file_size <= _SMALL:
            crc = _copy_small(item, src, dst, target, advance)
            check_unchanged(src, item.file)
            return crc
        elif item.copy_offset is None:
            crc = _inflate_member(item, src, dst, target, advance)
        else:
            crc = _copy_buffered(item, src, dst, target, advance)
        check_unchanged(src, item.file)
    finally:
        os.close(src)
    if check_header:
        check_written_header(target, item.header, item.source)
    return crc


def read_planned(item: Planned, advance: Callable[[int], None]) -> tuple[bytes, int]:
    """A small planned ``.npy``'s whole bytes, from the very file that was checked, and
    their CRC-32 (what :func:`copy_planned` would write, for a directory put that packs
    them into its manifest). ``item`` is a byte copy (``copy_offset`` set, no ``write``)
    of at most a few MiB; the same checks as :func:`copy_planned`'s."""
    if item.data is not None:  # read whole and checked when planned (``_plan_plain``)
        data, item.data = item.data, None
    else:
        held, item.fd = item.fd, None
        src = reopen(item.file) if held is None else held
        try:
            data = _read_small(item, src)
            check_unchanged(src, item.file)
        finally:
            os.close(src)
    advance(len(data))
    return data, crc32(data)


def _write_small(dst: int, data: bytes, target: str | Path) -> None:
    """``write_all`` of a small buffer: one ``write``; ``write_all``'s view and loop only
    for the rest of a short write, or to raise the typed error of a failed one (a failed
    ``write`` wrote nothing: it is tried again there)."""
    try:
        done = os.write(dst, data)
    except OSError:
        done = 0
    if done < len(data):
        write_all(dst, memoryview(data)[done:], target)


def _copy_small(item: Planned, src: int, dst: int, target: str | Path, advance: Callable[[int], None]) -> int:
    """A small file in one ``pread`` and one ``write`` from this thread, checksummed in
    between: the bytes written are the buffer checksummed, and their header is checked
    in the buffer (a thread and a read-back cost more than the copy itself)."""
    data = _read_small(item, src)
    crc = crc32(data)
    write_all(dst, data, target)
    advance(len(data))
    return crc


def _read_small(item: Planned, src: int) -> bytes:
    """A small planned ``.npy``'s bytes in one ``pread`` (a built header, then the raw
    payload, for an item with a ``prefix``), their header checked against the plan's."""
    assert item.copy_offset is not None
    size = item.header.file_size
    if item.prefix is None:
        data = os.pread(src, size, item.copy_offset)
    else:  # a built header, then the raw payload
        data = item.prefix + os.pread(src, item.header.nbytes, item.copy_offset)
    if len(data) != size:
        raise CorruptSourceError(
            f"{item.source} changed while loading (it ended at byte {len(data)}, expected "
            f"{size}); nothing was published, load it again"
        )
    try:  # the memoized parser of the attach path: the header was validated when planned
        written = NpyHeader(*parse_header_bytes(data, item.header.data_offset, item.source))
    except ShmCacheError:
        written = None
    if written != item.header:
        raise CorruptSourceError(f"{item.source} changed while loading; nothing was published, load it again")
    return data


def _copy_buffered(
    item: Planned, src: int, dst: int, target: str | Path, advance: Callable[[int], None]
) -> int:
    """One copy through a reused buffer, checksummed there: ``pread``, CRC-32, ``write``, in
    the calling thread (what ``cp`` does, plus the CRC on bytes already in cache); the
    bytes checksummed are the bytes written."""
    assert item.copy_offset is not None
    crc = 0
    if item.prefix is not None:  # a built header, then the raw payload
        write_all(dst, item.prefix, target)
        crc = crc32(item.prefix)
        advance(len(item.prefix))
        offset, end = item.copy_offset, item.copy_offset + item.header.nbytes
    else:
        offset, end = item.copy_offset, item.copy_offset + item.header.file_size
    view = memoryview(bytearray(max(1, min(_BUFFER, end - offset))))
    while offset < end:
        got = os.preadv(src, [view[: min(len(view), end - offset)]], offset)
        if got == 0:
            raise CorruptSourceError(
                f"{item.source} changed while loading (it ended at byte {offset}, expected {end}); "
                "nothing was published, load it again"
            )
        chunk = view[:got]
        crc = crc32(chunk, crc)
        write_all(dst, chunk, target)
        advance(got)
        offset += got
    return crc


def _inflate_member(
    item: Planned, src: int, dst: int, target: str | Path, advance: Callable[[int], None]
) -> int:
    """Copy a compressed ``.npz`` member (zipfile checks its CRC while inflating);
    returns the CRC-32 of what was written."""
    written = 0
    crc = 0
    try:
        with (
            open(os.dup(src), "rb") as fp,
            zipfile.ZipFile(fp) as archive,
            archive.open(f"{item.member}.npy") as member,
        ):
            while chunk := member.read(16 << 20):
                piece = chunk[: item.header.file_size - written]
                write_all(dst, piece, target)
                crc = crc32(piece, crc)
                written += len(piece)
                advance(len(piece))
                if written >= item.header.file_size:
                    break
    except (zipfile.BadZipFile, EOFError, KeyError, zlib.error) as exc:
        raise CorruptSourceError(f"{item.source}: {exc}") from exc
    if written < item.header.file_size:
        raise CorruptSourceError(f"{item.source}: truncated member ({written} bytes)")
    return crc
