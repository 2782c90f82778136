"""A member's puts into a root only its daemon writes (a team root): the daemon hands out
each new file's descriptor over ``ROOT/daemon.fds``, this process fills it, the daemon
checks and publishes it (:mod:`.fd_messages` gives the exchange).

The data is written once, straight into the file the entry will be: arrays with
``write()``, ``put_file`` sources copied by the kernel (``copy_file_range``) from a file
this process opened with its own rights. The daemon never opens a member's source, so a
member can put a file only they can read, and cannot make the daemon read one they could
not (no confused deputy).
"""

from __future__ import annotations

import logging
import os
import random
import socket
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .._containers.encode import (
    content_digest,
    encode_any,
    encode_mapping,
    encode_ragged,
    encode_records,
    encode_strings,
    same_content,
)
from .._containers.table_arrow import encode_table
from .._disk.array_parts import joined_files
from .._disk.keys import validate_key
from .._disk.layout import Layout
from .._disk.meta import read_meta
from .._disk.npy import build_header
from .._disk.writer import write_npy
from .._sources.dispatch import classify_source
from .._sources.files import copy_planned, plan_sources
from .._sources.hf_datasets import arrow_of_dataset, plan_hf_folder, read_hf_split
from .._sources.planned import Planned
from .._sources.tables import is_table_file, read_table_source
from .._team.commands import for_team
from ..errors import (
    DaemonBusyError,
    DaemonUnavailableError,
    InvalidSourceError,
    KeyExistsError,
    KeyNotFoundError,
    ShmCacheError,
    UnsupportedDataError,
    UntrustedDaemonError,
)
from .fd_messages import FDS_SOCKET, check_fits, raise_error, recv_message, send_message
from .putting import _as_storable_array
from .records import EntryInfo

__all__ = ["BUSY_WAIT_S", "MemberWriter", "Pending"]

logger = logging.getLogger(__name__)

BUSY_WAIT_S = 600.0
"""How long a member's write waits for a turn while the daemon serves as many writes as
it takes (64, 16 per member): a grid search whose experiments all ``cache()`` at once
queues, and each gets its turn, instead of failing at start."""

_T = TypeVar("_T")


class _RefusedAtAccept(Exception):
    """The daemon had no session for this connection (a :class:`DaemonBusyError` as the
    answer to its first request): nothing was done, so the whole exchange may run again."""

    def __init__(self, busy: DaemonBusyError) -> None:
        super().__init__(str(busy))
        self.busy = busy

Fill = np.ndarray | Planned
"""What fills one file: an array (its ``.npy`` is written), or a planned source (copied)."""


@dataclass
class Pending:
    """One entry of a member's put: its key, kind, files (name without ``.npy``) and the
    metadata only the member knows (container lengths, names, content hash, source)."""

    key: str
    kind: str
    files: dict[str, Fill]
    extra: dict[str, Any] = field(default_factory=dict)


def _file_size(fill: Fill) -> int:
    if isinstance(fill, Planned):
        return fill.header.file_size
    fortran = bool(fill.flags.f_contiguous and not fill.flags.c_contiguous)
    return len(build_header(fill.dtype, fill.shape, fortran)) + int(fill.nbytes)


def _fill(fd: int, fill: Fill, where: str) -> None:
    """Write ``fill`` into the daemon's file open as ``fd``. A large copy checksums what it
    wrote by reading it back: through ``/proc/self/fd`` (the file is readable by the
    members, its directory in ``tmp/`` is not)."""
    if isinstance(fill, Planned):
        copy_planned(fill, fd, Path(f"/proc/self/fd/{fd}"), lambda n: None, check_header=False)
    else:
        write_npy(fd, where, fill)


def _entry_info(data: dict[str, Any]) -> EntryInfo:
    names = {f.name for f in fields(EntryInfo)}
    values = {k: v for k, v in data.items() if k in names}
    if values.get("shape") is not None:
        values["shape"] = tuple(values["shape"])
    return EntryInfo(**values)


