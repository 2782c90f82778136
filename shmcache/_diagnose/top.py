"""``shmcache top``: which processes map entries of a root, and how much memory they use."""

from __future__ import annotations

from dataclasses import dataclass

from .._store import Store
from .procfs import Memory, command_line, read_memory

__all__ = ["ProcessRow", "mapping_processes"]


@dataclass(frozen=True)
class ProcessRow:
    """One line of ``shmcache top``."""

    pid: int
    command: str
    entries: list[str]
    """Keys it maps (``<evicted>`` for versions no longer published)."""
    memory: Memory


def mapping_processes(store: Store) -> tuple[list[ProcessRow], int]:
    """Processes that map entries of ``store``, by PSS (largest first), and the bytes of
    evicted or replaced entries still held by them."""
    scan = store.scan_mappings()
    key_of = {entry.version: entry.key for entry in store.list()}
    keys_by_pid: dict[int, set[str]] = {}
    for version, pids in scan.pids_by_version.items():
        for pid in pids:
            keys_by_pid.setdefault(pid, set()).add(key_of.get(version, "<evicted>"))
    rows = []
    for pid, keys in keys_by_pid.items():
        memory = read_memory(pid, store.layout.objects)
        if memory is not None:
            rows.append(ProcessRow(pid, command_line(pid), sorted(keys), memory))
    rows.sort(key=lambda row: (-row.memory.pss, row.pid))
    return rows, scan.deleted_bytes
