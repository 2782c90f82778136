"""Tar shards (WebDataset's layout) as one blobs entry: every member a blob, names kept.

A source is one ``.tar`` file, a list of them, or a pattern naming them: a glob
(``shards/*.tar``) or a brace pattern (``shards/{000..099}.tar``, ``{train,val}-{0..9}.tar``;
at most :data:`MAX_EXPANSIONS` names). Only the headers are read in Python (the stdlib
``tarfile`` parser over ``pread``: GNU long names and pax headers included); each member's
bytes are then copied by the kernel from its range in the shard (``blobs.write_bytes``),
never extracted to disk, never held whole in memory.

Hostile input is refused before any byte is copied, and nothing is published: a truncated
archive (a member past the end, no end-of-archive blocks), headers that go backwards or
more of them than the file has room for, a long name or pax record over 1 MiB, names
that are not relative paths (``../x``, ``/etc/x``), a name twice (within or across
shards), links, devices, FIFOs and sparse members (shards hold regular files; directories
are skipped). Compressed shards (``.tar.gz``, zstd...) are refused with how to fix it:
their members cannot be copied as byte ranges.

Samples are members grouped by basename (``SharedBlobs.samples()``): ``a/000017.jpg`` and
``a/000017.cls`` are sample ``a/000017``.
"""

from __future__ import annotations

import functools
import glob
import os
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .._disk.fs import out_of_descriptors, too_many_open_files
from ..errors import CorruptSourceError, InvalidSourceError, SourceNotFoundError
from .blobs import BlobSources, _check_name, _names_arrays
from .source_files import SourceFile, open_checked

if TYPE_CHECKING:
    import tarfile

__all__ = [
    "MAX_BRACE_DEPTH",
    "MAX_EXPANSIONS",
    "check_shard_name",
    "collect_members",
    "expand_braces",
    "is_shard_source",
    "plan_shards",
    "read_members",
    "shard_paths",
    "shards_fingerprint",
]

MAX_EXPANSIONS = 100_000
"""Names a brace pattern may expand to (``{0..99999}``); more is refused, not truncated."""
MAX_BRACE_DEPTH = 8
"""Brace groups nested deeper than this are refused (``{a,{b,{c,...}}}``)."""
_MAX_HEADER_READ = 1 << 20
"""A GNU long name or pax record larger than this is refused (tarfile would read it whole)."""
_BLOCK = 512
_COMPRESSED = (
    (b"\x1f\x8b", "gzip", "gunzip -k"),
    (b"BZh", "bzip2", "bunzip2 -k"),
    (b"\xfd7zXZ\x00", "xz", "unxz -k"),
    (b"\x28\xb5\x2f\xfd", "zstd", "unzstd"),
)
_COMPRESSED_SUFFIXES = {".tar.gz": 0, ".tgz": 0, ".tar.bz2": 1, ".tar.xz": 2, ".tar.zst": 3}
"""Suffixes of compressed tars, and which of :data:`_COMPRESSED` each is."""
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?$")

ShardSource = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


def is_shard_source(source: Any) -> bool:
    """Whether ``put_file`` reads ``source`` as tar shards: a path or pattern whose last
    name ends in ``.tar`` (or a compressed tar suffix, refused when planned), not a
    directory; or a non-empty list of such paths."""
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        name = text.rsplit("/", 1)[-1].lower()
        return name.endswith((".tar", *_COMPRESSED_SUFFIXES)) and not os.path.isdir(text)
    if isinstance(source, (list, tuple)) and source:
        return all(isinstance(p, (str, os.PathLike)) and is_shard_source(p) for p in source)
    return False


def expand_braces(pattern: str, limit: int = MAX_EXPANSIONS) -> list[str]:
    """``pattern`` with its brace groups expanded as the shell does: ``{a,b}`` alternatives
    and ``{000..099}`` (zero padded as written) or ``{0..10..2}`` ranges, nested up to
    :data:`MAX_BRACE_DEPTH` deep; a ``{`` that is neither stays literal. More than ``limit``
    names is refused. Time is linear in the pattern's length (its braces are paired once,
    by a stack) besides the names it makes."""
    closing = _pair_braces(pattern)
    return _expand(pattern, 0, len(pattern), closing, limit)


def _pair_braces(pattern: str) -> dict[int, int]:
    """Where the ``}`` closing each ``{`` that has one is (an unclosed ``{`` is literal);
    nesting deeper than :data:`MAX_BRACE_DEPTH` is refused."""
    closing: dict[int, int] = {}
    opened: list[int] = []
    for j, char in enumerate(pattern):
        if char == "{":
            opened.append(j)
        elif char == "}" and opened:
            closing[opened.pop()] = j
    ends: list[int] = []  # where the pairs enclosing position j close (unclosed '{' are no pair)
    for j in range(len(pattern)):
        if j not in closing:
            continue
        while ends and ends[-1] < j:
            ends.pop()
        ends.append(closing[j])
        if len(ends) > MAX_BRACE_DEPTH:
            shown = pattern if len(pattern) <= 200 else pattern[:200] + "..."
            raise InvalidSourceError(
                f"brace pattern {shown!r} nests braces more than {MAX_BRACE_DEPTH} deep; "
                "name the shards with a flatter pattern (e.g. {a,b,c}-{000..099}.tar) or a list"
            )
    return closing


