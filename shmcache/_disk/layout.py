"""The on-disk contract in one place: every path, file name, environment name and the key
encoding of a cache root. Change the format here and nowhere else.

::

    <root>/generation            change counters, one 8-byte slot each (see below)
    <root>/format                "2": entries are a tree (absent: maybe flat links of format 1)
    <root>/entries/a~/b~/c       the entry of key ``a/b/c``: a symlink -> ../../../objects/<version>
                                 (each prefix segment is a directory marked by a trailing "~",
                                 which no key segment contains: keys ``a`` and ``a/b`` coexist;
                                 the target climbs one level per segment, so it resolves)
    <root>/objects/<version>/    <name>.npy files + meta.json, immutable once published
    <root>/objects/<batch>/      a directory put's entries: <n>/ (entry n's .npy files; its
                                 version is "<batch>/<n>") and one ``manifest`` (``manifest``)
    <root>/tmp/                  partial writes and the lock of each live writer
    <root>/locks/space.lock      the root's space-accounting lock (fcntl byte-range locks, all)
    <root>/locks/key-slots.NN.lock  a key's lock is one byte at a hash of the key in one of 32
                                 files (no descriptor per key); publish.lock for directory puts
    <root>/locks/keys/           the key's last failed ``cache()`` load (``<key>.failed``)
    <root>/daemon.sock           the daemon's control socket (mode 0600; a team's: 0660)
    <root>/daemon.pid            the daemon's pid file (flocked while it runs)
    <root>/budget.json           the root's byte budget, honoured by every writer (absent: none)
    <root>/preloads.json         the daemon's record: key -> the source its config preloads there
    <root>/pins/<pid>            what a live process pinned with CUDA (``pin_records``; flocked)

A directory put replaces the whole subtree of its keys' common prefix at once
(``entry_tree``): a reader's path walk lands in the old subtree or the new one, never in a
mix. Format 1 roots had flat links ``entries/a~b~c -> ../objects/<version>``; readers
still find those (on the miss path only) and the first writer or ``cleanup`` migrates them.

The generation file holds ``GENERATION_SLOTS`` little-endian uint64 counters. Slot 0
changes on every publish or evict in the root (what the daemon's entry-list cache
watches); slot ``generation_slot(key)`` changes when that key (or another key hashed to
the same slot) is published or evicted, so a publish sends only that key's warm opens
back to the slow path.

``default_root`` is the one place that reads ``SHMCACHE_ROOT``; everything else takes an
explicit root.

Modes: what a writer creates is private (directories 0700, files 0600) in a personal
root. A team root (``shmcache serve --team``) is mode 02750 (setgid, group-readable): its
writers create directories 0750 and files 0640, which the team's group can read and no one
else. :func:`modes_of` decides that, from the root's own mode, for every writer.
"""

from __future__ import annotations

import contextlib
import os
import stat
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CacheRootError
from .trust import refuse_untrusted

__all__ = [
    "ARRAY_FILE",
    "BUDGET_NAME",
    "DIR_MARK",
    "ENTRY_FORMAT",
    "ENV_CONFIG",
    "ENV_PREFIX",
    "ENV_ROOT",
    "ENV_SOCKET",
    "ENV_TEAM",
    "ENV_TEAMS_FILE",
    "ENV_TOKEN",
    "GENERATION_BYTES",
    "GENERATION_SLOTS",
    "MANIFEST_FILE",
    "META_FILE",
    "PACKED_GUARD",
    "PID_NAME",
    "PRELOADS_NAME",
    "PRIVATE_MODES",
    "SHM_DIR",
    "SOCKET_NAME",
    "TEAM_MODES",
    "TEAM_ROOT_MODE",
    "Layout",
    "decode_key",
    "default_root",
    "encode_key",
    "entry_path",
    "flat_entry_names",
    "generation_slot",
    "mark_tree_format",
    "modes_of",
    "object_path",
    "packed_range",
    "prepare_root",
    "read_version",
    "version_of_target",
]

