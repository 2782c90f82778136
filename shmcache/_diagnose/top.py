"""``shmcache top``: which processes map entries of a root, how much memory they use (and
GPU memory, from NVML where there is one), and which entries they pinned with CUDA."""

from __future__ import annotations

from dataclasses import dataclass, field

from .._disk.pin_records import live_pins
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
    cuda_pins: list[str] = field(default_factory=list)
    """Keys it pinned with ``shmcache.torch`` (`` (staged)``: not registered, copied
    through a pinned buffer), from the root's ``pins/`` records."""
    gpu: int | None = None
    """Bytes of GPU memory it holds (NVML), None where unknown."""


def mapping_processes(store: Store, gpu: dict[int, int] | None = None) -> tuple[list[ProcessRow], int]:
    """Processes that map entries of ``store``, by PSS (largest first), and the bytes of
    evicted or replaced entries still held by them. ``gpu``: bytes of GPU memory by pid
    (from :class:`~shmcache._diagnose.nvml.GpuMemory`), None without NVML."""
    scan = store.scan_mappings()
    key_of = {entry.version: entry.key for entry in store.list()}
    keys_by_pid: dict[int, set[str]] = {}
    for version, pids in scan.pids_by_version.items():
        for pid in pids:
            keys_by_pid.setdefault(pid, set()).add(key_of.get(version, "<evicted>"))
    pins = live_pins(store.root)
    rows = []
    for pid, keys in keys_by_pid.items():
        memory = read_memory(pid, store.layout.objects)
        if memory is not None:
            pinned = sorted(p.key + ("" if p.registered else " (staged)") for p in pins.get(pid, []))
            used = None if gpu is None else gpu.get(pid, 0)
            rows.append(ProcessRow(pid, command_line(pid), sorted(keys), memory, pinned, used))
    rows.sort(key=lambda row: (-row.memory.pss, row.pid))
    return rows, scan.deleted_bytes
