"""Sources of ``put_file``: validate every file before any byte is copied, then copy each
with the kernel (``copy_file_range``) while another thread checksums it; compressed
``.npz`` members are inflated."""

from __future__ import annotations

import os
import zipfile
import zlib
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from .._disk.checksum import BackgroundCrc
from .._disk.fs import copy_range, write_all
from .._disk.keys import validate_key
from .._disk.npy import NpyHeader, iter_npz_members, read_source_header
from ..errors import CorruptSourceError, InvalidSourceError, ShmCacheError, SourceNotFoundError

__all__ = ["Planned", "copy_planned", "plan_sources"]


@dataclass
class Planned:
    """One entry a ``put_file`` call will write, validated before any byte is copied.

    ``key`` is validated; ``header`` is the source's parsed header, which is also what
    the entry's metadata is built from (the copy is byte for byte).
    """

    key: str
    header: NpyHeader
    source: str
    fingerprint: dict[str, int]
    copy_from: str
    copy_offset: int | None  # None: the member is compressed and must be inflated
    member: str | None = None
    version: str = field(default="")


def _fingerprint(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def plan_sources(key: str, path: Path) -> list[Planned]:
    """Validate every source file under ``path`` and name the entries they become
    (``key`` must be valid already)."""
    path = Path(os.path.abspath(path))
    try:
        st = path.stat()
    except FileNotFoundError:
        raise SourceNotFoundError(f"source {path} does not exist") from None
    except OSError as exc:
        raise InvalidSourceError(f"source {path} cannot be read: {exc.strerror}") from exc
    plan = _plan_sources_unchecked(key, path, st)
    seen: dict[str, str] = {}
    for item in plan:
        if item.key in seen:
            raise InvalidSourceError(
                f"{seen[item.key]} and {item.source} would both become key {item.key!r}; "
                "rename one of them"
            )
        seen[item.key] = item.source
    return plan


def _plan_sources_unchecked(key: str, path: Path, st: os.stat_result) -> list[Planned]:
    if path.is_dir():
        plan: list[Planned] = []
        for file in sorted(path.rglob("*")):
            if file.suffix in (".npy", ".npz") and file.is_file():
                relative = file.relative_to(path).with_suffix("").as_posix()
                plan.extend(_plan_file(_child_key(key, relative, file), file))
        if not plan:
            raise InvalidSourceError(f"directory {path} holds no .npy or .npz files")
        return plan
    return _plan_file(key, path, st)


def _child_key(key: str, relative: str, file: Path) -> str:
    child = f"{key}/{relative}"
    try:
        return validate_key(child)
    except ShmCacheError as exc:
        raise type(exc)(f"{file}: its path does not make a valid key ({exc})") from None


def _plan_file(key: str, path: Path, st: os.stat_result | None = None) -> list[Planned]:
    st = st or path.stat()
    if path.suffix == ".npz":
        members = [
            Planned(
                key=_child_key(key, member.name, path),
                header=member.header,
                source=f"{path}[{member.name}.npy]",
                fingerprint=_fingerprint(st),
                copy_from=str(path),
                copy_offset=member.stored_offset,
                member=member.name,
            )
            for member in iter_npz_members(str(path))
        ]
        if not members:
            raise InvalidSourceError(f"{path}: the .npz archive holds no .npy arrays")
        return members
    if path.suffix != ".npy":
        raise CorruptSourceError(f"{path}: not a .npy or .npz file (or a directory of them)")
    try:
        with open(path, "rb") as fp:
            header = read_source_header(fp, st.st_size, str(path))
    except PermissionError as exc:
        raise InvalidSourceError(f"source {path} cannot be read: {exc.strerror}") from exc
    return [Planned(key, header, str(path), _fingerprint(st), str(path), 0)]


def copy_planned(item: Planned, dst: int, target: Path, advance: Callable[[int], None]) -> int:
    """Copy one planned ``.npy`` to the end of ``dst``; returns its CRC-32."""
    if item.copy_offset is None:
        return _inflate_member(item, dst, target, advance)
    # The kernel copies while another thread checksums the same (cached) bytes.
    crc = BackgroundCrc(item.copy_from, item.copy_offset, item.header.file_size)
    src = os.open(item.copy_from, os.O_RDONLY | os.O_CLOEXEC)
    try:
        copy_range(src, dst, item.copy_offset, item.header.file_size, target, advance)
        return crc.result()
    except EOFError as exc:
        raise CorruptSourceError(f"{item.source}: {exc} (did it change while loading?)") from exc
    finally:
        os.close(src)
        with suppress(BaseException):
            crc.result()


def _inflate_member(item: Planned, dst: int, target: Path, advance: Callable[[int], None]) -> int:
    """Copy a compressed ``.npz`` member (zipfile checks its CRC while inflating);
    returns the CRC-32 of what was written."""
    written = 0
    crc = 0
    try:
        with zipfile.ZipFile(item.copy_from) as archive, archive.open(f"{item.member}.npy") as member:
            while chunk := member.read(16 << 20):
                piece = chunk[: item.header.file_size - written]
                write_all(dst, piece, target)
                crc = zlib.crc32(piece, crc)
                written += len(piece)
                advance(len(piece))
                if written >= item.header.file_size:
                    break
    except (zipfile.BadZipFile, EOFError, KeyError, zlib.error) as exc:
        raise CorruptSourceError(f"{item.source}: {exc}") from exc
    if written < item.header.file_size:
        raise CorruptSourceError(f"{item.source}: truncated member ({written} bytes)")
    return crc