ENV_PREFIX = "SHMCACHE_"
ENV_ROOT = f"{ENV_PREFIX}ROOT"
ENV_SOCKET = f"{ENV_PREFIX}SOCKET"
ENV_TOKEN = f"{ENV_PREFIX}TOKEN"
ENV_CONFIG = f"{ENV_PREFIX}CONFIG"
ENV_TEAM = f"{ENV_PREFIX}TEAM"
"""A team's name: readers use its root (resolved through the teams file) as their root."""
ENV_TEAMS_FILE = f"{ENV_PREFIX}TEAMS_FILE"
"""The administrator's teams file, instead of /etc/shmcache/teams.toml (root-owned either way)."""
SHM_DIR = "/dev/shm"

SOCKET_NAME = "daemon.sock"
PID_NAME = "daemon.pid"
BUDGET_NAME = "budget.json"
PRELOADS_NAME = "preloads.json"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest"
"""What a directory put's batch version holds beside its entries' directories (``manifest``)."""
ARRAY_FILE = "data.npy"
"""The one file of an array entry (containers have one ``<name>.npy`` per part)."""

PACKED_GUARD = "packed"
"""An empty directory in a batch that packs entries into its manifest: an older shmcache
removes a batch whose directory counts no subdirectory when it evicts one of its keys, which
would take every packed entry with it; this keeps the count above that."""

GENERATION_SLOTS = 1024
GENERATION_BYTES = 8 * GENERATION_SLOTS
_SEPARATOR_ON_DISK = "~"  # not a key character, so the mapping is one-to-one
DIR_MARK = _SEPARATOR_ON_DISK
"""Ends the name of every prefix directory under ``entries/`` (no key segment has it)."""
_PREFIX_SEPARATOR = DIR_MARK + "/"
_IN_OBJECTS = "/objects/"
"""What a link's target holds before the version: everything after it is the version
(one name, or ``<batch>/<n>`` for an entry inside a directory put's batch version)."""
ENTRY_FORMAT = "2"
"""What ``<root>/format`` holds once the root's entries are a tree (see above)."""

PRIVATE_MODES = (0o700, 0o600)
"""(directories, files) that writers create in a personal root."""
TEAM_MODES = (0o750, 0o640)
"""(directories, files) that the team daemon creates in a team root: the group reads."""
TEAM_ROOT_MODE = 0o2750
"""A team root's own mode: setgid (all below gets the team's group), the group reads."""


def modes_of(root_mode: int) -> tuple[int, int]:
    """The one place the modes of what a writer creates are decided: (directories,
    files) for a root of mode ``root_mode``. A team root is exactly 02750 (setgid, the
    group reads, others nothing: what ``serve --team`` and its tmpfiles.d line make): the
    group may read what is made in it. Any other root is private, whatever its mode (a
    0755 directory a user made as ``$SHMCACHE_ROOT`` keeps 0700/0600 entries, as before).
    Nothing is ever writable by anyone but the writer."""
    return TEAM_MODES if stat.S_IMODE(root_mode) == TEAM_ROOT_MODE else PRIVATE_MODES


def default_root() -> Path:
    """``$SHMCACHE_ROOT``, else ``/dev/shm/shmcache-<uid>`` (a temp dir if no ``/dev/shm``)."""
    configured = os.environ.get(ENV_ROOT)
    if configured:
        return Path(configured)
    name = f"shmcache-{os.getuid()}"
    if os.path.isdir(SHM_DIR):
        return Path(SHM_DIR) / name
    import tempfile  # deferred: a fallback few roots need (import time of the open path)

    fallback = Path(tempfile.gettempdir()) / name
    warnings.warn(
        f"{SHM_DIR} does not exist; caching in {fallback} instead, which may be on disk "
        f"rather than in memory. Set {ENV_ROOT} to a tmpfs directory to silence this.",
        RuntimeWarning,
        stacklevel=3,
    )
    return fallback


def encode_key(key: str) -> str:
    """Flat file name of a (valid) key: its lock's name, and its link in a format 1 root."""
    return key.replace("/", _SEPARATOR_ON_DISK)


def decode_key(name: str) -> str:
    """Inverse of :func:`encode_key`."""
    return name.replace(_SEPARATOR_ON_DISK, "/")