def _expand(pattern: str, lo: int, hi: int, closing: dict[int, int], limit: int) -> list[str]:
    """The names ``pattern[lo:hi]`` expands to (``closing``: its brace pairs)."""
    results = [""]
    literal_start = i = lo
    while i < hi:
        if pattern[i] != "{":
            i += 1
            continue
        end = closing.get(i, -1)
        alternatives = None if end < 0 else _alternatives(pattern, i + 1, end, closing, limit)
        if alternatives is None:
            i += 1
            continue
        head = pattern[literal_start:i]
        if len(results) * len(alternatives) > limit:
            raise InvalidSourceError(
                f"brace pattern {pattern!r} expands to more than {limit:,} names; split the put"
            )
        results = [r + head + alt for r in results for alt in alternatives]
        i = literal_start = end + 1
    tail = pattern[literal_start:hi]
    return [r + tail for r in results]


def _alternatives(pattern: str, lo: int, hi: int, closing: dict[int, int], limit: int) -> list[str] | None:
    """The names the group whose body is ``pattern[lo:hi]`` stands for; None if it is
    neither alternatives nor a range (its ``{`` is then literal)."""
    bounds, j = [lo], lo
    while j < hi:
        if pattern[j] == "{" and j in closing:
            j = closing[j] + 1  # a nested group's commas are its own
            continue
        if pattern[j] == ",":
            bounds.append(j + 1)
        j += 1
    body = pattern[lo:hi]
    if len(bounds) > 1:
        out: list[str] = []
        for start, stop in zip(bounds, [b - 1 for b in bounds[1:]] + [hi], strict=True):
            out += _expand(pattern, start, stop, closing, limit)
            if len(out) > limit:
                raise InvalidSourceError(f"brace group {{{body}}} expands to more than {limit:,} names")
        return out
    match = _RANGE.match(body)
    if match is None:
        return None
    first, last = int(match[1]), int(match[2])
    step = abs(int(match[3] or 1)) or 1
    if abs(last - first) // step + 1 > limit:
        raise InvalidSourceError(f"brace range {{{body}}} expands to more than {limit:,} names")
    padded = any(len(s.lstrip("-")) > 1 and s.lstrip("-").startswith("0") for s in (match[1], match[2]))
    width = max(len(match[1]), len(match[2])) if padded else 0
    numbers = range(first, last + 1, step) if first <= last else range(first, last - 1, -step)
    return [f"{n:0{width}d}" for n in numbers]


def shard_paths(source: ShardSource) -> list[str]:
    """The shard files ``source`` names, absolute, in order: a list as given; a pattern's
    braces in their order, each glob's matches sorted. A name that matches nothing is an
    error (a missing shard is never skipped silently)."""
    if isinstance(source, (str, os.PathLike)):
        pattern = os.path.abspath(os.path.expanduser(os.fspath(source)))
        found: list[str] = []
        for name in expand_braces(pattern):
            if glob.has_magic(name):
                matches = sorted(glob.glob(name))
                if not matches:
                    raise SourceNotFoundError(f"no tar shard matches {name!r}")
                found += matches
            elif os.path.lexists(name):
                found.append(name)
            else:
                raise SourceNotFoundError(f"tar shard {name} does not exist")
    else:
        found = [os.path.abspath(os.fspath(p)) for p in source]
    paths = list(dict.fromkeys(found))  # a shard named twice is read once
    for path in paths:
        check_shard_name(path)
    return paths


def shards_fingerprint(source: ShardSource) -> dict[str, int] | None:
    """What ``meta.json`` records of the shards (``blobs.tree_fingerprint``) as they are now,
    stat only; None if they cannot be listed (a preload then loads them again)."""
    try:
        stats = [os.stat(path) for path in shard_paths(source)]
    except (OSError, InvalidSourceError):
        return None
    return {
        "files": len(stats),
        "size": sum(st.st_size for st in stats),
        "mtime_ns": max((st.st_mtime_ns for st in stats), default=0),
    }


