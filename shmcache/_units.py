"""Human-readable sizes for messages and tables."""

from __future__ import annotations

import re

__all__ = ["human_bytes", "size_in_bytes"]

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?)B?\s*", re.IGNORECASE)


def human_bytes(nbytes: int) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def size_in_bytes(value: object) -> int:
    """``"8GiB"``, ``"500M"``, ``"1.5G"`` or an integer -> bytes (K/M/G/T/P are powers of
    1024); ValueError saying what a size looks like otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        match = _SIZE_RE.fullmatch(value)
        if match:
            number, unit = float(match.group(1)), match.group(2).upper()
            return int(number * 1024 ** " KMGTP".index(unit or " "))
    raise ValueError(f"must be a size such as 8GiB, 500M or 1073741824, got {value!r}")
