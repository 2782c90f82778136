"""Source URLs (``s3://``, ``gs://``, ``hf://``, ``https://``...): telling them from paths, and
the form that may be shown or recorded.

A URL may carry secrets (``user:password@``, a presigned query string); only its redacted
form (:func:`redact_url`) ever reaches a message, a log line, a job record or ``meta.json``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from ..errors import InvalidSourceError

__all__ = [
    "BACKEND_EXTRAS",
    "is_url",
    "local_path_of",
    "redact_url",
    "scrub",
    "secret_strings",
    "url_allowed",
]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

BACKEND_EXTRAS: dict[str, tuple[str, str]] = {
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"),
    "abfs": ("adlfs", "azure"),
    "abfss": ("adlfs", "azure"),
    "hf": ("huggingface_hub", "hf"),
    "http": ("aiohttp", "http"),
    "https": ("aiohttp", "http"),
}
"""URL scheme -> (the package fsspec needs for it, the shmcache extra that installs it)."""


def is_url(source: object) -> bool:
    """Whether ``source`` is a ``scheme://`` string (``file://`` included) rather than a path."""
    return isinstance(source, str) and _SCHEME.match(source) is not None


def local_path_of(url: str) -> str | None:
    """The path of a ``file://`` URL (``file:///data/x.npy`` -> ``/data/x.npy``); None for
    any other URL."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "file":
        return None
    if parts.netloc not in ("", "localhost"):
        raise InvalidSourceError(f"{redact_url(url)}: a file:// URL names a file on this machine (no host)")
    return unquote(parts.path) or "/"


def redact_url(url: str) -> str:
    """``url`` without what may be secret: user information (``user:token@``), the query string
    (presigned signatures) and the fragment."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def url_allowed(url: str, prefixes: Iterable[str]) -> bool:
    """Whether the redacted ``url`` lies under one of ``prefixes`` (URL prefixes matched at
    a ``/`` boundary; ``.``/``..`` segments never match: no climbing out of a prefix)."""
    shown = redact_url(url)
    path = urlsplit(shown).path
    if any(segment in (".", "..") for segment in unquote(path).split("/")):
        return False
    for prefix in prefixes:
        base = prefix.rstrip("/")
        if shown == base or shown.startswith(base + "/"):
            return True
    return False


def secret_strings(url: str, options: Mapping[str, Any] | None) -> list[str]:
    """Every string that must never be shown: the URL's user information and query, and
    every string value (at any depth) of its storage options."""
    found: list[str] = []
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    found += [s for s in (userinfo, *userinfo.split(":"), parts.query, unquote(parts.query)) if s]

    def walk(value: Any) -> None:
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, Mapping):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(dict(options or {}))
    # Short values (a region, "true") are not secrets and would garble messages.
    return sorted({s for s in found if len(s) >= 6}, key=len, reverse=True)


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every secret replaced by ``***``."""
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def fspath_or_url(source: str | os.PathLike[str]) -> str:
    """The source as text: a URL as given, a path via ``os.fspath``."""
    return source if isinstance(source, str) else os.fspath(source)
