"""``shmcache top``: which processes map entries of a root, how much memory they use (and
GPU memory, from NVML where there is one), and which entries they pinned with CUDA."""

from __future__ import annotations

from dataclasses import dataclass, field

from .._disk.layout import packed_range
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
    """Keys it maps (``<evicted>`` for versions no longer published). An entry packed in a
    directory put's manifest counts as mapped when a mapped page holds any of its bytes: a
    reader maps its manifest in 64 MiB windows (``_disk/mapped.SharedManifest``), so all of
    those in a window it mapped."""
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
    keys_by_pid: dict[int, set[str]] = {}
    live: set[str] = set()  # versions of live entries (not packed ones)
    spans: dict[str, list[tuple[int, int]]] = {}  # batch -> byte ranges of its live packed entries
    for entry in store.list():
        span = packed_range(entry.version)
        if span is None:
            live.add(entry.version)
        else:
            spans.setdefault(span[0], []).append((span[2], span[2] + span[3]))
        for pid in scan.pids_of(entry.version):
            keys_by_pid.setdefault(pid, set()).add(entry.key)
    for version, pids in scan.pids_by_version.items():
        if version in live or version in scan.packed:
            continue  # a live entry's, or a manifest's (attributed by range below)
        for pid in pids:
            keys_by_pid.setdefault(pid, set()).add("<evicted>")
    for batch, ranges in scan.packed.items():  # a mapped manifest range that holds no live entry
        held = spans.get(batch, [])
        for start, end, pid in ranges:
            if not any(first < end and start < last for first, last in held):
                keys_by_pid.setdefault(pid, set()).add("<evicted>")
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
