"""Members writing through a real team daemon (``shmcache serve --team`` run as its
service account), as real users: puts from Python and the CLI, ownership, evictions, a
member's own sources vs others', quotas kept across a restart, a member killed mid-put.

Real users and groups, a trusted teams file (``tests/team_helpers.py``); skipped where
users cannot be made. Children import nothing new: what they run is imported here.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shmcache.client import Client
from team_helpers import Team, TeamDaemon, User, as_user, become, forked_as, team_in_env
from typer.testing import CliRunner

import shmcache
from shmcache import (
    CacheRootError,
    InvalidSourceError,
    NotPermittedError,
    QuotaExceededError,
    SourceNotAllowedError,
    Store,
)
from shmcache._cli.app import app
from shmcache._disk.layout import SHM_DIR
from shmcache._store.fd_messages import FDS_SOCKET, recv_message, send_message

KiB = 1 << 10
QUOTA = 512 * KiB
RUNNER = CliRunner()
_PR_SET_DUMPABLE = 4


@pytest.fixture(scope="module")
def data_dir() -> Iterator[Path]:
    """The team's allow_sources: a directory the daemon may load from with its own rights."""
    path = Path(SHM_DIR) / f"shmcache-test-team-allowed-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def homes(team: Team) -> Iterator[Path]:
    """Each member's private directory (0700) in a directory everyone may traverse."""
    path = Path(SHM_DIR) / f"shmcache-test-homes-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    for user in (team.a, team.b, team.service):
        home = path / user.name
        home.mkdir(mode=0o700)
        os.chown(home, user.uid, user.gid)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def team(data_dir: Path) -> Iterator[Team]:
    with team_in_env(budget="64MiB", user_quota=f"{QUOTA // KiB}KiB", allow_sources=[str(data_dir)]) as made:
        yield made


@pytest.fixture(scope="module")
def _daemons(team: Team) -> Iterator[list[TeamDaemon]]:
    """The team daemons this module's tests were given (one serves at a time)."""
    started: list[TeamDaemon] = []
    try:
        yield started
    finally:
        for one in started:
            one.stop()


@pytest.fixture
def daemon(team: Team, _daemons: list[TeamDaemon]) -> TeamDaemon:
    """The team's daemon, started again where a test stopped it (a restart test), whatever
    order the tests run in and however xdist shares them out."""
    if not _daemons or _daemons[-1].exited() is not None:
        _daemons.append(TeamDaemon(team, team.service).wait_ready())
    return _daemons[-1]


def _private_file(homes: Path, owner: User, name: str, array: np.ndarray) -> Path:
    path = homes / owner.name / name
    np.save(path, array)
    os.chown(path, owner.uid, owner.gid)
    os.chmod(path, 0o600)
    return path


def _put(team: str, key: str, nbytes: int) -> int | None:
    return shmcache.put_array(key, np.ones(nbytes, dtype=np.uint8), team=team, overwrite=True).owner_uid


def _read(team: str, key: str) -> list[float]:
    return shmcache.open_array(key, team=team)[:4].tolist()


def _evict(team: str, key: str) -> int:
    return shmcache.evict(key, team=team)


def _evict_over_http(team: str, key: str) -> int:
    with Client(team=team, timeout=30) as client:
        return client.evict(key)


