"""Key validation: what a key may be (its file name is in ``layout``).

Keys are ``/``-joined segments of ``[A-Za-z0-9._-]``; they name entries across every
process, so anything ambiguous (``..``, empty segments, absolute paths) is refused.
"""

from __future__ import annotations

import re

from ..errors import InvalidKeyError

__all__ = ["MAX_KEY_LENGTH", "is_key", "key_in_prefix", "validate_key"]

MAX_KEY_LENGTH = 200
"""Longest key accepted; its file name (plus a ``.lock`` suffix) fits NAME_MAX."""

_SEGMENT = r"(?!\.\.?(?:/|\Z))[A-Za-z0-9._-]+"  # a segment that is not "." or ".."
_KEY_RE = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})*")


def validate_key(key: object) -> str:
    """Return ``key`` if it is a valid key, else raise :class:`InvalidKeyError`."""
    if not isinstance(key, str):
        raise InvalidKeyError(f"key must be a str, got {type(key).__name__}: {key!r}")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKeyError(
            f"key is {len(key)} characters long; the limit is {MAX_KEY_LENGTH}: {key[:40]!r}..."
        )
    if _KEY_RE.fullmatch(key) is None:
        raise InvalidKeyError(
            f"invalid key {key!r}: use segments of letters, digits, '.', '_' or '-' joined "
            "by '/', with no empty, '.' or '..' segment and no leading '/'"
        )
    return key


def is_key(text: str) -> bool:
    """Whether ``text`` has a key's form (its length aside): many names joined by ``/``
    are checked in one match (a directory put's files)."""
    return _KEY_RE.fullmatch(text) is not None


def key_in_prefix(key: str, prefix: str | None) -> bool:
    """Whether ``key`` is ``prefix`` itself or lies under it (segment-wise)."""
    if not prefix:
        return True
    prefix = prefix.rstrip("/")
    return key == prefix or key.startswith(prefix + "/")
