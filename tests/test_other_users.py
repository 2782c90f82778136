"""Other local users: a root planted by another user is refused on every read, another
user's private root and daemon socket give shmcache's errors, not raw ``PermissionError``.

Real users (``useradd``) in forked children that drop to them (the interpreter may live
where other users cannot read, so a child never imports anything new); skipped where
users cannot be made (not root, no ``useradd``).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from service_helpers import Daemon, fresh_root
from shmcache.client import Client
from team_helpers import User, as_user, made_users

import shmcache
from shmcache import CacheRootError, DaemonUnavailableError, Store
from shmcache._diagnose.doctor import run_checks
from shmcache._disk.layout import SHM_DIR
from shmcache.compat import sharearray


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[User, User]]:
    """Two real local users, (victim, attacker), removed afterwards."""
    with made_users("victim", "attacker") as made:
        yield made["victim"], made["attacker"]


def _plant(path: str) -> None:
    """As the attacker: a cache of their own at ``path``, readable by everyone."""
    store = Store(path)
    store.put_array("k", np.array([666]))
    store.put_strings("s", ["planted"])
    store.put_array("g/x", np.array([666]))
    for dirpath, _, filenames in os.walk(path):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)


def _every_read(root: str | None) -> dict[str, tuple[str, str]]:
    """Each read path of ``root`` (None: the default root): what it returned, or the class
    and message of what it raised; and how often ``cache()`` ran its loader."""
    store = Store(root)
    loads: list[int] = []

    def loader() -> np.ndarray:
        loads.append(1)
        return np.zeros(1)

    reads: dict[str, Callable[[], Any]] = {
        "open_array": lambda: store.open_array("k").tolist(),
        "shmcache.open_array": lambda: shmcache.open_array("k", root=store.root).tolist(),
        "open": lambda: list(store.open("s")),
        "open_strings": lambda: list(store.open_strings("s")),
        "open_private_array": lambda: store.open_private_array("k").tolist(),
        "open_group": lambda: list(store.open_group("g")),
        "cache": lambda: store.cache("k", loader).tolist(),
        "list": lambda: [entry.key for entry in store.list()],
        "info": lambda: store.info("k").key,
        "exists": lambda: store.exists("k"),
        "stats": lambda: store.stats().entries,
        "evict": lambda: store.evict("k"),
    }
    outcomes = {}
    for name, read in reads.items():
        try:
            outcomes[name] = ("returned", repr(read()))
        except Exception as exc:
            outcomes[name] = (type(exc).__name__, str(exc))
    outcomes["loader runs"] = ("returned", repr(len(loads)))
    return outcomes


def _assert_all_refused(outcomes: dict[str, tuple[str, str]], *fragments: str) -> None:
    assert outcomes.pop("loader runs") == ("returned", "0")  # cache() never ran the loader
    for name, (raised, message) in outcomes.items():
        assert raised == "CacheRootError", (name, raised, message)
        for fragment in fragments:
            assert fragment in message, (name, message)


@pytest.fixture
def victims_default_root(users: tuple[User, User]) -> Iterator[Path]:
    """``/dev/shm/shmcache-<victim uid>``, the victim's default root: predictable, in a
    world-writable directory."""
    path = Path(SHM_DIR) / f"shmcache-{users[0].uid}"
    if not Path(SHM_DIR).is_dir():
        pytest.skip(f"no {SHM_DIR}")
    shutil.rmtree(path, ignore_errors=True)
    yield path
    if path.is_symlink():
        path.unlink()
    shutil.rmtree(path, ignore_errors=True)


def test_a_root_planted_by_another_user_is_refused_on_every_read(
    users: tuple[User, User], victims_default_root: Path
) -> None:
    victim, attacker = users
    as_user(attacker, _plant, str(victims_default_root))
    outcomes = as_user(victim, _every_read, None)
    _assert_all_refused(
        outcomes, f"belongs to uid {attacker.uid} ({attacker.name})", "SHMCACHE_ROOT", "rm -rf"
    )
    assert as_user(attacker, lambda: Store(str(victims_default_root)).open_array("k").tolist()) == [666]


def test_a_planted_symlink_root_is_refused_on_every_read(
    users: tuple[User, User], victims_default_root: Path
) -> None:
    victim, attacker = users
    elsewhere = fresh_root()
    try:
        as_user(attacker, _plant, str(elsewhere))
        as_user(attacker, os.symlink, str(elsewhere), str(victims_default_root))
        outcomes = as_user(victim, _every_read, None)
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)
    _assert_all_refused(outcomes, "is a symlink", f"made by uid {attacker.uid} ({attacker.name})")


@pytest.mark.parametrize("mode", [0o770, 0o703], ids=["group-writable", "other-writable"])
def test_a_root_others_can_write_to_is_refused_and_doctor_says_so(store: Store, mode: int) -> None:
    store.put_array("k", np.arange(3))
    store.put_strings("s", ["x"])
    store.put_array("g/x", np.arange(1))
    os.chmod(store.root, mode)
    _assert_all_refused(_every_read(str(store.root)), f"is mode {mode:04o}", f"chmod go-w {store.root}")
    with pytest.raises(CacheRootError, match="other users can write"):
        Store(store.root).put_array("j", np.arange(2))
    (check,) = [check for check in run_checks(store.root) if check.name == "root"]
    assert check.status == "fail" and "other users can write" in check.summary and "chmod" in check.fix
    os.chmod(store.root, 0o700)
    assert Store(store.root).open_array("k").tolist() == [0, 1, 2]


def test_a_root_replaced_under_a_running_reader_is_checked_again(
    users: tuple[User, User], store: Store
) -> None:
    """The check is kept by the root's inode: a root deleted and planted again is noticed
    by the next cold open after the once-a-second sweep."""
    _, attacker = users
    store.put_array("k", np.arange(3))
    mine = store.open_array("k")
    assert store.open_array("k") is mine  # warm: no check on this path
    shutil.rmtree(store.root)
    as_user(attacker, _plant, str(store.root))
    time.sleep(1.1)
    with pytest.raises(CacheRootError, match=f"belongs to uid {attacker.uid}"):
        store.open_array("g/x")
    assert mine.tolist() == [0, 1, 2]  # what the program holds stays its own


def _private_root(path: str) -> None:
    Store(path).put_array("k", np.arange(3))
    Store(path).put_strings("s", ["mine"])


def test_another_users_private_root_is_a_cache_root_error(users: tuple[User, User]) -> None:
    owner, other = users
    path = fresh_root()
    try:
        as_user(owner, _private_root, str(path))
        for read in (
            lambda: Store(path).open_array("k"),
            lambda: Store(path).open("s"),
            lambda: Store(path).info("k"),
            lambda: Store(path).exists("k"),
            lambda: Store(path).list(),
        ):
            with pytest.raises(CacheRootError, match=f"belongs to uid {owner.uid}") as raised:
                as_user(other, read)
            assert isinstance(raised.value, PermissionError)
        assert as_user(owner, lambda: Store(path).open_array("k").tolist()) == [0, 1, 2]
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.integration
def test_client_on_another_users_socket_is_daemon_unavailable(
    users: tuple[User, User], daemon: Daemon
) -> None:
    """The daemon's root is 0700: another user cannot even reach its socket."""
    _, other = users

    def health(**where: Any) -> Any:
        with Client(timeout=5, **where) as client:
            return client.health()

    for where in ({"root": str(daemon.root)}, {"socket": str(daemon.socket_path)}):
        with pytest.raises(DaemonUnavailableError, match="permission denied") as raised:
            as_user(other, lambda: health(**where))  # noqa: B023 - called at once
        assert isinstance(raised.value, ConnectionError)
        assert "another user" in str(raised.value)
    assert health(root=str(daemon.root)).pid == daemon.pid


