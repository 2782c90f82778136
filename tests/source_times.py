"""Sources whose time stamps are old: a put records a source modified within
``source_files.RACY_NS`` of its read as racily clean (its fingerprint never current), so a
test that expects an up-to-date check to pass ages its files first, as files left alone
for a while are."""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["age"]


def age(*paths: Path, seconds: int = 3600) -> None:
    """Set the mtime (and atime) of each file of ``paths`` (directories: every file under
    them) to ``seconds`` ago."""
    then = time.time_ns() - seconds * 1_000_000_000
    for path in paths:
        files = [Path(d) / f for d, _, names in os.walk(path) for f in names] if path.is_dir() else [path]
        for file in files:
            os.utime(file, ns=(then, then))
