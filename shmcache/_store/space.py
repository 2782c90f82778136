"""Space: check room before a write, and keep a byte budget by evicting least-recently-used
entries that are neither pinned nor mapped by a live process.

The budget in force is the root's (``budget.read_budget``, read under the space lock so
that a write never races a change of it), or the writer's own ``max_bytes`` where that is
lower (``Store(max_bytes=...)``).

Every writer records what it is about to write on its lock file before it writes; a check
counts what live writers have reserved and not written yet, so two loads that each fit
alone cannot both start and both fail midway."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from contextlib import suppress

from .._disk.fs import FileLockProbe, allocated_bytes, free_bytes, full_is_cache_full, total_bytes
from .._disk.layout import Layout
from .._disk.manifest import split_batch_version
from .._disk.procmaps import scan_mappings
from .._disk.writer import VersionWriter, writer_of
from .._units import human_bytes
from ..errors import CacheFullError, NoRoomError
from .budget import read_budget
from .catalog import held_by_batches, iter_infos, packed_batch, partial_bytes, used_bytes
from .locks import space_lock
from .maintenance import remove_dead_partials
from .reading import forget_attachments
from .records import EntryInfo

__all__ = ["VictimOrder", "budget_in_force", "reserve"]

logger = logging.getLogger(__name__)

_NAMED_PARTIAL = 1 << 20
"""Bytes of other writes in ``tmp/`` below which a message does not name them (every live
writer holds a lock file and directory blocks: a few KiB, not the reason)."""

EvictVersion = Callable[[str, str], "int | None"]
"""``(key, version) -> bytes freed``, or None if the key changed or its lock is taken."""
VictimOrder = Callable[[list[EntryInfo]], list[EntryInfo]]
"""Entries that may be evicted (neither pinned nor mapped) -> the order to evict them in."""


def reserve(
    layout: Layout,
    writer: VersionWriter,
    nbytes: int,
    *,
    budget: int | None,
    lock_timeout: float | None,
    evict_version: EvictVersion,
    replacing: Collection[str] = (),
    victim_order: VictimOrder | None = None,
) -> None:
    """Check room for ``nbytes`` (evicting for the budget if needed), then record it on
    the writer's lock file so that other writers count it.

    ``budget`` is the writer's own limit (None: the root's alone applies). Entries under
    ``replacing`` keys are about to be replaced: their bytes do not count against it.
    ``victim_order`` orders the entries that may be evicted (default: least recently
    used first; a team daemon puts the entries of members over their share first).
    """
    with full_is_cache_full(layout.space_lock), space_lock(layout, lock_timeout):
        others = _live_reservations(layout, writer)
        limit = budget_in_force(layout, budget)
        if limit is not None:
            _make_room_in_budget(layout, nbytes, limit, set(replacing), evict_version, others, victim_order)
        free = free_bytes(layout.root)
        pending = sum(max(0, reserved - written) for _, reserved, written in others)
        # what this writer wrote already (a reservation grown as it writes) is no longer free
        # but is in nbytes: count it once (looked up only then: it lists objects/)
        written = _written_by(layout, writer.writer_id) if nbytes > free - pending else 0
        if nbytes - written > free - pending:  # what dead writers left in tmp/ may be the reason
            remove_dead_partials(layout)
            free = free_bytes(layout.root)
        if nbytes - written > free - pending:
            raise CacheFullError(_no_room(layout, writer, nbytes - written, bool(written), free, pending))
        writer.reserve(nbytes)


def _no_room(layout: Layout, writer: VersionWriter, short: int, more: bool, free: int, pending: int) -> str:
    """Why ``short`` bytes do not fit on the file system: what is free and what other
    writes hold (in ``tmp/``: no entry counts them), and the fixes that apply (evicting
    only where there are entries)."""
    held = f", {human_bytes(pending)} of it reserved by writers still writing" if pending else ""
    fixes = ["evict entries (`shmcache evict`)"] if layout.links_under("") else []
    partial = partial_bytes(layout, but=writer.writer_id)
    if partial >= _NAMED_PARTIAL:
        held += f"; {human_bytes(partial)} is held by other writes in progress in {layout.tmp} (not entries)"
        fixes.append("wait for those writes to end")
    fixes.append("enlarge /dev/shm (Docker: --shm-size or --ipc=host)")
    advice = fixes[0] if len(fixes) == 1 else ", ".join(fixes[:-1]) + " or " + fixes[-1]
    return (
        f"need {human_bytes(short)}{' more' if more else ''} but the file system of {layout.root} has only "
        f"{human_bytes(free)} free (of {human_bytes(total_bytes(layout.root))}){held}; {advice}"
    )


def budget_in_force(layout: Layout, own: int | None) -> tuple[int, str] | None:
    """The budget a writer must keep, and whose it is: the lower of the root's recorded
    budget and the writer's ``own`` limit; None when neither is set."""
    record = read_budget(layout)
    if record is not None and (own is None or record.max_bytes <= own):
        return record.max_bytes, f"the root's budget, set by {record.set_by}"
    if own is not None:
        return own, "this Store's max_bytes"
    return None


