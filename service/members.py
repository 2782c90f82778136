"""What the daemon lets each member do: evict only their own entries (admins: any), stay
within the team's per-user quota, and what a member's fair share of the budget is.

The uid is always the kernel's (``SO_PEERCRED`` of the member's connection), never a
claim of the member's.
"""

from __future__ import annotations

import os
import pwd
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shmcache import EntryInfo, Store
from shmcache._disk.layout import Layout
from shmcache._disk.leases import in_use
from shmcache._disk.meta import read_meta
from shmcache._store.catalog import iter_infos
from shmcache._store.ownership import check_quota, fair_order, owner_name, usage_by_owner
from shmcache._store.space import VictimOrder
from shmcache._team.config import load_team
from shmcache.errors import KeyNotFoundError, NotPermittedError, SourceNotAllowedError

from .settings import Settings

__all__ = ["MemberPolicy", "admin_uids", "policy_of"]


def admin_uids(names: Iterable[str]) -> frozenset[int]:
    """The uids of the admins named in a team's config (names without an account are skipped)."""
    uids = set()
    for name in names:
        try:
            uids.add(pwd.getpwnam(name).pw_uid)
        except KeyError:
            continue
    return frozenset(uids)


@dataclass(frozen=True)
class MemberPolicy:
    """A root's rules for the users who connect to its daemon (none for a personal root)."""

    user_quota: int | None = None
    """Bytes each member's entries may hold (None: no per-member limit)."""
    admins: frozenset[int] = field(default_factory=frozenset)
    """Uids that may evict (and replace) anyone's entries; the daemon's own user and root may too."""
    team: bool = False
    """A team root: the daemon reads sources with its own rights only under allow_sources."""

    def is_admin(self, uid: int) -> bool:
        return uid in self.admins or uid in (os.geteuid(), 0)

    def check_admin(self, uid: int | None, action: str) -> None:
        """Refuse a member (not an admin) ``action`` on the whole root (TCP: the token decides)."""
        if uid is None or not self.team or self.is_admin(uid):
            return
        raise NotPermittedError(f"{owner_name(uid)} may not {action}: only the team's admins may")

    def check_source(self, source: str, allowed: Sequence[Path | str]) -> None:
        """A team daemon reads a source with its own rights only where the team allows it
        (``allow_sources``); without any, members put files they read themselves."""
        if self.team and not allowed:
            raise SourceNotAllowedError(
                f"source {source[:200]}: this team's daemon loads no source with its own rights (the "
                "team declares no allow_sources); put it with your own: `shmcache put PATH --key KEY "
                "--team NAME` or shmcache.put_file(..., team=NAME)"
            )

    def check_load(
        self, uid: int, store: Store, key: str, keys: list[str], overwrite: bool, source: Path | str
    ) -> None:
        """A load the daemon runs for ``uid``: it replaces none of another member's entries,
        and fits ``uid``'s quota."""
        wanted = set(keys)
        current = {e.key: e for e in store.list() if e.key in wanted}
        for entry in current.values():
            self.check_may_remove(uid, entry, "replace")
        if self.user_quota is None:
            return
        needed = sum(item.size for item in store.plan_file(key, source))
        used = sum(e.size for e in store.list() if e.owner_uid == uid and e.key not in current)
        check_quota(uid, self.user_quota, used, 0, needed)

    def evict_own(self, uid: int, store: Store, key: str) -> int:
        """Evict ``key`` for member ``uid`` if it is theirs; the bytes freed."""
        entry = store.info(key)
        self.check_may_remove(uid, entry)
        freed = store._evict_version(key, entry.version)
        if freed is None:
            raise KeyNotFoundError(f"entry {key!r} was replaced or evicted meanwhile; look again")
        return freed

    def check_may_remove(self, uid: int, entry: EntryInfo, action: str = "evict") -> None:
        """Refuse (:class:`NotPermittedError`) ``uid`` removing another member's entry."""
        if entry.owner_uid in (None, uid) or self.is_admin(uid):
            return
        raise NotPermittedError(
            f"{owner_name(uid)} may not {action} {entry.key!r}: {owner_name(entry.owner_uid)} loaded it, "
            "and a member evicts or replaces only their own entries; ask them or a team admin"
        )

    def share(self, budget: int | None, entries: list[EntryInfo]) -> int | None:
        """A member's fair share of the budget: the per-user quota where one is set, else
        the budget split evenly among the users who hold entries."""
        if self.user_quota is not None:
            return self.user_quota
        owners = len(usage_by_owner(entries))
        return None if budget is None or owners == 0 else budget // owners

    def victim_order(self, budget: int | None, layout: Layout) -> VictimOrder:
        """Eviction order for a put: members over their share (counted over every entry,
        pinned and mapped ones too) lose their least recently used entries first. Entries
        that some process has open or maps are left out: the daemon may not read other
        users' ``/proc/<pid>/maps``, but a lease probe sees their mappings."""

        def order(evictable: list[EntryInfo]) -> list[EntryInfo]:
            everyone = list(iter_infos(layout))
            share = self.share(budget, everyone)
            usage = usage_by_owner(everyone)
            over = {uid for uid, use in usage.items() if share is not None and use.bytes > share}
            probed: dict[str, bool] = {}  # a batch's packed entries share one manifest: one probe
            free = [e for e in evictable if not _mapped(layout, e, probed)]
            ordered = fair_order(free, None)
            return [e for e in ordered if e.owner_uid in over] + [
                e for e in ordered if e.owner_uid not in over
            ]

        return order


_OWN_OPEN_WAIT_S = 0.02
_OWN_OPEN_TRIES = 100
"""How long a lease probe refused while this daemon itself has the file open is asked
again (up to 2 s): its own threads open a manifest briefly (cleanup, a listing, a
member's ``info``), and the kernel counts those opens as anyone's."""


def _mapped(layout: Layout, entry: EntryInfo, probed: dict[str, bool]) -> bool:
    """Whether any process has one of the entry's files open or mapped (a lease probe;
    ``probed``: path -> answer, of the files asked already)."""
    meta = read_meta(layout, entry.version)
    names = (meta.files if meta is not None else None) or ("data",)
    for name in names:
        path = layout.object_file(entry.version, f"{name}.npy")
        if path not in probed:
            probed[path] = _in_use(path)
        if probed[path]:
            return True
    return False


def _in_use(path: str) -> bool:
    """:func:`in_use`, not fooled by this daemon's own brief opens of the file: the kernel
    refuses the lease for those as for anyone's (a packed batch then counted as mapped,
    and a member's new entry evicted instead, or a put refused). While a descriptor of
    this process holds the file (not a mapping: that one is in use), ask again, a while."""
    for _ in range(_OWN_OPEN_TRIES):
        if not in_use(path):
            return False
        if not _open_here(path) and in_use(path) and not _open_here(path):
            return True  # refused twice with no open of ours in between: another process's
        time.sleep(_OWN_OPEN_WAIT_S)
    return True


def _open_here(path: str) -> bool:
    """Whether a descriptor of this process has ``path`` open (``/proc/self/fd``)."""
    try:
        st = os.stat(path)
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            found = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if (found.st_dev, found.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def policy_of(settings: Settings) -> MemberPolicy:
    """The rules of the daemon's root: its team's (``serve --team``), none for a personal root."""
    if settings.team is None:
        return MemberPolicy()
    team = load_team(settings.team)
    return MemberPolicy(user_quota=team.user_quota, admins=admin_uids(team.admins), team=True)