def plan_shards(
    source: ShardSource, what: str, allowed: Sequence[str | os.PathLike[str]] = ()
) -> BlobSources:
    """Check every shard and every member header of ``source`` and return the blobs entry
    they make: one blob per regular member, a byte range of its shard (``spans``)."""
    tops = tuple(os.path.realpath(top) for top in allowed)
    paths = shard_paths(source)
    files: list[SourceFile] = []

    def shards() -> Iterator[tuple[str, Iterator[tuple[str, int, int]]]]:
        for path in paths:
            try:
                fd, file = open_checked(path, tops)
            except OSError as exc:
                if out_of_descriptors(exc):
                    raise too_many_open_files(exc, f"opening shard {path}") from exc
                raise
            try:
                files.append(file)
                yield path, read_members(functools.partial(os.pread, fd), file.size, path)
            finally:
                os.close(fd)

    names, sizes, spans, owners = collect_members(shards(), what)
    files = [files[i] for i in owners]
    source_text = os.path.abspath(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else None
    return BlobSources(source_text, names, sizes, files, None, _names_arrays(names, sizes, what), spans=spans)


def collect_members(
    shards: Iterable[tuple[str, Iterator[tuple[str, int, int]]]], what: str
) -> tuple[list[str], list[int], list[int], list[int]]:
    """Names, sizes, offsets and shard indexes of the members of ``shards`` (each ``(path,
    members)``: local files or objects of a URL), in order; a name twice (within a shard or
    across them) or no member at all is refused."""
    names: list[str] = []
    sizes: list[int] = []
    spans: list[int] = []
    owners: list[int] = []
    seen: dict[str, str] = {}
    paths: list[str] = []
    for index, (path, members) in enumerate(shards):
        paths.append(path)
        for name, offset, size in members:
            other = seen.setdefault(name, path)
            if len(seen) == len(names):  # not added: seen before
                where = "twice in it" if other == path else f"in {other} too"
                raise InvalidSourceError(
                    f"{path}: member {name!r} is {where}; blob names must be unique across the "
                    "shards (put such shards under separate keys)"
                )
            names.append(name)
            sizes.append(size)
            spans.append(offset)
            owners.append(index)
    if not names:
        raise InvalidSourceError(f"{what}: the shards hold no files ({', '.join(paths[:3])})")
    return names, sizes, spans, owners


def check_shard_name(path: str) -> None:
    """Refuse a shard whose name says it is compressed, or that is not a ``.tar``."""
    lowered = path.lower()
    for suffix, which in _COMPRESSED_SUFFIXES.items():
        if lowered.endswith(suffix):
            raise InvalidSourceError(_compressed_message(path, *_COMPRESSED[which][1:]))
    if not lowered.endswith(".tar"):
        raise InvalidSourceError(f"{path} is not a .tar shard; a list of shards takes .tar files only")


class _HeaderReader:
    """The file object ``tarfile`` parses headers from: ``read(n, offset)`` of the checked
    file (``pread``) or object (ranged reads), reads bounded (a hostile long name or pax
    size is refused, not read)."""

    def __init__(self, read: Callable[[int, int], bytes], size: int, path: str) -> None:
        self.pread, self.size, self.path, self.position = read, size, path, 0
        self.name = path

    def read(self, size: int = -1) -> bytes:
        if size < 0 or size > _MAX_HEADER_READ:
            raise CorruptSourceError(
                f"{self.path}: a tar header at byte {self.position} declares a long name or pax "
                f"record of {size:,} bytes (at most {_MAX_HEADER_READ:,}); not a valid shard"
            )
        data = self.pread(size, self.position)
        self.position += len(data)
        return data

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.position, os.SEEK_END: self.size}[whence]
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position


