"""Suggested commands said to a team's member: ``shmcache --team NAME evict KEY``, not
``shmcache evict KEY`` (which works on the member's own root). The core words its fixes
for a personal root; a caller that knows the team rewords them."""

from __future__ import annotations

import re

__all__ = ["for_team"]

_COMMAND = re.compile(r"(?<![\w./-])shmcache (?=(?:ls|evict|budget|stats|cleanup|info|verify)\b)")
"""``shmcache <command>`` without ``--team``; ``put`` and ``serve`` fixes name the team already."""


def for_team(text: str, team: str | None) -> str:
    """``text`` with each suggested ``shmcache <command>`` on ``team``'s root (unchanged
    for None)."""
    return text if team is None else _COMMAND.sub(f"shmcache --team {team} ", text)