def _make_room_in_budget(
    layout: Layout,
    nbytes: int,
    limit: tuple[int, str],
    replacing: set[str],
    evict_version: EvictVersion,
    others: list[tuple[str, int, int]],
    victim_order: VictimOrder | None = None,
) -> None:
    budget, whose = limit
    if used_bytes(layout, replacing) + sum(r for _, r, _ in others) + nbytes <= budget:
        return  # the common case, without reading every entry's record
    entries = [e for e in iter_infos(layout) if e.key not in replacing]
    reserved = _still_reserved(others, entries)
    held = held_by_batches(layout, [(e.version, e.size) for e in entries])
    used = sum(e.size for e in entries) + sum(held.values()) + reserved
    excess = used + nbytes - budget
    if excess <= 0:
        return
    forget_attachments(layout.root)  # our own cache alone must not pin entries
    scan = scan_mappings(layout.objects)  # a packed entry: mapped if its bytes in the manifest are
    mapped = {e.version for e in entries if scan.pids_of(e.version)}
    evictable = [e for e in entries if not e.pinned and e.version not in mapped]
    if victim_order is None:
        candidates = sorted(evictable, key=lambda e: e.last_used)
    else:
        candidates = victim_order(evictable)
    members = _batch_members(entries)
    if _freed_by(candidates, members, held) < excess:
        pinned = [e.key for e in entries if e.pinned]
        kept = {e.version for e in candidates}  # a victim order leaves out what a lease probe found in use
        probed = [e for e in evictable if e.version not in kept]
        busy = [e.key for e in entries if e.version in mapped] + [e.key for e in probed]
        whole = any(packed_batch(v) for v in mapped) or any(packed_batch(e.version) for e in probed)
        raise NoRoomError(
            f"need {human_bytes(nbytes)} within the budget of {human_bytes(budget)} ({whose}), "
            f"{human_bytes(used)} used; only {human_bytes(_freed_by(candidates, members, held))} could be "
            f"evicted. Pinned: {_names(pinned)}; mapped by live processes: {_names(busy)}"
            + (" (a process that opens an entry packed in a directory put's manifest maps its "
               "whole 64 MiB window of the manifest, and the daemon probes it as one file: every "
               "entry packed there counts as mapped)" if whole else "")
            + ". Evict some "
            "(`shmcache evict KEY`), let the processes that map them exit, or raise the budget "
            "(`shmcache budget set SIZE`)"
        )
    for entry in candidates:
        if excess <= 0:
            break
        # evict_version never waits for a key lock: a cache() loader holds its key lock
        # and then waits for the space lock we hold (lock-order deadlock).
        if evict_version(entry.key, entry.version) is not None:
            logger.info("evicted %s (%d bytes) to stay within the budget", entry.key, entry.size)
            if packed_batch(entry.version) is None:
                excess -= entry.size  # its own directory or file: freed now
            batch = _batch_of(entry)
            if batch is not None:  # a packed entry's bytes go with its batch's last entry
                count, live = members[batch]
                members[batch] = (count - 1, live)
                if count == 1:
                    excess -= live + held.get(batch, 0)
    if excess > 0:
        raise CacheFullError(
            f"need {human_bytes(nbytes)} within the budget of {human_bytes(budget)} ({whose}); "
            f"{human_bytes(excess)} could not be freed because the entries to evict were being "
            "replaced or loaded by other processes; try again"
        )