class MemberWriter:
    """Puts into ``root`` through its daemon (``open``s go to the root directly)."""

    def __init__(self, root: str | os.PathLike[str], team: str | None = None) -> None:
        self.root = Path(os.path.abspath(root))
        self.layout = Layout(self.root)
        self.team = team
        """The team's name, for the commands the daemon's refusals suggest (``--team NAME``)."""

    # ------------------------------------------------------------------ the exchange

    def _connect(self) -> socket.socket:
        path = self.root / FDS_SOCKET
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.connect(str(path))
            owner = os.stat(self.root).st_uid
            _, uid, _ = socket_peer(sock)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise DaemonUnavailableError(
                f"no daemon takes writes for {self.root} ({path}: {exc.strerror}); a team's root is "
                "written only through its daemon: ask the administrator to start it "
                f"(`shmcache serve --team {self.team or 'NAME'}`, or systemctl start "
                f"shmcache-team@{self.team or 'NAME'})"
            ) from None
        except PermissionError:
            sock.close()
            raise DaemonUnavailableError(
                f"you may not connect to {path}: only the members of the root's group may write there"
            ) from None
        except BaseException:
            sock.close()
            raise
        if uid not in (owner, 0):
            sock.close()
            raise UntrustedDaemonError(
                f"the process listening on {path} runs as uid {uid}, not as the owner of {self.root} "
                f"(uid {owner}); nothing was sent"
            )
        return sock

    def _session(self, exchange: Callable[[socket.socket], _T]) -> _T:
        """``exchange(sock)`` over a new connection, run again on a new one (backing off,
        up to :data:`BUSY_WAIT_S`) while the daemon has no session to give it."""
        deadline = time.monotonic() + BUSY_WAIT_S
        delay = 0.01
        while True:
            sock = self._connect()
            try:
                return exchange(sock)
            except _RefusedAtAccept as refused:
                if time.monotonic() + delay > deadline:
                    raise DaemonBusyError(
                        f"{refused.busy}; waited {BUSY_WAIT_S:.0f} s for a turn (the writes in "
                        "progress, or a loader that cache() runs while holding its turn, took longer): "
                        "try again later"
                    ) from None
                if delay == 0.01:
                    logger.info("the daemon of %s is busy (%s): waiting for a turn", self.root, refused.busy)
            finally:
                sock.close()
            time.sleep(delay * random.uniform(0.5, 1.5))  # jitter: waiting members do not retry in step
            delay = min(delay * 2, 0.5)

    def _ask(
        self, sock: socket.socket, body: dict[str, Any], first: bool = False
    ) -> tuple[dict[str, Any], int | None]:
        """Send ``body`` and read the answer (raised where it is an error). ``first``: the
        connection's first request, whose busy answer means the daemon had no session."""
        try:
            send_message(sock, body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon refused and hung up: its answer (why) is waiting to be read
        got = recv_message(sock)
        if got is None:
            raise DaemonUnavailableError("the daemon closed the write connection before answering")
        answer, fd = got
        try:
            raise_error(answer)
        except DaemonBusyError as busy:
            if fd is not None:
                os.close(fd)
            if first:
                raise _RefusedAtAccept(busy) from None
            raise
        except ShmCacheError as exc:  # a quota or budget refusal: its fixes on the team's root
            if fd is not None:
                os.close(fd)
            reworded = for_team(str(exc), self.team)
            if reworded == str(exc):
                raise
            raise type(exc)(reworded) from None
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        return answer, fd

    def put(self, entries: list[Pending], *, overwrite: bool = False, pin: bool = False) -> list[EntryInfo]:
        """Publish ``entries`` at once through the daemon; nothing if anything fails."""
        return self._session(lambda sock: self._put_on(sock, entries, overwrite, pin, first=True))

    def _put_on(
        self, sock: socket.socket, entries: list[Pending], overwrite: bool, pin: bool, first: bool
    ) -> list[EntryInfo]:
        """One put over an open connection: begin, fill each file, commit (its size checked
        before anything is written: a commit over the channel's limit would come after the
        writes, and after what the daemon evicted for them)."""
        commit = {"op": "commit", "extra": [_jsonable(e.extra) for e in entries]}
        begin = {
            "op": "begin",
            "overwrite": overwrite,
            "pin": pin,
            "entries": [
                {"key": e.key, "kind": e.kind, "files": {n: _file_size(f) for n, f in e.files.items()}}
                for e in entries
            ],
        }
        fix = f"a put of {len(entries)} entries: put the directory in parts (a key per part)"
        for request in (begin, commit):
            check_fits(request, fix)
        self._ask(sock, begin, first)
        for index, entry in enumerate(entries):
            for name, fill in entry.files.items():
                _, fd = self._ask(sock, {"op": "file", "entry": index, "name": name})
                if fd is None:
                    raise DaemonUnavailableError("the daemon answered a file request without a descriptor")
                try:
                    _fill(fd, fill, f"{entry.key}/{name}.npy")
                finally:
                    os.close(fd)
        answer, _ = self._ask(sock, commit)
        return [_entry_info(item) for item in answer["entries"]]

    def evict(self, key: str) -> int:
        """Evict ``key`` through the daemon (your own entry; a team admin: any); the bytes freed."""
        validate_key(key)
        answer, _ = self._session(lambda sock: self._ask(sock, {"op": "evict", "key": key}, first=True))
        return int(answer["freed"])

    # ------------------------------------------------------------------ the put functions

    def put_array(self, key: str, array: Any, *, overwrite: bool = False, pin: bool = False) -> EntryInfo:
        validate_key(key)
        data = _as_storable_array(array, f"array for key {key!r}")
        return self.put([Pending(key, "array", {"data": data})], overwrite=overwrite, pin=pin)[0]

    def put_strings(
        self, key: str, strings: Iterable[str], *, overwrite: bool = False, pin: bool = False
    ) -> EntryInfo:
        validate_key(key)
        files = encode_strings(strings, f"strings for key {key!r}")
        extra = {"length": len(files["offsets"]) - 1}
        return self.put([Pending(key, "strings", dict(files), extra)], overwrite=overwrite, pin=pin)[0]

    def put_ragged(
        self, key: str, arrays: Iterable[Any], *, overwrite: bool = False, pin: bool = False
    ) -> EntryInfo:
        validate_key(key)
        files, meta = encode_ragged(arrays, f"arrays for key {key!r}")
        meta["length"] = len(files["offsets"]) - 1
        return self.put([Pending(key, "ragged", dict(files), meta)], overwrite=overwrite, pin=pin)[0]

    def put_records(
        self,
        key: str,
        records: Iterable[Any],
        *,
        overwrite: bool = False,
        pin: bool = False,
        allow_nan: bool = False,
    ) -> EntryInfo:
        validate_key(key)
        files = encode_records(records, f"records for key {key!r}", allow_nan=allow_nan)
        extra = {"length": len(files["offsets"]) - 1}
        return self.put([Pending(key, "records", dict(files), extra)], overwrite=overwrite, pin=pin)[0]

    def put_mapping(
        self, key: str, mapping: Mapping[str, Any], *, overwrite: bool = False, pin: bool = False
    ) -> EntryInfo:
        validate_key(key)
        _, files, meta = encode_mapping(mapping, f"mapping for key {key!r}")
        return self.put([Pending(key, "mapping", dict(files), meta)], overwrite=overwrite, pin=pin)[0]

    def put_table(self, key: str, data: Any, *, overwrite: bool = False, pin: bool = False) -> EntryInfo:
        validate_key(key)
        if type(data).__module__.partition(".")[0] == "datasets":
            data = arrow_of_dataset(data, f"table for key {key!r}")
        if isinstance(data, (str, os.PathLike)):
            if not is_table_file(data):
                raise UnsupportedDataError(
                    f"{data}: put_table reads .parquet, .feather, .arrow, .csv or .jsonl files"
                )
            parts, meta = read_table_source(Path(data))
            files = joined_files(parts)
        else:
            files, meta = encode_table(data, f"table for key {key!r}")
        return self.put([Pending(key, "table", dict(files), meta)], overwrite=overwrite, pin=pin)[0]

    def share(self, key: str, obj: Any, *, overwrite: bool = False) -> str:
        """Put ``obj`` in the form that fits it (as ``Store.share``) unless ``key`` already
        holds the same content; returns the entry's kind (the caller opens it)."""
        validate_key(key)
        kind, files, meta = encode_any(obj, f"object for key {key!r}")
        digest = content_digest(kind, files)
        version = self.layout.entry_version(key)
        if version is not None:
            current = read_meta(self.layout, version)
            if current is not None and same_content(current.content_hash, kind, files, digest):
                return current.kind
            if not overwrite:
                raise KeyExistsError(
                    f"entry {key!r} in {self.root} holds other content than this object "
                    "(share() reuses an entry only when the content is identical); pass "
                    "overwrite=True to replace it, or share under another key"
                )
        meta["content_hash"] = digest
        try:
            self.put([Pending(key, kind, dict(files), meta)], overwrite=version is not None)
        except KeyExistsError:  # another member shared it meanwhile: theirs if it is the same
            version = self.layout.entry_version(key)
            current = None if version is None else read_meta(self.layout, version)
            if current is None or not same_content(current.content_hash, kind, files, digest):
                raise
        return kind

    def cache(
        self, key: str, loader: Callable[[], Any], opener: Callable[[str], np.ndarray], wanted: str | None
    ) -> np.ndarray:
        """Get-or-create through the daemon: ``opener(key)`` if the key holds version
        ``wanted`` (any, if None), else, holding the key's lock in the daemon (so that of
        members calling at once one loads and the others wait, then open its entry), run
        ``loader`` and put its result."""
        found = self._cached(key, opener, wanted)
        if found is not None:
            return found

        def locked_load(sock: socket.socket) -> np.ndarray | None:
            self._ask(sock, {"op": "lock", "key": validate_key(key)}, first=True)
            found = self._cached(key, opener, wanted)
            if found is not None:
                return found
            array = _as_storable_array(loader(), f"the value that cache()'s loader returned for {key!r}")
            extra = {} if wanted is None else {"cache_version": wanted}
            pending = [Pending(key, "array", {"data": array}, extra)]
            self._put_on(sock, pending, wanted is not None, False, first=False)
            return None

        found = self._session(locked_load)
        return opener(key) if found is None else found

    def _cached(self, key: str, opener: Callable[[str], np.ndarray], wanted: str | None) -> np.ndarray | None:
        try:
            array = opener(key)
        except KeyNotFoundError:
            return None
        if wanted is None:
            return array
        version = self.layout.entry_version(key)
        meta = None if version is None else read_meta(self.layout, version)
        if meta is None or meta.cache_version != wanted:
            return None
        return array

    def put_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        pin: bool = False,
        as_: str = "auto",
        dtype: Any = None,
    ) -> list[str]:
        """``Store.put_file`` of a local file or directory, read with this process's rights
        (a file only you can read is fine). URLs are the daemon's to load, with its own
        credentials, from the prefixes the team allows: ``shmcache put --team``."""
        validate_key(key)
        try:
            source = classify_source(path, as_, dtype)
            if source.kind == "remote":
                raise InvalidSourceError(
                    f"{path}: a team's daemon loads URLs itself, with its own credentials and only "
                    "from the team's allow_sources: `shmcache put URL --key KEY --team NAME`"
                )
            if source.kind == "shards" or not isinstance(source.location, (str, os.PathLike)):
                raise UnsupportedDataError(
                    f"{path}: tar shards (blobs entries) cannot be put into a team root yet; put them "
                    "into your own root, or put the files' arrays or tables instead"
                )
            location = Path(os.path.abspath(source.location))
            return self._put_file(key, source.kind, location, overwrite, pin, dtype)
        except ShmCacheError:  # NotPermittedError, UntrustedDaemonError are PermissionErrors too
            raise
        except PermissionError as exc:  # a directory on the way that this user may not enter
            raise InvalidSourceError(
                f"source {path} cannot be read: Permission denied ({exc.filename}); you may put "
                "only files you can read yourself"
            ) from None

    def _put_file(
        self, key: str, kind: str, source: Path, overwrite: bool, pin: bool, dtype: Any
    ) -> list[str]:
        if kind == "blobs":
            raise UnsupportedDataError(
                f"{source}: blobs entries cannot be put into a team root yet; put the files' arrays "
                "(.npy, .npz, .safetensors, ...) or tables instead"
            )
        if kind == "hf":  # a save_to_disk folder: a table per split, published together
            pending = []
            for split in plan_hf_folder(key, source):
                files, meta = read_hf_split(split)
                pending.append(Pending(split.key, "table", dict(files), meta))
            return [info.key for info in self.put(pending, overwrite=overwrite, pin=pin)]
        if kind == "table":
            parts, meta = read_table_source(source)
            self.put([Pending(key, "table", dict(joined_files(parts)), meta)], overwrite=overwrite, pin=pin)
            return [key]
        entries = []
        for item in plan_sources(key, source, [], dtype):
            extra = {"source": item.source, "source_fingerprint": item.fingerprint}
            if item.container is not None:
                container = item.container
                extra |= dict(container.extra)
                fills: dict[str, Fill] = {**container.files, **container.copied}
                entries.append(Pending(item.key, container.kind, fills, extra))
            else:
                entries.append(Pending(item.key, "array", {"data": item}, extra))
        return [info.key for info in self.put(entries, overwrite=overwrite, pin=pin)]


def socket_peer(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def _jsonable(extra: Mapping[str, Any]) -> dict[str, Any]:
    """``extra`` with numpy scalars as Python numbers (what ``json`` can write)."""
    out = {}
    for name, value in extra.items():
        out[name] = value.item() if isinstance(value, np.generic) else value
    return out
