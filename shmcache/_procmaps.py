"""Which live processes map which entry versions (read from ``/proc/*/maps``).

Eviction must never pick an entry that a live process is reading; the kernel's view of
each process's mappings is the only reliable answer (no registration protocol can
survive ``kill -9``).
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

__all__ = ["mapped_versions"]


def mapped_versions(objects_dir: Path) -> dict[str, set[int]]:
    """Map each version directory name under ``objects_dir`` to the PIDs that map it.

    Processes whose maps we may not read (another user's, without privileges) are
    skipped: they cannot map this user's 0700 cache anyway.
    """
    prefix = os.path.realpath(objects_dir) + "/"
    found: dict[str, set[int]] = defaultdict(set)
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except FileNotFoundError:  # no procfs: report nothing mapped
        return {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", "rb") as maps:
                data = maps.read()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        if prefix.encode() not in data:
            continue
        for line in data.decode("utf-8", "replace").splitlines():
            where = line.find(prefix)
            if where >= 0:
                version = line[where + len(prefix) :].split("/", 1)[0]
                found[version].add(pid)
    return dict(found)