def _batch_of(entry: EntryInfo) -> str | None:
    """The directory put's batch an entry is part of (None: a version of its own)."""
    found = split_batch_version(entry.version)
    return None if found is None else found[0]


def _batch_members(entries: list[EntryInfo]) -> dict[str, tuple[int, int]]:
    """Batch -> how many of ``entries`` are in it (packed or not: its manifest stays while
    any is), and the bytes of those packed into its manifest."""
    members: dict[str, tuple[int, int]] = {}
    for entry in entries:
        batch = _batch_of(entry)
        if batch is not None:
            count, live = members.get(batch, (0, 0))
            packed = entry.size if packed_batch(entry.version) is not None else 0
            members[batch] = (count + 1, live + packed)
    return members


def _freed_by(victims: list[EntryInfo], members: dict[str, tuple[int, int]], held: dict[str, int]) -> int:
    """Bytes evicting every one of ``victims`` would free: an entry of its own (or an entry
    directory) frees its size; a packed entry frees nothing until its batch's last entry
    goes, then the whole manifest (its entries' bytes and what it holds beyond them)."""
    left = {batch: count for batch, (count, _) in members.items()}
    freed = 0
    for entry in victims:
        if packed_batch(entry.version) is None:
            freed += entry.size
        batch = _batch_of(entry)
        if batch is not None:
            left[batch] -= 1
    return freed + sum(members[b][1] + held.get(b, 0) for b, n in left.items() if n == 0)


def _live_reservations(layout: Layout, writer: VersionWriter) -> list[tuple[str, int, int]]:
    """``(writer, bytes reserved, bytes already written)`` of every other live writer (the
    file system's free space already lacks what they wrote)."""
    found = []
    for lock in layout.tmp.glob("*.lock"):
        if lock == writer.lock_path or not FileLockProbe.holder_alive(lock):
            continue
        with suppress(OSError, ValueError):
            other = writer_of(lock.name)
            found.append((other, int(lock.read_text() or 0), _written_by(layout, other)))
    return found


def _still_reserved(others: list[tuple[str, int, int]], entries: list[EntryInfo]) -> int:
    """What live writers reserved beyond the entries they have published already: a
    writer's reservation stays on its lock file until it closes, a moment after its
    entries are linked and counted among ``entries``; counting both would evict for
    bytes counted twice (the entry just published, at worst)."""
    if not others:
        return 0
    published: dict[str, int] = {}
    for entry in entries:
        owner = writer_of(entry.version.partition("/")[0])
        published[owner] = published.get(owner, 0) + entry.size
    return sum(max(0, reserved - published.get(other, 0)) for other, reserved, _ in others)


def _written_by(layout: Layout, writer_id: str) -> int:
    """Bytes allocated so far by a writer's versions, in ``tmp/`` or promoted to ``objects/``."""
    return sum(
        allocated_bytes(version)
        for folder in (layout.tmp, layout.objects)
        for version in folder.glob(f"{writer_id}.*")
        if version.name[len(writer_id) + 1 :].isdigit()
    )


def _names(keys: list[str]) -> str:
    if not keys:
        return "none"
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