def read_members(read: Callable[[int, int], bytes], size: int, path: str) -> Iterator[tuple[str, int, int]]:
    """``(name, data offset, size)`` of every regular member of the shard of ``size`` bytes
    that ``read(n, offset)`` reads (a local ``pread``, or ranged reads of an object).
    Plain ustar/GNU headers of files and directories are read here (a few struct fields);
    anything else (long names, pax, links, devices, odd checksums) by ``tarfile``."""
    import tarfile  # here: a process that only reads entries never loads it

    file_size = size
    magic = read(8, 0)
    for prefix, codec, command in _COMPRESSED:
        if magic.startswith(prefix):
            raise InvalidSourceError(_compressed_message(path, codec, command))
    if file_size < _BLOCK:
        raise CorruptSourceError(f"{path} is not a tar archive ({file_size} bytes: shorter than one header)")
    reader = _HeaderReader(read, file_size, path)
    archive: tarfile.TarFile | None = None
    most = file_size // _BLOCK  # every member takes one header block at least
    count = offset = 0
    try:
        while True:
            header = read(_BLOCK, offset)
            plain = _plain_header(header) if archive is None or not archive.pax_headers else None
            if plain is not None:
                raw, is_dir, start, size = plain[0], plain[1], offset + _BLOCK, plain[2]
                at, offset = offset, offset + _BLOCK + (0 if is_dir else -(-size // _BLOCK) * _BLOCK)
            else:
                reader.seek(offset)
                if archive is None:  # parses (and keeps as firstmember) the header at offset
                    try:
                        archive = tarfile.TarFile(fileobj=reader, mode="r")  # type: ignore[arg-type]
                    except tarfile.ReadError as exc:
                        raise CorruptSourceError(f"{path} is not a tar archive ({exc})") from None
                else:
                    archive.offset = offset
                member = archive.next()
                if member is None:
                    offset = archive.offset  # where the end block (or the damage) is
                    break
                archive.members.clear()  # type: ignore[attr-defined]  # headers only, never kept: memory flat over any count
                if member.offset < offset:
                    raise CorruptSourceError(f"{path}: tar headers loop back at byte {member.offset}")
                raw, is_dir, start, size = member.name, member.isdir(), member.offset_data, member.size
                at, offset = member.offset, archive.offset
                if not is_dir:
                    _check_kind(member, raw, path)
            count += 1
            if count > most or offset <= at:
                raise CorruptSourceError(f"{path}: tar headers loop back at byte {at}; not a valid shard")
            if is_dir:
                continue
            name = _member_name(raw, path)
            if size < 0 or start + size > file_size:
                raise CorruptSourceError(
                    f"{path}: member {name!r} claims {size:,} bytes from byte {start:,}, past the end of the "
                    f"{file_size:,}-byte file: the shard is truncated; nothing was published, fetch it again"
                )
            yield name, start, size
    except tarfile.TarError as exc:
        raise CorruptSourceError(
            f"{path}: {exc} (a truncated or damaged tar); nothing was published"
        ) from None
    end = read(_BLOCK, offset)
    if len(end) < _BLOCK or end.count(0) != _BLOCK:
        raise CorruptSourceError(
            f"{path}: no end-of-archive block after its last member (at byte {offset:,}): the shard "
            "is truncated or damaged; nothing was published, fetch it again"
        )


def _plain_header(block: bytes) -> tuple[str, bool, int] | None:
    """``(name, is a directory, size)`` of a ustar or GNU header of a regular file or a
    directory with a valid checksum and an octal size; None: ``tarfile`` reads it."""
    if len(block) != _BLOCK or block[156:157] not in (b"0", b"\0", b"5"):
        return None
    magic = block[257:265]
    if magic[:6] == b"ustar\0":
        prefix = block[345:500].split(b"\0", 1)[0]
    elif magic == b"ustar  \0":  # GNU: no prefix field there
        prefix = b""
    else:
        return None
    if block[124] & 0x80:  # base-256 size (over 8 GiB)
        return None
    try:
        checksum = int(block[148:156].replace(b"\0", b" ").strip() or b"x", 8)
        size = int(block[124:136].replace(b"\0", b" ").strip() or b"0", 8)
    except ValueError:
        return None
    if checksum != _byte_sum(block) - sum(block[148:156]) + 256:  # the field counts as 8 spaces
        return None
    name = block[:100].split(b"\0", 1)[0]
    if prefix:
        name = prefix + b"/" + name
    is_dir = block[156:157] == b"5" or (block[156:157] == b"\0" and name.endswith(b"/"))
    return name.decode("utf-8", "surrogateescape"), is_dir, size


def _byte_sum(block: bytes) -> int:
    """The sum of a 512-byte block's bytes, in C: Adler-32's low half is 1 + the sum of the
    bytes modulo 65521, exact for 256 bytes (at most 65,280); a Python ``sum`` costs ~3 us."""
    return (zlib.adler32(block[:256]) & 0xFFFF) + (zlib.adler32(block[256:]) & 0xFFFF) - 2


def _member_name(raw: str, path: str) -> str:
    name = raw
    while name.startswith("./"):  # `tar -C dir -cf x.tar .` writes ./000.jpg
        name = name[2:]
    return _check_name(name, f"{path}: member")


def _check_kind(member: tarfile.TarInfo, name: str, path: str) -> None:
    if member.isreg() and not member.issparse():
        return
    kind = (
        "a sparse file"
        if member.issparse()
        else "a symbolic link"
        if member.issym()
        else "a hard link"
        if member.islnk()
        else "a device"
        if member.isdev() and not member.isfifo()
        else "a FIFO"
        if member.isfifo()
        else f"of tar type {member.type!r}"
    )
    raise InvalidSourceError(
        f"{path}: member {name!r} is {kind}; tar shards hold regular files only (write the shard with "
        "the files themselves, e.g. tar --dereference --hard-dereference)"
    )


def _compressed_message(path: str, codec: str, command: str) -> str:
    return (
        f"{path} is {codec}-compressed; tar shards are read uncompressed (each member is copied by the "
        f"kernel from its byte range): decompress it first ({command} FILE) and put the .tar"
    )