def _sharearray_cache(shm_path: str) -> list[str]:
    """As the victim: sharearray.cache of id "x" under ``shm_path``; the loader's calls."""
    calls: list[str] = []

    def load() -> np.ndarray:
        calls.append("loaded")
        return np.arange(3)

    sharearray.cache("x", load, shm_path=shm_path, verbose=False)
    return calls


def _sharearray_free(shm_path: str) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharearray.free("x", shm_path=shm_path)
    return [str(w.message) for w in caught]


def test_sharearray_file_planted_by_another_user_is_named(users: tuple[User, User]) -> None:
    """``/dev/shm`` is everyone's: another user's ``sharearray_x.npy`` there is refused with
    its owner's name, before anything is loaded (it was a raw PermissionError)."""
    victim, attacker = users
    shm = fresh_root()  # a sticky, world-writable directory, as /dev/shm is
    shm.mkdir()
    shm.chmod(0o1777)
    try:
        planted = str(shm / "sharearray_x.npy")
        as_user(attacker, lambda: np.save(planted, np.array([666])))
        with pytest.raises(CacheRootError) as caught:
            as_user(victim, _sharearray_cache, str(shm))
        assert f"{planted} belongs to uid {attacker.uid} ({attacker.name})" in str(caught.value)
        assert "prefix=" in str(caught.value)
        assert isinstance(caught.value, PermissionError)
        warned = as_user(victim, _sharearray_free, str(shm))  # no error: nothing of ours to free
        assert any(attacker.name in message for message in warned), warned
        assert np.load(planted).tolist() == [666]  # left alone
        store_root = shm / f"sharearray_shmcache-{victim.uid}"
        assert not store_root.exists() or Store(store_root).list() == []  # nothing loaded
    finally:
        shutil.rmtree(shm, ignore_errors=True)
