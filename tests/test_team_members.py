"""Members of a team writing through its daemon, as real users (``useradd``; skipped where
users cannot be made): ownership is the kernel's word (``SO_PEERCRED``), a member evicts
or replaces only their own entries (an admin: any), a member reads sources with their own
rights only (no confused deputy), quotas are per user.

The daemon side is a write channel served by this process (running as root, the service
account here) on a root its members may reach; ``shmcache serve --team``'s own tests
cover the daemon's start-up, modes and group checks.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from service_helpers import clean_env, temporary_root
from shmcache.service.fd_channel import FdChannel
from shmcache.service.members import MemberPolicy
from team_helpers import User, as_user, forked_as, made_users

from shmcache import CacheFullError, InvalidSourceError, NotPermittedError, QuotaExceededError, Store
from shmcache._disk.layout import SHM_DIR
from shmcache._store.member_writes import MemberWriter
from shmcache._store.writing import publish, version_meta

QUOTA = 256 << 10


@pytest.fixture(scope="module")
def team() -> Iterator[dict[str, User]]:
    with made_users("alice", "bob", "admin") as users:
        yield users


@pytest.fixture
def served(team: dict[str, User], tmp_path: Path) -> Iterator[Path]:
    """A root only this process writes, with a write channel every local user may reach
    (the members' group does that for a real team), admin ``admin``, a 256 KiB quota."""
    with temporary_root() as root:
        Store(root).prepare()
        os.chmod(root, 0o755)
        like_path = tmp_path / "like.sock"
        like = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        like.bind(str(like_path))
        os.chmod(like_path, 0o666)
        policy = MemberPolicy(user_quota=QUOTA, admins=frozenset({team["admin"].uid}), team=True)
        channel = FdChannel(Store(root), policy, refusal=lambda uid: None)
        channel.start(like_path)
        try:
            yield root
        finally:
            channel.close()
            like.close()


@pytest.fixture
def budget_served(team: dict[str, User], tmp_path: Path) -> Iterator[Path]:
    """As ``served``, without quotas, with a 450 KiB budget recorded in the root."""
    with temporary_root() as root:
        Store(root).prepare()
        Store(root).set_budget(450 << 10)
        os.chmod(root, 0o755)
        like_path = tmp_path / "like.sock"
        like = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        like.bind(str(like_path))
        os.chmod(like_path, 0o666)
        channel = FdChannel(Store(root), MemberPolicy(team=True), refusal=lambda uid: None)
        channel.start(like_path)
        try:
            yield root
        finally:
            channel.close()
            like.close()


@pytest.fixture
def sources(team: dict[str, User]) -> Iterator[Path]:
    """A directory every user may traverse, for files each user owns."""
    path = Path(SHM_DIR) / f"shmcache-test-src-{uuid.uuid4().hex[:12]}"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _own_file(path: Path, owner: User | None, array: np.ndarray) -> Path:
    """``array`` saved at ``path``, mode 0600, owned by ``owner`` (None: this account only)."""
    np.save(path, array)
    os.chmod(path, 0o600)
    if owner is not None:
        os.chown(path, owner.uid, owner.gid)
    return path


def _put(root: Path, key: str, value: int, overwrite: bool = False) -> int | None:
    return MemberWriter(root).put_array(key, np.full(8, value), overwrite=overwrite).owner_uid


def _evict(root: Path, key: str) -> int:
    return MemberWriter(root).evict(key)


def _put_file(root: Path, key: str, path: Path) -> list[str]:
    return MemberWriter(root).put_file(key, path)


def test_each_entry_records_the_member_who_put_it(served: Path, team: dict[str, User]) -> None:
    assert as_user(team["alice"], _put, served, "a/x", 1) == team["alice"].uid
    assert as_user(team["bob"], _put, served, "b/x", 2) == team["bob"].uid
    owners = {e.key: e.owner_uid for e in Store(served).list()}
    assert owners == {"a/x": team["alice"].uid, "b/x": team["bob"].uid}


def test_a_member_cannot_evict_or_replace_anothers_entry_and_an_admin_can(
    served: Path, team: dict[str, User]
) -> None:
    as_user(team["alice"], _put, served, "a/mine", 1)
    with pytest.raises(NotPermittedError, match=f"{team['alice'].name} loaded it"):
        as_user(team["bob"], _evict, served, "a/mine")
    with pytest.raises(NotPermittedError, match="replace"):
        as_user(team["bob"], _put, served, "a/mine", 666, True)
    assert Store(served).open_array("a/mine").tolist() == [1] * 8
    assert as_user(team["alice"], _put, served, "a/mine", 2, True) == team["alice"].uid  # her own: fine
    assert as_user(team["admin"], _evict, served, "a/mine") > 0
    assert not Store(served).exists("a/mine")


def test_a_member_cannot_load_another_members_private_file_nor_the_service_accounts(
    served: Path, sources: Path, team: dict[str, User]
) -> None:
    bobs = _own_file(sources / "bob.npy", team["bob"], np.arange(4))
    service_only = _own_file(sources / "service.npy", None, np.arange(4))
    for path in (bobs, service_only):
        with pytest.raises(InvalidSourceError, match="cannot be read: Permission denied"):
            as_user(team["alice"], _put_file, served, "stolen", path)
    assert not Store(served).exists("stolen")
    assert Store(served).list() == []


def test_a_member_can_put_a_file_only_they_can_read(
    served: Path, sources: Path, team: dict[str, User]
) -> None:
    alices = _own_file(sources / "alice.npy", team["alice"], np.arange(6.0))
    assert as_user(team["alice"], _put_file, served, "a/private", alices) == ["a/private"]
    assert Store(served).open_array("a/private").tolist() == list(np.arange(6.0))
    assert Store(served).info("a/private").owner_uid == team["alice"].uid


def test_quotas_are_per_member(served: Path, team: dict[str, User]) -> None:
    def put_big(root: Path, key: str) -> None:
        MemberWriter(root).put_array(key, np.zeros(200 << 10, dtype=np.uint8))

    as_user(team["alice"], put_big, served, "a/big")
    with pytest.raises(QuotaExceededError, match=r"your quota \([^)]+\) is 256\.0 KiB"):
        as_user(team["alice"], put_big, served, "a/big2")
    as_user(team["bob"], put_big, served, "b/big")  # bob's quota is his own
    assert sorted(e.key for e in Store(served).list()) == ["a/big", "b/big"]


def test_ls_and_stats_name_the_owners(served: Path, team: dict[str, User]) -> None:
    as_user(team["alice"], _put, served, "a/x", 1)
    as_user(team["bob"], _put, served, "b/x", 2)
    as_user(team["bob"], _put, served, "b/y", 3)
    env = clean_env()
    command = [sys.executable, "-m", "shmcache"]
    listed = subprocess.run(
        [*command, "ls", "--root", str(served), "--local"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    header, *rows = listed.stdout.splitlines()
    assert "OWNER" in header.split()
    assert any(team["alice"].name in row and row.startswith("a/x") for row in rows)
    usage = subprocess.run(
        [*command, "stats", "--by-user", "--json", "--root", str(served), "--local"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    by_user = {row["user"]: row for row in json.loads(usage.stdout)}
    assert by_user[team["bob"].name]["entries"] == 2 and by_user[team["alice"].name]["entries"] == 1
    assert by_user[team["bob"].name]["uid"] == team["bob"].uid


def _put_kib(root: Path, key: str, kib: int) -> None:
    MemberWriter(root).put_array(key, np.zeros(kib << 10, dtype=np.uint8))


def test_budget_eviction_takes_the_lru_entries_of_a_member_over_their_share_first(
    budget_served: Path, team: dict[str, User]
) -> None:
    as_user(team["bob"], _put_kib, budget_served, "b/oldest", 100)
    for name in ("a/1", "a/2", "a/3"):
        as_user(team["alice"], _put_kib, budget_served, name, 100)
    as_user(team["bob"], _put_kib, budget_served, "b/new", 100)  # over the budget: one must go
    left = sorted(e.key for e in Store(budget_served).list())
    assert left == ["a/2", "a/3", "b/new", "b/oldest"]  # alice's oldest, not bob's older one


def _map_for(path: str, ready_w: int, release_r: int) -> None:
    import mmap

    fd = os.open(path, os.O_RDONLY)
    mapping = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    os.close(fd)
    os.write(ready_w, b"1")
    os.read(release_r, 1)
    mapping.close()


def test_the_daemon_sees_another_users_mapping_of_an_entry(served: Path, team: dict[str, User]) -> None:
    """Budget eviction never takes a mapped entry; the daemon may not read another user's
    /proc/<pid>/maps, so a lease probe tells it (file leases are the owner's to ask)."""
    from shmcache._disk.leases import in_use

    Store(served).put_array("mapped", np.arange(1000))
    path = Store(served).layout.object_file(Store(served).info("mapped").version, "data.npy")
    for directory in (Path(path).parent.parent, Path(path).parent):  # a team root: group-readable
        os.chmod(directory, 0o755)
    os.chmod(path, 0o644)
    pid, ready_r, release_w = forked_as(
        team["bob"], lambda ready_w, release_r: _map_for(path, ready_w, release_r), groups=[]
    )
    try:
        assert os.read(ready_r, 1) == b"1", "the child could not map the entry"
        assert in_use(path)
        os.write(release_w, b"1")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not in_use(path)
    finally:
        os.close(ready_r)
        os.close(release_w)


def test_eviction_says_a_packed_entry_counts_as_mapped_when_its_manifest_is(
    budget_served: Path, team: dict[str, User], tmp_path: Path
) -> None:
    """The lease probe sees a directory put's manifest as one file: while a process maps
    one of its packed entries, the daemon may not evict any of them, and says so."""
    _put_packed_batch(budget_served, tmp_path / "d")
    assert "." in Store(budget_served).info("d/f5").version  # packed
    reader = _reader_of_d_f0(budget_served)
    try:
        with pytest.raises(CacheFullError) as refused:
            as_user(team["bob"], _put_kib, budget_served, "b/new", 200)
        message = str(refused.value)
        assert all(f"d/f{i}" in message for i in range(5))  # each one it kept is named
        assert "every entry packed there counts as mapped" in message
    finally:
        reader.communicate("")


def test_a_writer_that_published_but_is_still_closing_does_not_count_twice(
    budget_served: Path, team: dict[str, User]
) -> None:
    """A put's reservation stays on its lock file until its writer closes, a moment after
    its entry is linked (and counted in ``used``). A member's put in that moment must not
    count those bytes twice and evict the entry just published: a put that returned
    would then vanish. The other writer is held in that moment with the steps a put
    takes (reserve, write, publish), before its close."""
    store = Store(budget_served)
    data = np.zeros(200 << 10, dtype=np.uint8)
    with store._writer() as writer:
        store._reserve(writer, data.nbytes + 2 * 4096)
        version = writer.new_version()
        crc, header = writer.write_array(version, "data.npy", data)
        meta = version_meta("a/done", "array", version, {"data": header}, {"data": crc}, False)
        writer.write_meta(version, meta)
        publish(store.layout, writer, [("a/done", version)], overwrite=False, lock_timeout=5)
        assert store.exists("a/done")
        as_user(team["bob"], _put_kib, budget_served, "b/new", 200)  # 416 KiB with a/done: fits
        assert sorted(e.key for e in store.list()) == ["a/done", "b/new"]
    assert store.stats().used <= 450 << 10


def test_a_later_put_evicts_a_members_new_entry_while_a_batch_it_would_free_is_mapped(
    budget_served: Path, team: dict[str, User], tmp_path: Path
) -> None:
    """What a put that "vanished" was, where it was not a double count: a later put needs
    room, every entry packed in the batch counts as mapped while one is (the lease probe
    sees the manifest), so the least recently used entry left, the member's new one, goes
    (docs/team-writes.md says so)."""
    _put_packed_batch(budget_served, tmp_path / "d")
    reader = _reader_of_d_f0(budget_served)
    try:
        as_user(team["bob"], _put_kib, budget_served, "b/new", 40)  # fits beside the batch
        as_user(team["bob"], _put_kib, budget_served, "b/more", 40)  # does not: b/new goes
        left = sorted(e.key for e in Store(budget_served).list())
        assert left == ["b/more"] + [f"d/f{i}" for i in range(6)]
    finally:
        reader.communicate("")
    as_user(team["bob"], _put_kib, budget_served, "b/new", 40)  # unmapped now: the batch goes
    assert sorted(e.key for e in Store(budget_served).list()) == ["b/more", "b/new"]


def test_the_daemons_own_brief_open_of_a_manifest_is_not_a_mapping(
    budget_served: Path, team: dict[str, User], tmp_path: Path
) -> None:
    """The lease probe is refused while the daemon's own threads have a manifest open
    (cleanup, a listing read it): the kernel counts that open as anyone's. The daemon asks
    again while the only opener it can see is itself, so a batch nobody maps is evicted
    (not the put refused, nor a member's entry taken instead). Seen with a cleanup running
    beside a member's put (1 put in 20 refused)."""
    source = tmp_path / "d"
    source.mkdir()
    for i in range(6):  # 64 KiB each: packed into the manifest
        np.save(source / f"f{i}.npy", np.zeros((64 << 10) - 128, dtype=np.uint8))
    store = Store(budget_served)
    store.put_file("d", source)
    manifest = store.layout.object_file(store.info("d/f0").version, "data.npy")
    held = os.open(manifest, os.O_RDONLY)  # as a thread of the daemon reading it would

    def close_soon() -> None:
        threading.Event().wait(0.8)
        os.close(held)

    closer = threading.Thread(target=close_soon)
    closer.start()
    try:
        as_user(team["bob"], _put_kib_closing, held, budget_served, "b/new", 200)
    finally:
        closer.join()
    assert sorted(e.key for e in store.list()) == ["b/new"]


def _put_kib_closing(inherited: int, root: Path, key: str, kib: int) -> None:
    """``_put_kib`` in a forked child that first closes a descriptor it inherited (a
    member's process holds none of the daemon's)."""
    os.close(inherited)
    _put_kib(root, key, kib)


def _put_packed_batch(root: Path, source: Path) -> None:
    """``d/f0`` .. ``d/f5``, 64 KiB each: packed into one directory put's manifest."""
    source.mkdir()
    for i in range(6):
        np.save(source / f"f{i}.npy", np.zeros((64 << 10) - 128, dtype=np.uint8))
    Store(root).put_file("d", source)


def _reader_of_d_f0(root: Path) -> subprocess.Popen[str]:
    """A process that maps ``d/f0`` (hence its manifest) until its stdin closes; returns
    once it has read it."""
    reader = subprocess.Popen(
        [sys.executable, "-c", "import sys, shmcache\n"
         f"a = shmcache.open_array('d/f0', root={str(root)!r})\n"
         "print(int(a[0]), flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "0"
    except BaseException:
        reader.kill()
        raise
    return reader