def entry_path(key: str) -> str:
    """Path of a (valid) key's link relative to ``entries/``: ``a~/b~/c`` for ``a/b/c``."""
    return key.replace("/", _PREFIX_SEPARATOR)


def generation_slot(key: str) -> int:
    """The generation slot (1..SLOTS-1) of a key: stable across processes (CRC-32, not
    ``hash()``, which is salted per process)."""
    return 1 + zlib.crc32(key.encode("utf-8", "surrogatepass")) % (GENERATION_SLOTS - 1)


def object_path(root: str, version: str, filename: str) -> str:
    """A published file of a version (string formatting only: it is on the attach hot path)."""
    return f"{root}/objects/{version}/{filename}"


def packed_range(version: str) -> tuple[str, int, int, int] | None:
    """``(batch, n, offset, length)`` of an entry packed into its batch's manifest (version
    ``<batch>/<n>.<offset>.<length>``: its ``.npy`` is bytes ``offset..offset+length`` of
    ``objects/<batch>/manifest``), or None for any other version (``<batch>/<n>``: a
    directory of its own; one name: a version of its own). String work only: the open
    path finds the bytes without reading the manifest."""
    batch, slash, rest = version.partition("/")
    if not slash:
        return None
    index, dot, span = rest.partition(".")
    if not dot:
        return None
    offset, dot, length = span.partition(".")
    if not (dot and _digits(index) and _digits(offset) and _digits(length)):
        return None
    return batch, int(index), int(offset), int(length)


