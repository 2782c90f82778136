"""Members' writes without a second copy: the daemon creates each file, the member fills it
through the descriptor it is handed, the daemon checks it and publishes it.

The channel is a ``SOCK_SEQPACKET`` socket, ``ROOT/daemon.fds`` (framing and requests:
:mod:`shmcache._store.fd_messages`), with the mode and group of the daemon's HTTP socket
and the same admission rule (``SO_PEERCRED``). One thread per connection runs one put at
a time:

1. ``begin``: the keys are valid, not another member's (unless an admin replaces them),
   absent unless ``overwrite``; the member's quota holds (what their entries use, plus
   what their other puts are writing); then the room is reserved as any writer does
   (budget eviction takes the least recently used entries of members over their share
   first, never a pinned or mapped one) and the versions are made in ``tmp/``;
2. ``file``: ``tmp/<version>/<name>.npy`` is created, preallocated to the size declared
   in ``begin`` (a full tmpfs is an error here, never a SIGBUS later), and its descriptor
   sent; the daemon keeps none open for writing;
3. ``commit``: a read lease on each file proves that no writable descriptor (or mapping)
   of it is left anywhere, so nobody can change it again; each file is then validated as
   any ``.npy`` source (header, no object dtype, size exactly the header's), checksummed
   by the daemon, described in ``meta.json`` with ``owner_uid`` the member's uid, and all
   are published at once.

A connection that ends before its commit (the member exits, or is killed) publishes
nothing: the versions are removed at once, and a daemon that dies meanwhile leaves them
to the start-up cleanup, as any dead writer's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shmcache import EntryInfo, Store
from shmcache._disk.checksum import crc_of_range
from shmcache._disk.fs import raise_if_full
from shmcache._disk.keys import validate_key
from shmcache._disk.leases import has_writers
from shmcache._disk.meta import EntryMeta
from shmcache._disk.npy import read_source_header_fd
from shmcache._disk.writer import VersionWriter
from shmcache._store.catalog import iter_infos
from shmcache._store.fd_messages import FDS_SOCKET, MAX_REQUEST, error_body, recv_message, send_message
from shmcache._store.locks import DEFAULT_LOCK_TIMEOUT, key_lock
from shmcache._store.ownership import acting_for, check_quota, owner_name
from shmcache._store.records import entry_info
from shmcache._store.space import reserve
from shmcache._store.writing import ITEM_TYPES, publish, version_meta
from shmcache.errors import (
    CacheRootError,
    CorruptSourceError,
    DaemonBusyError,
    InvalidRequestError,
    KeyExistsError,
    KeyNotFoundError,
    ShmCacheError,
    UnauthorizedError,
)

from .members import MemberPolicy
from .protocol import peer_credentials
from .settings import Settings
from .state import Service, entry_model

__all__ = ["FDS_SOCKET", "FdChannel", "start_fd_channel"]

logger = logging.getLogger(__name__)

KINDS = frozenset({"array", "strings", "ragged", "records", "mapping", "table"})
"""Entry kinds a member may write (each a set of ``.npy`` files and ``meta.json``)."""
_DAEMON_FIELDS = frozenset(
    {
        "format",
        "key",
        "kind",
        "version",
        "files",
        "nbytes",
        "size",
        "created",
        "pinned",
        "checksum",
        "owner_uid",
        "fortran_order",
    }
)
"""``meta.json`` fields only the daemon writes (from the files it checked and the peer's uid)."""
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_PAGE = 4096
_MAX_ENTRIES = 100_000
_MAX_SESSIONS = 64
_MAX_SESSIONS_PER_UID = 16
"""One member's share of the sessions: a grid search of one member, or a member's stuck
process holding its connections, leaves the others room (their writes wait, not fail)."""
_MAX_FILE = 1 << 50


@dataclass
class _Entry:
    key: str
    kind: str
    files: dict[str, int]
    version: str = ""
    handed: set[str] = field(default_factory=set)


def start_fd_channel(
    service: Service, settings: Settings, refusal: Callable[[int], str | None] | None = None
) -> FdChannel:
    """The channel of ``service``'s root, listening beside its HTTP socket with the same
    mode, group and admission rule (``refusal``: a team daemon's, why a uid may not
    connect; else the daemon's own user and root only)."""
    own = {os.geteuid(), 0}

    def refuse(uid: int) -> str | None:
        if refusal is not None:
            return refusal(uid)
        return None if uid in own else "not the daemon's user"

    channel = FdChannel(
        service.store, service.policy, refuse, on_put=service.metrics.member_put, entries=service.entries
    )
    channel.start(settings.socket_path)
    return channel


class FdChannel:
    """The daemon's side of the channel: a listener thread and one thread per member."""

    def __init__(
        self,
        store: Store,
        policy: MemberPolicy,
        refusal: Callable[[int], str | None],
        on_put: Callable[[int, int], None] | None = None,
        entries: Callable[[], list[EntryInfo]] | None = None,
    ) -> None:
        self.store = store
        self.policy = policy
        self.refusal = refusal
        """``uid -> why not``: None if a peer may use the channel (the HTTP socket's rule)."""
        self.on_put = on_put
        """Called with ``(uid, bytes)`` after each published put (metrics)."""
        self.entries = entries if entries is not None else lambda: list(iter_infos(store.layout))
        """The root's entries now (the daemon's cached view: no re-read of every ``meta.json``)."""
        self._listener: socket.socket | None = None
        self._sessions = threading.BoundedSemaphore(_MAX_SESSIONS)
        self._quota = threading.Lock()
        self._pending: dict[int, int] = {}
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._per_uid: dict[int, int] = {}
        """Sessions per member uid (under ``_conns_lock``)."""

    # ------------------------------------------------------------------ listening

    def start(self, like: Path) -> Path:
        """Listen on ``ROOT/daemon.fds`` with the mode and group of socket ``like``."""
        path = self.store.root / FDS_SOCKET
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # the daemon's pid file lock is held: nobody else serves this root
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        st = os.stat(like)
        if st.st_gid != os.stat(path).st_gid:
            os.chown(path, -1, st.st_gid)
        os.chmod(path, st.st_mode & 0o777)
        sock.listen(128)
        self._listener = sock
        threading.Thread(target=self._accept, name="shmcache-fds", daemon=True).start()
        return path

    def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            path = listener.getsockname()
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
        with self._conns_lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while self._listener is not None:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                pid, uid, _ = peer_credentials(conn)
            except OSError:
                conn.close()
                continue
            why = self.refusal(uid)
            if why is not None:
                logger.warning("refused a write connection from pid %d (uid %d): %s", pid, uid, why)
                _refuse(conn, UnauthorizedError(why))
                continue
            busy = self._take_session(uid)
            if busy is not None:
                _refuse(conn, DaemonBusyError(busy))
                continue
            try:
                threading.Thread(
                    target=self._serve, args=(conn, uid), name=f"shmcache-put-{uid}", daemon=True
                ).start()
            except RuntimeError:  # no thread left (a process or cgroup limit): this one waits
                self._end_session(uid)
                _refuse(conn, DaemonBusyError("the daemon cannot start a thread for this write now"))

    def _take_session(self, uid: int) -> str | None:
        """Count a session for ``uid``; why not where none is free (the member waits and
        connects again: ``MemberWriter``)."""
        with self._conns_lock:
            if self._per_uid.get(uid, 0) >= _MAX_SESSIONS_PER_UID:
                return f"you have {_MAX_SESSIONS_PER_UID} writes in progress, a member's most at once"
            if not self._sessions.acquire(blocking=False):
                return f"the daemon serves {_MAX_SESSIONS} writes at once, its most"
            self._per_uid[uid] = self._per_uid.get(uid, 0) + 1
        return None

    def _end_session(self, uid: int) -> None:
        with self._conns_lock:
            left = self._per_uid.get(uid, 0) - 1
            if left > 0:
                self._per_uid[uid] = left
            else:
                self._per_uid.pop(uid, None)
            self._sessions.release()

    def _serve(self, conn: socket.socket, uid: int) -> None:
        with self._conns_lock:
            self._conns.add(conn)
        locks: list[AbstractContextManager[None]] = []  # key locks this connection holds
        try:
            while _Put(self, conn, uid, locks).run():
                pass
        except OSError as exc:
            logger.info("write connection of uid %d ended: %s", uid, exc)
        finally:
            _release(locks)  # in this thread: key locks are held per thread
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()
            self._end_session(uid)

    # ------------------------------------------------------------------ quota

    def hold_quota(self, uid: int, nbytes: int, replacing: set[str]) -> None:
        """Count ``nbytes`` against ``uid``'s quota while they write (refused if over)."""
        if self.policy.user_quota is None:
            return
        with self._quota:
            used = sum(e.size for e in self.entries() if e.owner_uid == uid and e.key not in replacing)
            check_quota(uid, self.policy.user_quota, used, self._pending.get(uid, 0), nbytes)
            self._pending[uid] = self._pending.get(uid, 0) + nbytes

    def release_quota(self, uid: int, nbytes: int) -> None:
        if self.policy.user_quota is None or nbytes == 0:
            return
        with self._quota:
            left = self._pending.get(uid, 0) - nbytes
            if left > 0:
                self._pending[uid] = left
            else:
                self._pending.pop(uid, None)


def _refuse(conn: socket.socket, error: ShmCacheError) -> None:
    """Answer a connection ``error`` and hang up so that the member reads why. Closing a
    socket with a request unread in it resets the peer, whose pending answer is then lost
    (``ConnectionResetError``): shut it first (the member's later sends fail with EPIPE
    instead of queueing), take what it sent already, then close."""
    with contextlib.suppress(OSError):
        send_message(conn, error_body(error))
        conn.shutdown(socket.SHUT_RDWR)
        conn.setblocking(False)
        while conn.recv(1 << 16, socket.MSG_TRUNC):
            pass
    conn.close()


class _Put:
    """One put over a connection: ``begin``, ``file``..., ``commit``."""

    def __init__(
        self, channel: FdChannel, conn: socket.socket, uid: int, locks: list[AbstractContextManager[None]]
    ) -> None:
        self.channel = channel
        self.store = channel.store
        self.conn = conn
        self.uid = uid
        self.locks = locks
        self.entries: list[_Entry] = []
        self.writer: VersionWriter | None = None
        self.held = 0
        self.overwrite = False
        self.pin = False

    def run(self) -> bool:
        """Serve requests until this put is committed (True: the connection may carry
        another) or the connection ends (False). Whatever was not published is removed."""
        try:
            while True:
                got = recv_message(self.conn, MAX_REQUEST, one_big_at_a_time=True)
                if got is None:
                    return False
                body, fd = got
                if fd is not None:
                    os.close(fd)
                    send_message(
                        self.conn, error_body(InvalidRequestError("the daemon takes no descriptor here"))
                    )
                    continue
                out: int | None = None
                op = body.get("op")
                try:
                    if op == "begin":
                        answer = self.begin(body)
                    elif op == "file":
                        answer, out = self.file(body)
                    elif op == "commit":
                        answer = self.commit(body)
                    elif op == "evict" and self.writer is None:
                        answer = self.evict(body)
                    elif op == "lock" and self.writer is None:
                        answer = self.lock(body)
                    else:
                        raise InvalidRequestError(
                            f"unknown request {str(op)[:40]!r} (begin, file, commit; evict outside a put)"
                        )
                except (ShmCacheError, OSError) as exc:
                    if not isinstance(exc, ShmCacheError):  # the daemon's own trouble: logged, told
                        logger.warning("put by uid %d: %s failed: %s", self.uid, op, exc)
                        exc = ShmCacheError(f"the daemon could not serve {op}: {exc}")
                    answer = error_body(exc)
                    if op in ("begin", "commit"):
                        self.abandon()  # nothing of this put survives a failed begin or commit
                try:
                    send_message(self.conn, answer, out)
                finally:
                    if out is not None:
                        os.close(out)
                if op == "commit" and answer.get("ok"):
                    return True
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Remove every unpublished version of this put and give back what it held."""
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()
        self.channel.release_quota(self.uid, self.held)
        self.held = 0
        self.entries = []

    # ------------------------------------------------------------------ requests

    def lock(self, body: dict[str, Any]) -> dict[str, Any]:
        """Take a key's lock for the connection (a member's ``cache()``: one loader runs,
        the others wait, then open what it put); held until the connection ends. Waits as
        long as a loader may run (an hour), or until the holder's connection ends."""
        key = validate_key(body.get("key"))
        if self.locks:
            raise InvalidRequestError("this connection holds a key lock already")
        held = key_lock(self.store.layout, key, DEFAULT_LOCK_TIMEOUT)
        held.__enter__()
        self.locks.append(held)
        return {"ok": True}

    def evict(self, body: dict[str, Any]) -> dict[str, Any]:
        """Evict a key for the member: their own entry (an admin: any)."""
        key = validate_key(body.get("key"))
        if self.channel.policy.is_admin(self.uid):
            freed = self.store.evict(key)
        else:
            freed = self.channel.policy.evict_own(self.uid, self.store, key)
        logger.info("evicted %s for %s (%d bytes)", key, owner_name(self.uid), freed)
        return {"ok": True, "freed": freed}

    def begin(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.writer is not None:
            raise InvalidRequestError("a put is already open on this connection: commit it first")
        self.overwrite = body.get("overwrite") is True
        self.pin = body.get("pin") is True
        self.entries = _parse_entries(body.get("entries"))
        keys = [e.key for e in self.entries]
        layout = self.store.layout
        for key in keys:
            try:
                current = self.store.info(key)
            except KeyNotFoundError:
                continue
            if not self.overwrite:
                raise KeyExistsError(
                    f"entry {key!r} already exists in {self.store.root}; pass overwrite=True "
                    "to replace it, or evict it first"
                )
            self.channel.policy.check_may_remove(self.uid, current, "replace")
        data = sum(sum(e.files.values()) for e in self.entries)  # what the entries' size will say
        nbytes = data + sum(_PAGE * (len(e.files) + 1) for e in self.entries)
        replacing = set(keys) if self.overwrite else set()
        self.channel.hold_quota(self.uid, data, replacing)
        self.held = data
        self.store.prepare()
        self.writer = VersionWriter(layout)
        budget = self.store.budget
        reserve(
            layout,
            self.writer,
            nbytes,
            budget=None,
            lock_timeout=self.store.lock_timeout,
            evict_version=lambda key, version: self.store._evict_version(
                key, version, wait=False, reason="budget"
            ),
            replacing=replacing,
            victim_order=self.channel.policy.victim_order(budget, layout),
        )
        for entry in self.entries:
            entry.version = self.writer.new_version()
        return {"ok": True, "versions": [e.version for e in self.entries]}

    def file(self, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        entry, name = self._named_file(body)
        assert self.writer is not None
        size = entry.files[name]
        filename = f"{name}.npy"
        fd = self.writer.create_file(entry.version, filename)
        try:
            if size:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    raise_if_full(str(self.writer.path(entry.version, filename)), exc)
                    raise
        except BaseException:
            os.close(fd)
            raise
        entry.handed.add(name)
        return {"ok": True, "size": size}, fd

    def _named_file(self, body: dict[str, Any]) -> tuple[_Entry, str]:
        if self.writer is None:
            raise InvalidRequestError("no put is open on this connection: send begin first")
        index, name = body.get("entry"), body.get("name")
        if not isinstance(index, int) or not 0 <= index < len(self.entries):
            raise InvalidRequestError(f"entry {index!r} is not one of this put's {len(self.entries)}")
        entry = self.entries[index]
        if name not in entry.files:
            raise InvalidRequestError(f"{str(name)[:80]!r} is not a file begin declared for {entry.key!r}")
        if name in entry.handed:
            raise InvalidRequestError(f"file {name!r} of {entry.key!r} was handed out already")
        return entry, name

    def commit(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.writer is None:
            raise InvalidRequestError("no put is open on this connection: send begin first")
        extras = body.get("extra")
        if not isinstance(extras, list) or len(extras) != len(self.entries):
            raise InvalidRequestError("commit's extra must list one object per entry")
        metas = []
        for entry, extra in zip(self.entries, extras, strict=True):
            missing = sorted(set(entry.files) - entry.handed)
            if missing:
                raise InvalidRequestError(f"{entry.key!r}: files {missing} were never filled")
            metas.append(self._checked_meta(entry, extra))
        if self.overwrite:  # another member may have put one of the keys since begin
            for entry in self.entries:
                with contextlib.suppress(KeyNotFoundError):
                    self.channel.policy.check_may_remove(self.uid, self.store.info(entry.key), "replace")
        for entry, meta in zip(self.entries, metas, strict=True):
            self.writer.write_meta(entry.version, meta)
        with acting_for(self.uid):
            publish(
                self.store.layout,
                self.writer,
                [(e.key, e.version) for e in self.entries],
                overwrite=self.overwrite,
                lock_timeout=self.store.lock_timeout,
            )
        published = [entry_model(_info(meta)).model_dump(mode="json") for meta in metas]
        total = sum(int(m["size"]) for m in metas)
        logger.info(
            "put by %s: %s (%d bytes)", owner_name(self.uid), ", ".join(e.key for e in self.entries), total
        )
        if self.channel.on_put is not None:
            self.channel.on_put(self.uid, total)
        self.abandon()  # publish made the versions the keys': nothing left to remove
        return {"ok": True, "entries": published}

    def _checked_meta(self, entry: _Entry, extra: Any) -> dict[str, Any]:
        """Check every file of ``entry`` and describe it; the member's ``extra`` fields
        (container lengths, names, content hash...) may not set what the daemon decides."""
        assert self.writer is not None
        if not isinstance(extra, dict):
            raise InvalidRequestError(f"{entry.key!r}: extra must be a JSON object")
        reserved = sorted(set(extra) & _DAEMON_FIELDS)
        if reserved:
            raise InvalidRequestError(
                f"{entry.key!r}: extra may not set {reserved} (the daemon records them)"
            )
        headers, crcs = {}, {}
        for name, size in entry.files.items():
            path = self.writer.path(entry.version, f"{name}.npy")
            where = f"{entry.key}/{name}.npy"
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _has_writers(fd):
                    raise InvalidRequestError(
                        f"{where} is still open for writing: close every descriptor of it before commit"
                    )
                actual = os.fstat(fd).st_size
                header = read_source_header_fd(fd, actual, where)
                if actual != size or header.file_size != size:
                    raise CorruptSourceError(
                        f"{where}: {actual} bytes written, its header describes {header.file_size}, "
                        f"begin declared {size}; nothing was published"
                    )
                crcs[name] = crc_of_range(fd, 0, size)
                headers[name] = header
            finally:
                os.close(fd)
        with acting_for(self.uid):
            meta = version_meta(entry.key, entry.kind, entry.version, headers, crcs, self.pin)
        meta.update({k: v for k, v in extra.items() if k not in meta or meta[k] is None})
        if entry.kind == "array" and "data" not in headers:
            raise InvalidRequestError(f"{entry.key!r}: an array entry is one file named 'data'")
        if entry.kind != "array":  # what `ls` shows: item count, and the item type
            meta["shape"] = [meta.get("length", 0)]
            meta.setdefault("dtype", ITEM_TYPES.get(entry.kind))
        return meta


def _release(locks: list[AbstractContextManager[None]]) -> None:
    while locks:
        locks.pop().__exit__(None, None, None)


def _has_writers(fd: int) -> bool:
    """:func:`has_writers`, or the refusal of a kernel without file leases (the daemon
    could not prove that the member let go of the file: it publishes nothing)."""
    try:
        return has_writers(fd)
    except OSError as exc:
        raise CacheRootError(
            f"this kernel refuses file leases ({exc.strerror}; is fs.leases-enable 0?): the daemon "
            "cannot prove that a member's file is no longer open for writing, so it publishes nothing; "
            "enable leases (sysctl fs.leases-enable=1)"
        ) from None


def _info(meta: dict[str, Any]) -> EntryInfo:
    written = EntryMeta.from_json(meta)
    return entry_info(written, written.created)


def _parse_entries(raw: Any) -> list[_Entry]:
    if not isinstance(raw, list) or not 0 < len(raw) <= _MAX_ENTRIES:
        raise InvalidRequestError(f"begin needs 1 to {_MAX_ENTRIES} entries")
    entries, seen = [], set()
    for item in raw:
        if not isinstance(item, dict):
            raise InvalidRequestError("each entry of begin is an object {key, kind, files}")
        key = validate_key(item.get("key"))
        if key in seen:
            raise InvalidRequestError(f"key {key!r} appears twice in one put")
        seen.add(key)
        kind = item.get("kind")
        if kind not in KINDS:
            raise InvalidRequestError(f"{key!r}: kind {str(kind)[:40]!r} is not one of {sorted(KINDS)}")
        files = item.get("files")
        if not isinstance(files, dict) or not files or len(files) > 64:
            raise InvalidRequestError(f"{key!r}: files must name 1 to 64 files and their sizes")
        for name, size in files.items():
            if not _FILE_NAME.fullmatch(name) or name == "meta":
                raise InvalidRequestError(f"{key!r}: {name[:80]!r} is not a file name a version may hold")
            if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= _MAX_FILE:
                raise InvalidRequestError(f"{key!r}: file {name!r} has no valid size")
        entries.append(_Entry(key, kind, dict(files)))
    return entries
