"""Which live processes map which entry versions (read from ``/proc/*/maps``).

Eviction must never pick an entry that a live process is reading; the kernel's view of
each process's mappings is the only reliable answer (no registration protocol can
survive ``kill -9``).
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .layout import MANIFEST_FILE, packed_range

__all__ = ["MappingScan", "mapped_versions", "scan_mappings"]

_DELETED = " (deleted)"


@dataclass
class MappingScan:
    """What live processes map under one ``objects/`` directory."""

    pids_by_version: dict[str, set[int]] = field(default_factory=dict)
    """Version directory name -> PIDs mapping one of its files (current or unlinked)."""
    deleted_bytes: int = 0
    """Bytes of unlinked (evicted or replaced) entry files still mapped by someone:
    memory that returns to the system only when those processes let go."""
    packed: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    """Batch -> ``(first byte, end, pid)`` of each mapping of its manifest: which of its
    packed entries a process maps (``pids_by_version`` has the batch's name: any of them).
    A reader maps the manifest once per 64 MiB window (``mapped.SharedManifest``): all the
    entries of a window it mapped, which is the truth about memory (the manifest's pages
    go only with the batch and its last mapping); a private writable array maps just its
    entry's pages."""
    unreadable: list[int] = field(default_factory=list)
    """PIDs whose maps this process may not read (another user's, without privileges):
    in a team root, other members' readers, which the scan cannot see."""

    def hidden_members(self, owner: int, gid: int) -> list[int]:
        """The :attr:`unreadable` processes that run with group ``gid`` (a team root's: its
        members'), as neither ``owner`` (the daemon) nor root (a ``runuser``/``sudo``
        wrapper keeps the group it started with: not a member's reader). Their
        ``/proc/PID/status`` is readable where their maps are not."""
        return [pid for pid in self.unreadable if _runs_as_member(pid, owner, gid)]

    def pids_of(self, version: str) -> set[int]:
        """PIDs mapping ``version``: for an entry packed in its batch's manifest, those
        whose mapping of the manifest covers its bytes."""
        span = packed_range(version)
        if span is None:
            return self.pids_by_version.get(version, set())
        batch, _, offset, length = span
        ranges = self.packed.get(batch, ())
        return {pid for start, end, pid in ranges if start < offset + length and offset < end}


def scan_mappings(objects_dir: Path) -> MappingScan:
    """Scan every readable ``/proc/<pid>/maps`` for files under ``objects_dir``.

    Processes whose maps we may not read (another user's, without privileges) are
    skipped and counted (``unreadable``): they cannot map this user's 0700 cache, but in a
    team root they are other members' readers.
    """
    prefix = os.path.realpath(objects_dir) + "/"
    needle = prefix.encode()
    pids_by_version: dict[str, set[int]] = defaultdict(set)
    packed: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    deleted_extent: dict[tuple[str, str], int] = {}
    unreadable: list[int] = []
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except FileNotFoundError:  # no procfs: report nothing mapped
        return MappingScan()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", "rb") as maps:
                data = maps.read()
        except PermissionError:  # not ours to read
            unreadable.append(pid)
            continue
        except OSError:  # exited meanwhile
            continue
        if needle not in data:
            continue
        for line in data.decode("utf-8", "replace").splitlines():
            where = line.find(prefix)
            if where < 0:
                continue
            # all but the file name: "<version>", a directory put's "<batch>/<n>", or
            # "<batch>" for its manifest (packed entries)
            version, _, name = line[where + len(prefix) :].rpartition("/")
            pids_by_version[version].add(pid)
            deleted = line.endswith(_DELETED)
            if deleted or name.startswith(MANIFEST_FILE):
                fields = line.split(maxsplit=5)
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if name.startswith(MANIFEST_FILE):
                    first = int(fields[2], 16)  # the file offset the mapping starts at
                    packed[version].append((first, first + end - start, pid))
            if deleted:
                ident = (fields[3], fields[4])  # device, inode
                deleted_extent[ident] = max(deleted_extent.get(ident, 0), end - start)
    return MappingScan(dict(pids_by_version), sum(deleted_extent.values()), dict(packed), unreadable)


def _runs_as_member(pid: int, owner: int, gid: int) -> bool:
    """Whether process ``pid`` has group ``gid`` and runs as neither ``owner`` nor root;
    False where it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fp:
            fields = dict(line.split(b":", 1) for line in fp.read().splitlines() if b":" in line)
    except OSError:
        return False
    uids = set(fields.get(b"Uid", b"").split()[:2])  # real, effective
    groups = fields.get(b"Gid", b"").split()[:1] + fields.get(b"Groups", b"").split()
    return not uids & {str(owner).encode(), b"0"} and str(gid).encode() in groups


def mapped_versions(objects_dir: Path) -> dict[str, set[int]]:
    """Map each version directory name under ``objects_dir`` to the PIDs that map it."""
    return scan_mappings(objects_dir).pids_by_version
