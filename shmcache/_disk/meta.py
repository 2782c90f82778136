"""``meta.json``: the metadata file beside each version's ``.npy`` files."""

from __future__ import annotations

import json
from typing import Any

from .layout import META_FILE, Layout

__all__ = ["META_FORMAT", "read_meta"]

META_FORMAT = 1


def read_meta(layout: Layout, version: str) -> dict[str, Any]:
    """The metadata of a published version, or ``{}`` if it is gone (or unreadable)."""
    try:
        with open(layout.object_file(version, META_FILE), "rb") as fp:
            meta: dict[str, Any] = json.load(fp)
            return meta
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return {}