def _digits(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also takes ``"²"`` and other digits ``int``
    refuses, which a damaged link target could hold."""
    return text.isascii() and text.isdigit()


def version_of_target(target: str) -> str:
    """The version an entry link's target names: what follows ``objects/`` in
    ``../objects/<version>`` (one ``../`` per key segment)."""
    return target.partition(_IN_OBJECTS)[2]


def read_version(link: str | os.PathLike[str]) -> str | None:
    """The version an entry link points at, or None if there is no such link."""
    try:
        return os.readlink(link).partition(_IN_OBJECTS)[2]
    except (OSError, ValueError):  # missing, or a name no key could have (NUL, too long)
        return None


@dataclass(frozen=True)
class Layout:
    """Paths inside one cache root."""

    root: Path
    owner: tuple[int, int] | None = None
    """``(uid, gid)`` the root must have: a team's (from the teams file); None: ours."""
    _entries_prefix: str = field(init=False, repr=False, compare=False)
    _modes: list[tuple[int, int]] = field(init=False, repr=False, compare=False, default_factory=list)

    def __post_init__(self) -> None:
        # The prefix of every entry link, formatted once: entry_link is on the open path.
        object.__setattr__(self, "_entries_prefix", f"{self.root}/entries/")

    @property
    def modes(self) -> tuple[int, int]:
        """(directory mode, file mode) for what a writer creates here (:func:`modes_of`
        of the root's mode, read once the root exists)."""
        if self._modes:
            return self._modes[0]
        try:
            root_mode = os.stat(self.root).st_mode
        except OSError:
            return PRIVATE_MODES
        self._modes.append(modes_of(root_mode))
        return self._modes[0]

    @property
    def dir_mode(self) -> int:
        return self.modes[0]

    @property
    def file_mode(self) -> int:
        return self.modes[1]

    @property
    def entries(self) -> Path:
        return self.root / "entries"

    @property
    def objects(self) -> Path:
        return self.root / "objects"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def locks(self) -> Path:
        return self.root / "locks"

    @property
    def generation(self) -> Path:
        return self.root / "generation"

    @property
    def socket(self) -> Path:
        """Where ``shmcache serve`` listens by default."""
        return self.root / SOCKET_NAME

    @property
    def pid_file(self) -> Path:
        return self.root / PID_NAME

    @property
    def budget(self) -> Path:
        """The root's budget record (JSON), replaced whole by ``rename``."""
        return self.root / BUDGET_NAME

    @property
    def preloads(self) -> Path:
        """The daemon's record of the source its config preloads under each key (JSON)."""
        return self.root / PRELOADS_NAME

    @property
    def key_locks(self) -> Path:
        """Where per-key locks live: a namespace of their own, so that no key (``space``...)
        can share a lock file with the root's own locks."""
        return self.locks / "keys"

    def directories(self) -> tuple[Path, ...]:
        return (self.root, self.entries, self.objects, self.tmp, self.locks, self.key_locks)

    @property
    def format_file(self) -> Path:
        """Holds ``ENTRY_FORMAT`` once no flat (format 1) entry link is left."""
        return self.root / "format"

    def entry_link(self, key: str) -> str:
        """The symlink of a (valid) key (a ``str``: it is on the open hot path)."""
        return self._entries_prefix + key.replace("/", _PREFIX_SEPARATOR)

    def flat_entry_link(self, key: str) -> str:
        """Where a format 1 root kept the key's link (read on the miss path only)."""
        return self._entries_prefix + key.replace("/", _SEPARATOR_ON_DISK)

    def prefix_dir(self, prefix: str) -> str:
        """The directory holding every key under ``prefix`` (``entries/`` itself for "")."""
        if not prefix:
            return str(self.entries)
        return self._entries_prefix + prefix.replace("/", _PREFIX_SEPARATOR) + DIR_MARK

    def find_entry(self, key: str) -> tuple[str, str] | None:
        """``(link, version)`` of a (valid) key now, or None if it has no entry.

        A miss is read again before it is believed: a walk that entered a subtree just
        swapped out by a directory put (and being removed) may miss a key that the
        current subtree holds, and the walk after the swap finds it. Then the flat link of
        a format 1 root."""
        link = self.entry_link(key)
        for path in (link, link, self.flat_entry_link(key)):
            try:
                return path, os.readlink(path).partition(_IN_OBJECTS)[2]
            except (OSError, ValueError):  # missing, or a name no key could have
                continue
        return None

    def entry_version(self, key: str) -> str | None:
        """The version a (valid) key's entry points at, or None if it has none."""
        found = self.find_entry(key)
        return None if found is None else found[1]

    def has_entry(self, key: str) -> bool:
        return self.find_entry(key) is not None

    def links_under(self, prefix: str) -> dict[str, str]:
        """Name relative to ``prefix`` -> link path, for every key under ``prefix`` (all
        keys when ""), sorted by name. Empty when there are none or no root yet."""
        links: dict[str, str] = {}
        try:
            _walk(self.prefix_dir(prefix), "", links)
        except PermissionError as exc:  # another user's root
            raise CacheRootError(f"cannot read cache root {self.root}: {exc.strerror}") from exc
        if not self.format_file.exists():  # format 1 links the first writer has not migrated
            start = encode_key(prefix + "/") if prefix else ""
            for name in _listdir(self.entries):
                if _SEPARATOR_ON_DISK in name and name.startswith(start):
                    links.setdefault(decode_key(name[len(start) :]), f"{self._entries_prefix}{name}")
        return dict(sorted(links.items()))

    def names_under(self, prefix: str) -> list[str]:
        """The keys under ``prefix`` (a group), relative to it and sorted: ``["x"]`` for
        ``prefix/x``. Empty when there are none or no root yet."""
        return list(self.links_under(prefix))

    def link_target(self, version: str, key: str) -> str:
        """What the entry link of ``key`` to ``version`` contains: relative (so the root
        can move), climbing out of the key's prefix directories."""
        return "../" * (key.count("/") + 1) + "objects/" + version

    def version_dir(self, version: str) -> Path:
        return self.objects / version

    def object_file(self, version: str, filename: str) -> str:
        """A published file of a version (a ``str``: it is on the attach hot path); for an
        entry packed into its batch's manifest, that manifest (what holds its bytes, and
        what ``stat`` and lease probes should look at)."""
        if "." in version.partition("/")[2]:
            packed = packed_range(version)
            if packed is not None:
                return object_path(str(self.root), packed[0], MANIFEST_FILE)
        return object_path(str(self.root), version, filename)

    def key_slot_file(self, index: int) -> str:
        """One of the files whose bytes are the keys' locks (``_store/locks.py`` picks the
        file and the byte from a hash of the key)."""
        return f"{self.root}/locks/key-slots.{index:02d}.lock"

    def key_failure(self, key: str) -> Path:
        """The record of the key's last failed ``cache()`` load (JSON), for the callers
        that waited for it."""
        return self.key_locks / f"{encode_key(key)}.failed"

    @property
    def space_lock(self) -> Path:
        return self.locks / "space.lock"


def _listdir(path: str | Path) -> list[str]:
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _walk(directory: str, prefix: str, links: dict[str, str]) -> None:
    """Add ``prefix + name -> path`` for every entry link under ``directory`` (a subtree
    being swapped out may vanish under the walk: what is gone is skipped)."""
    try:
        scanned = os.scandir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return
    with scanned:
        for item in scanned:
            name = item.name
            if name.endswith(DIR_MARK):
                try:
                    is_dir = item.is_dir(follow_symlinks=False)
                except OSError:
                    continue
                if is_dir:
                    _walk(item.path, f"{prefix}{name[:-1]}/", links)
            elif _SEPARATOR_ON_DISK not in name:  # a leaf (flat format 1 names: links_under)
                links[prefix + name] = item.path


def _mkdir_private(path: Path, what: str, layout: Layout) -> None:
    try:
        os.mkdir(path, layout.dir_mode)
    except FileExistsError:
        pass
    except OSError as exc:
        raise CacheRootError(f"cannot create {what} {path}: {exc.strerror}") from exc
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise CacheRootError(f"cannot use {what} {path}: {exc.strerror}") from exc
    refuse_untrusted(path, st, what, layout.owner)  # a symlink, another user's, or writable by others


def prepare_root(root: Path, owner: tuple[int, int] | None = None) -> Layout:
    """Create the root and its sub-directories (mode 0700; in a team root, 0750) if
    needed; return the layout.

    Refuses (``CacheRootError``) a root or sub-directory that is a symlink, another
    user's (``owner``: not the team's), or writable by others (``trust``)."""
    layout = Layout(root, owner)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheRootError(f"cannot create the parent of cache root {root}: {exc.strerror}") from exc
    for directory in layout.directories():
        _mkdir_private(directory, "cache root" if directory == root else "cache directory", layout)
    _prepare_generation(layout)
    if not layout.format_file.exists() and not flat_entry_names(layout):
        mark_tree_format(layout)
    return layout


def flat_entry_names(layout: Layout) -> list[str]:
    """Names of the format 1 (flat) entry links left in ``entries/``."""
    return [n for n in _listdir(layout.entries) if _SEPARATOR_ON_DISK in n and not n.endswith(DIR_MARK)]


def mark_tree_format(layout: Layout) -> None:
    """Record that no flat entry link is left (written whole: a temporary name, renamed)."""
    staging = layout.root / f".format.{os.getpid()}.{os.urandom(4).hex()}"
    try:
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, layout.file_mode)
        try:
            os.write(fd, ENTRY_FORMAT.encode() + b"\n")
        finally:
            os.close(fd)
        os.replace(staging, layout.format_file)
    except OSError:  # no room: the next writer records it
        with contextlib.suppress(OSError):
            os.unlink(staging)


def _prepare_generation(layout: Layout) -> None:
    """Create the generation file whole (never seen short), or grow one written by an
    older version (8 bytes: slot 0 only) to the full table."""
    try:
        size = os.stat(layout.generation).st_size
    except FileNotFoundError:
        staging = layout.root / f".generation.{os.getpid()}.{os.urandom(4).hex()}"
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, layout.file_mode)
        try:
            os.pwrite(fd, os.urandom(GENERATION_BYTES), 0)
        finally:
            os.close(fd)
        try:
            os.link(staging, layout.generation)  # fails if another process won the race
        except FileExistsError:
            pass
        finally:
            os.unlink(staging)
        return
    if size < GENERATION_BYTES:
        os.truncate(layout.generation, GENERATION_BYTES)  # new slots start at 0
