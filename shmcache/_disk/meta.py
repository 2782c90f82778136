"""``meta.json``: the metadata file beside each version's ``.npy`` files."""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import CorruptEntryError
from .layout import META_FILE, Layout

__all__ = ["META_FORMAT", "damaged", "read_entry_meta", "read_meta"]

META_FORMAT = 1


def read_meta(layout: Layout, version: str) -> dict[str, Any]:
    """The metadata of a published version, or ``{}`` if it is gone (or unreadable)."""
    try:
        with open(layout.object_file(version, META_FILE), "rb") as fp:
            meta = json.load(fp)
    except (FileNotFoundError, NotADirectoryError, ValueError):  # JSON and UTF-8 errors are ValueErrors
        return {}
    return meta if isinstance(meta, dict) else {}


def damaged(key: str, what: str) -> CorruptEntryError:
    """The error every read and ``verify`` of a damaged entry raises: what is wrong, and the fix."""
    return CorruptEntryError(
        f"entry {key!r} is damaged: {what.rstrip('.')}. `shmcache verify` checks every entry; "
        f"`shmcache evict {key}` removes this one: put it again after"
    )


def read_entry_meta(layout: Layout, key: str, version: str) -> dict[str, Any] | None:
    """The metadata of ``version``, which ``key``'s entry link pointed at; None if the
    link moved meanwhile (replaced or evicted: resolve again). Raises :func:`damaged` if the
    link still points there and the version or its ``meta.json`` is missing, not a JSON object, or records
    another key (a link pointed at another entry's data). Metadata without a key (older
    entries) is taken as the key's."""
    try:
        with open(layout.object_file(version, META_FILE), "rb") as fp:
            raw = fp.read()
    except (FileNotFoundError, NotADirectoryError):
        if layout.entry_version(key) != version:
            return None  # evicted or replaced: both move the link before removing files
        if not os.path.isdir(layout.version_dir(version)):
            raise damaged(
                key,
                f"its data {layout.version_dir(version)} vanished "
                "(`shmcache cleanup` removes entries whose data vanished)",
            ) from None
        raise damaged(key, f"its {META_FILE} is missing from {layout.version_dir(version)}") from None
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        if layout.entry_version(key) != version:
            return None
        raise damaged(key, f"its {META_FILE} is not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise damaged(key, f"its {META_FILE} holds a {type(meta).__name__}, not an object")
    recorded = meta.get("key", key)
    if recorded != key:
        raise damaged(key, f"its link points at the data of entry {recorded!r}")
    return meta
