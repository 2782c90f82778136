"""Doctor's ``huge_pages`` check: whether the cache's tmpfs can hold transparent huge pages.

An in-memory numpy array of a few MiB or more sits on 2 MiB transparent huge pages (numpy
asks with ``madvise``); an entry on tmpfs sits on 4 KiB pages unless the tmpfs mount says
``huge=within_size`` (or ``always``), or the kernel forces it
(``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` ``force``). On 4 KiB pages, random
rows of a big entry miss the TLB more: random batches of 256 rows from a 256 MiB entry
gathered at about 0.6-0.8x the speed of the in-memory array here, 0.9-1.0x on a
``huge=within_size`` tmpfs (BENCHMARKS.md, bench_loader). Entries written before the
setting changed keep their small pages. Without root, on Linux >= 6.1,
``CachedDataset(..., huge_pages=True)`` collapses an entry's pages into huge ones itself
(``_disk/huge_map.py``): the fix says so first where this kernel allows it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .._disk.huge_map import supported as collapse_supported

__all__ = ["huge_pages_report", "mount_huge_option", "shmem_enabled"]

_SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
_HUGE_MOUNT_VALUES = ("always", "within_size")  # "advise": write() allocates small pages


def shmem_enabled(path: str = _SHMEM_ENABLED) -> str | None:
    """The kernel's shmem huge page setting (the bracketed word), or None if unknown."""
    try:
        with open(path) as fp:
            text = fp.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def mount_huge_option(path: Path) -> tuple[str, str, str]:
    """(mount point, file system type, ``huge=`` value: ``never`` when absent) of the
    mount holding ``path``, from ``/proc/self/mounts``."""
    real = os.path.realpath(_existing(path))
    best = ("/", "?", "never")
    try:
        with open("/proc/self/mounts") as fp:
            for line in fp:
                parts = line.split()
                if len(parts) < 4:
                    continue
                point = parts[1].replace("\\040", " ")
                if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
                    options = dict(o.partition("=")[::2] for o in parts[3].split(","))
                    best = (point, parts[2], options.get("huge", "never"))
    except OSError:
        pass
    return best


def huge_pages_report(root: Path) -> tuple[str, str, str, dict[str, Any]]:
    """(status, summary, fix, details) of the huge page check for the cache ``root``."""
    point, fs_type, huge = mount_huge_option(root)
    kernel = shmem_enabled()
    collapse = collapse_supported()
    details: dict[str, Any] = {
        "mount": point,
        "fs_type": fs_type,
        "huge": huge,
        "shmem_enabled": kernel,
        "madv_collapse": collapse,
    }
    if fs_type != "tmpfs":
        return "ok", f"{point} is {fs_type}, not tmpfs: no shmem huge pages to ask for", "", details
    if kernel == "deny":
        return (
            "ok",
            "shmem_enabled=deny: entries sit on 4 KiB pages (random rows of big entries miss the "
            "TLB more than an in-memory array on huge pages: ~0.6-0.8x its batch gather speed)",
            f"echo within_size > {_SHMEM_ENABLED} (as root), then put entries again",
            details,
        )
    if kernel == "force" or huge in _HUGE_MOUNT_VALUES:
        how = "shmem_enabled=force" if kernel == "force" else f"{point} is mounted huge={huge}"
        summary = f"{how}: new entries may sit on 2 MiB pages (random rows at in-memory speed)"
        return "ok", summary, "", details
    mount = (
        f"mount -o remount,huge=within_size {point} (as root; or a cache root on such a tmpfs), "
        "then put entries again"
    )
    no_root = (
        "without root: shmcache.torch.CachedDataset(..., huge_pages=True) puts the entries it "
        "reads on huge pages itself (this kernel allows it; docs/huge-pages.md); or for every "
        "reader: "
    )
    return (
        "ok",
        f"{point} is mounted without huge= (huge={huge}): entries sit on 4 KiB pages; random rows "
        "of big entries miss the TLB more than an in-memory array on huge pages (~0.6-0.8x its "
        "batch gather speed)",
        (no_root if collapse else "") + mount,
        details,
    )


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
