"""Human-readable sizes for messages and tables."""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(nbytes: int) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