def _cli(*args: str) -> tuple[int, str]:
    result = RUNNER.invoke(app, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def _put_file(team: str, key: str, path: Path) -> list[str]:
    return shmcache.put_file(key, path, team=team, overwrite=True)


def _ask_daemon_to_load(team: str, key: str, path: Path) -> Any:
    with Client(team=team, timeout=30) as client:
        return client.put_file(key, path, overwrite=True)


def test_members_put_through_the_daemon_and_read_each_others_entries(team: Team, daemon: TeamDaemon) -> None:
    assert as_user(team.a, _put, team.name, "a/x", 1000) == team.a.uid
    assert as_user(team.b, _read, team.name, "a/x") == [1.0] * 4
    code, out = as_user(team.b, _cli, "--team", team.name, "ls")
    assert code == 0 and "OWNER" in out and team.a.name in out, out
    info = Store(team=team.name).info("a/x")
    assert info.owner_uid == team.a.uid
    st = os.stat(team.root / "objects" / info.version / "data.npy")
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (team.service.uid, team.gid, 0o640)


def _hold_mapped(user: User, team: str, key: str) -> tuple[int, int]:
    """A child running as ``user`` that maps ``key`` and holds it until released:
    ``(pid, write end that releases it when closed)``, once it maps it."""

    def hold(report: int, release: int) -> None:
        # as a login's process is: one that changed its uid is not dumpable, and then even
        # its own user may not read its /proc/PID/maps
        ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
        array = shmcache.open_array(key, team=team)
        os.write(report, b"1" if array.size else b"0")
        os.read(release, 1)

    pid, reports, release = forked_as(user, hold)
    assert os.read(reports, 1) == b"1"
    os.close(reports)
    return pid, release


def test_ls_says_that_mapped_by_lists_a_members_own_processes_only(team: Team, daemon: TeamDaemon) -> None:
    as_user(team.a, _put, team.name, "a/held", 1000)
    pid, hold = _hold_mapped(team.b, team.name, "a/held")
    try:
        code, out = as_user(team.a, _cli, "--team", team.name, "ls", "a/held")
        table, _, notice = out.partition("notice:")
        assert code == 0 and "MAPPED BY lists only the processes" in notice, out
        assert str(pid) not in table, out  # b's reader is hidden from a
        # root sees it, or is refused too (a forked child that changed its uid is not
        # dumpable, and a container may drop CAP_SYS_PTRACE) and says so
        code, out = _cli("--team", team.name, "ls", "a/held")
        table, _, notice = out.partition("notice:")
        assert code == 0 and (str(pid) in table or "MAPPED BY lists only" in notice), out
        # info scans here too (the daemon, another account, may not read a member's maps)
        code, out = as_user(team.b, _cli, "--team", team.name, "info", "a/held")
        assert code == 0 and json.loads(out.partition("notice:")[0])["mapped_by"] == [pid], out
        code, out = as_user(team.a, _cli, "--team", team.name, "info", "a/held")
        detail, _, notice = out.partition("notice:")
        assert json.loads(detail)["mapped_by"] == [] and "1 process of other members" in notice, out
    finally:
        os.close(hold)
        os.waitpid(pid, 0)


def _put_in_place(team: str) -> None:
    Store(team=team).put_array("a/in-place", np.arange(3))


def test_a_store_of_a_team_root_does_not_write_in_place(team: Team, daemon: TeamDaemon) -> None:
    with pytest.raises(CacheRootError, match="written by its daemon alone"):
        as_user(team.a, _put_in_place, team.name)
    with pytest.raises(CacheRootError, match="put_array"):
        _put_in_place(team.name)  # root too: only the service account writes there


def test_a_member_evicts_only_their_own_entries(team: Team, daemon: TeamDaemon) -> None:
    as_user(team.a, _put, team.name, "a/mine", 1000)
    for evict in (_evict, _evict_over_http):
        with pytest.raises(NotPermittedError, match=f"{team.a.name} loaded it"):
            as_user(team.b, evict, team.name, "a/mine")
    code, out = as_user(team.b, _cli, "--team", team.name, "evict", "a/mine")
    assert code == 1 and "may not evict" in out, out
    assert Store(team=team.name).exists("a/mine")
    assert as_user(team.a, _evict, team.name, "a/mine") > 0


def test_only_admins_change_the_team_budget(team: Team, daemon: TeamDaemon) -> None:
    code, out = as_user(team.b, _cli, "--team", team.name, "budget", "set", "1GiB")
    assert code == 1 and "may not set the root's budget" in out, out
    assert Store(team=team.name).budget == 64 << 20


def test_members_put_what_they_can_read_and_nothing_else(team: Team, daemon: TeamDaemon, homes: Path) -> None:
    alices = _private_file(homes, team.a, "alice.npy", np.arange(5.0))
    bobs = _private_file(homes, team.b, "bob.npy", np.arange(5.0))
    service_only = _private_file(homes, team.service, "service.npy", np.arange(5.0))
    assert as_user(team.a, _put_file, team.name, "a/private", alices) == ["a/private"]
    assert Store(team=team.name).info("a/private").owner_uid == team.a.uid
    for path in (bobs, service_only):
        with pytest.raises(InvalidSourceError, match="Permission denied"):
            as_user(team.a, _put_file, team.name, "a/stolen", path)
        with pytest.raises(SourceNotAllowedError):  # nor through the daemon's own rights
            as_user(team.a, _ask_daemon_to_load, team.name, "a/stolen", path)
    code, out = as_user(
        team.a, _cli, "put", str(alices), "--key", "a/cli", "--team", team.name, "--overwrite"
    )
    assert code == 0 and "a/cli" in out, out
    assert not Store(team=team.name).exists("a/stolen")


def test_a_load_the_daemon_runs_from_allow_sources_is_owned_by_the_member_who_asked(
    team: Team, daemon: TeamDaemon, data_dir: Path
) -> None:
    shared = data_dir / "shared.npy"
    np.save(shared, np.arange(100))
    os.chmod(shared, 0o644)
    as_user(team.a, _ask_daemon_to_load, team.name, "a/loaded", shared)
    assert Store(team=team.name).info("a/loaded").owner_uid == team.a.uid
    with pytest.raises(NotPermittedError, match="replace"):
        as_user(team.b, _ask_daemon_to_load, team.name, "a/loaded", shared)


def test_over_quota_is_a_typed_error_and_survives_a_restart(
    team: Team, daemon: TeamDaemon, homes: Path
) -> None:
    as_user(team.b, _put, team.name, "b/big", 400 * KiB)
    with pytest.raises(QuotaExceededError, match=r"your quota \([^)]+\) is 512\.0 KiB and your entries use"):
        as_user(team.b, _put, team.name, "b/more", 200 * KiB)
    big = _private_file(homes, team.b, "big.npy", np.zeros(200 * KiB, dtype=np.uint8))
    code, out = as_user(team.b, _cli, "put", str(big), "--key", "b/cli", "--team", team.name)
    assert code == 1 and "quota" in out and "512.0 KiB" in out, out
    assert not Store(team=team.name).exists("b/more") and not Store(team=team.name).exists("b/cli")
    daemon.stop()
    restarted = TeamDaemon(team, team.service).wait_ready()
    try:
        with pytest.raises(QuotaExceededError, match="quota"):
            as_user(team.b, _put, team.name, "b/more", 200 * KiB)
        assert Store(team=team.name).info("b/big").owner_uid == team.b.uid
        as_user(team.b, _put, team.name, "b/small", 10 * KiB)  # what fits still goes in
    finally:
        restarted.stop()


def _tmp_versions(root: Path) -> list[str]:
    return [name for name in os.listdir(root / "tmp") if not name.endswith(".lock")]


def test_a_member_killed_mid_put_publishes_nothing(team: Team, daemon: TeamDaemon) -> None:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child process: a member that dies while filling
        os.close(read_end)
        become(team.a)
        sock = __import__("socket").socket(1, 5)  # AF_UNIX, SOCK_SEQPACKET
        sock.connect(str(team.root / FDS_SOCKET))
        entry = {"key": "a/killed", "kind": "array", "files": {"data": 300 * KiB}}
        send_message(sock, {"op": "begin", "entries": [entry]})
        recv_message(sock)
        send_message(sock, {"op": "file", "entry": 0, "name": "data"})
        _, fd = recv_message(sock) or ({}, None)
        if fd is not None:
            os.write(fd, b"x" * (100 * KiB))
        os.write(write_end, b"1")
        signal.pause()
        os._exit(0)
    try:
        os.close(write_end)
        assert os.read(read_end, 1) == b"1"
        assert _tmp_versions(team.root)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        from service_helpers import wait_for

        wait_for(
            lambda: _tmp_versions(team.root) == [], timeout=30, what="the killed member's version removed"
        )
        assert not Store(team=team.name).exists("a/killed")
    finally:
        os.close(read_end)
