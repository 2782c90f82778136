"""Who loaded each entry, and what each user may hold.

Every version records ``owner_uid`` in its ``meta.json``: the writing process's uid, or,
for a put a daemon made for a team member, the member's (``acting_for``, set by the
daemon from ``SO_PEERCRED``). Usage per user is rebuilt from those records whenever it is
needed (a daemon restart loses nothing). A put that would take a member past the team's
``user_quota`` is refused before anything is written; budget eviction takes the least
recently used entries of members over their share first.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from .._units import human_bytes
from ..errors import QuotaExceededError
from .records import EntryInfo

__all__ = [
    "Usage",
    "acting_for",
    "check_quota",
    "current_owner",
    "fair_order",
    "owner_name",
    "usage_by_owner",
]

_OWNER: ContextVar[int | None] = ContextVar("shmcache_owner_uid", default=None)


def current_owner() -> int:
    """The uid new versions record as their owner (this process's, unless a daemon is
    acting for a member in this thread)."""
    uid = _OWNER.get()
    return os.geteuid() if uid is None else uid


@contextmanager
def acting_for(uid: int) -> Iterator[None]:
    """Record ``uid`` as the owner of what this thread writes meanwhile."""
    token = _OWNER.set(uid)
    try:
        yield
    finally:
        _OWNER.reset(token)


@dataclass(frozen=True)
class Usage:
    """One user's entries and bytes (``size``: what the entries occupy)."""

    uid: int | None
    """None: entries written before owners were recorded."""
    entries: int
    bytes: int


def usage_by_owner(entries: Iterable[EntryInfo]) -> dict[int | None, Usage]:
    """Each owner's entries and bytes, from the recorded owners."""
    counts: dict[int | None, list[int]] = {}
    for entry in entries:
        total = counts.setdefault(entry.owner_uid, [0, 0])
        total[0] += 1
        total[1] += entry.size
    return {uid: Usage(uid, n, size) for uid, (n, size) in counts.items()}


def owner_name(uid: int | None) -> str:
    """A user's name, or the uid where it has none (``-`` for an unrecorded owner)."""
    if uid is None:
        return "-"
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def check_quota(uid: int, quota: int | None, used: int, pending: int, nbytes: int) -> None:
    """Refuse (:class:`QuotaExceededError`) a put of ``nbytes`` by ``uid``, who holds
    ``used`` bytes and has ``pending`` more being written, if it would pass ``quota``."""
    if quota is None or used + pending + nbytes <= quota:
        return
    busy = f" (+{human_bytes(pending)} being written)" if pending else ""
    raise QuotaExceededError(
        f"quota exceeded: your quota ({owner_name(uid)}) is {human_bytes(quota)} and your entries use "
        f"{human_bytes(used)}{busy}; this put needs {human_bytes(nbytes)}. Evict some of your "
        "entries (`shmcache ls` shows the OWNER) or ask a team admin to raise user_quota"
    )


def fair_order(entries: list[EntryInfo], share: int | None) -> list[EntryInfo]:
    """Eviction candidates in the order to evict them: the least recently used entries of
    owners over ``share`` bytes first, then everyone's, least recently used first."""
    by_lru = sorted(entries, key=lambda e: e.last_used)
    if share is None:
        return by_lru
    usage = usage_by_owner(entries)
    over = {uid for uid, use in usage.items() if use.bytes > share}
    return [e for e in by_lru if e.owner_uid in over] + [e for e in by_lru if e.owner_uid not in over]

