"""A team root with real accounts: a service account runs ``shmcache serve --team``, two
members of the team's group read what it published (one copy in memory), an outsider
cannot connect, list or read a byte, and a look-alike root or teams file planted by a
member is refused on every read path.

Real users and groups (``useradd``, ``groupadd``), a trusted teams file in a root-owned
directory, the daemon in a forked child dropped to the service account, members in forked
children dropped to them (the interpreter may live where other users cannot read, so
children import nothing new: what they run is imported here first). Skipped where users
cannot be made.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shmcache.client import Client
from team_helpers import Team, TeamDaemon, User, as_user, forked_as, real_team
from typer.testing import CliRunner

import shmcache
import shmcache._diagnose.doctor
import shmcache.torch
from shmcache import KeyNotFoundError, UnauthorizedError, UntrustedDaemonError
from shmcache._cli.app import app
from shmcache._disk.layout import ENV_ROOT, ENV_TEAM, ENV_TEAMS_FILE, SHM_DIR

MiB = 1 << 20
DATA_BYTES = 8 * MiB
RUNNER = CliRunner()


@pytest.fixture(scope="module")
def data_dir() -> Iterator[Path]:
    """Sources everyone may read (the daemon loads from here)."""
    path = Path(SHM_DIR) / f"shmcache-test-team-data-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    array = np.arange(DATA_BYTES // 8, dtype=np.float64)
    np.save(path / "big.npy", array)
    np.save(path / "small.npy", np.arange(10))
    for name in ("big.npy", "small.npy"):
        os.chmod(path / name, 0o644)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def team(data_dir: Path) -> Iterator[Team]:
    with real_team(budget="64MiB", allow_sources=[str(data_dir)]) as made:
        yield made


@pytest.fixture(scope="module")
def daemon(team: Team, data_dir: Path) -> Iterator[TeamDaemon]:
    """The team's daemon, with ``big`` and ``g/small`` published through it."""
    os.environ[ENV_TEAMS_FILE] = str(team.teams.file)
    started = TeamDaemon(team, team.service).wait_ready()
    try:
        with Client(team=team.name, timeout=60) as client:  # root may use every daemon
            client.put_file("big", data_dir / "big.npy", overwrite=True)
            client.put_file("g/small", data_dir / "small.npy", overwrite=True)
        yield started
    finally:
        started.stop()
        del os.environ[ENV_TEAMS_FILE]


# ---------------------------------------------------------------------- the root and the daemon


def test_the_daemon_makes_a_root_only_the_team_can_read(team: Team, daemon: TeamDaemon) -> None:
    st = os.lstat(team.root)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (team.service.uid, team.gid, 0o2750)
    seen = {"dir": 0, "file": 0, "sock": 0}
    for dirpath, dirnames, filenames in os.walk(team.root):
        for name in [*dirnames, *filenames]:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                continue
            mode = stat.S_IMODE(st.st_mode)
            assert (st.st_uid, st.st_gid) == (team.service.uid, team.gid), path
            assert mode & 0o007 == 0, f"{path} is mode {mode:04o}: others may reach it"
            if stat.S_ISDIR(st.st_mode):
                assert mode & 0o777 == 0o750, f"{path} {mode:04o}"
                seen["dir"] += 1
            elif stat.S_ISSOCK(st.st_mode):
                assert mode == 0o660, f"{path} {mode:04o}"
                seen["sock"] += 1
            else:
                assert mode == 0o640, f"{path} {mode:04o}"
                seen["file"] += 1
    assert seen["dir"] and seen["file"] and seen["sock"] == 2, seen  # daemon.sock and daemon.fds
    for name in ("daemon.pid", "generation", "format", "budget.json"):
        assert stat.S_IMODE(os.lstat(team.root / name).st_mode) == 0o640, name


def test_the_team_budget_is_recorded_in_the_root(team: Team, daemon: TeamDaemon) -> None:
    recorded = json.loads((team.root / "budget.json").read_text())
    assert recorded["max_bytes"] == 64 * MiB


def _read_as_member(name: str) -> dict[str, Any]:
    """As a member: what each read of the team root gives."""
    out: dict[str, Any] = {
        "open_array": float(shmcache.open_array("big", team=name)[-1]),
        "list": sorted(e.key for e in shmcache.list_entries(team=name)),
        "group": sorted(shmcache.open_group("g", team=name)),
        "open": shmcache.open("g/small", team=name).tolist(),
        "dataset": len(shmcache.torch.CachedDataset("big", team=name)),
        "stats": shmcache.stats(team=name).entries,
        "store_info": shmcache.Store(team=name).info("big").nbytes,
    }
    with Client(team=name, timeout=30) as client:
        out["client"] = sorted(e.key for e in client.list())
    os.environ[ENV_TEAM] = name  # the variable alone, no argument
    out["env"] = shmcache.open_array("g/small").tolist()
    cli = RUNNER.invoke(app, ["ls"], catch_exceptions=False)
    out["cli"] = (cli.exit_code, cli.output)
    del os.environ[ENV_TEAM]
    for command in (["root"], ["info", "big"], ["doctor", "--json"]):
        done = RUNNER.invoke(app, ["--team", name, *command], catch_exceptions=False)
        out[command[0]] = (done.exit_code, done.output)
    os.environ[ENV_TEAM] = name
    try:
        shmcache.open_array("no/such/key")
    except KeyNotFoundError as exc:
        out["missing"] = str(exc)
    return out


def test_members_read_what_the_daemon_published(team: Team, daemon: TeamDaemon) -> None:
    for member in (team.a, team.b):
        got = as_user(member, _read_as_member, team.name)
        assert got["open_array"] == DATA_BYTES // 8 - 1
        assert got["list"] == got["client"] == ["big", "g/small"]
        assert got["group"] == ["small"]
        assert got["open"] == got["env"] == list(range(10))
        assert got["dataset"] == DATA_BYTES // 8
        assert got["stats"] == 2 and got["store_info"] == DATA_BYTES
        assert got["cli"][0] == 0 and "big" in got["cli"][1] and "g/small" in got["cli"][1], got["cli"]
        assert "no/such/key" in got["missing"]
        assert got["root"] == (0, f"{team.root}\n")
        assert got["info"][0] == 0 and "big" in got["info"][1], got["info"]
        checks = {check["name"]: check for check in json.loads(got["doctor"][1])["checks"]}
        assert checks["root"]["status"] == "ok", checks["root"]
        assert checks["daemon"]["status"] == "ok", checks["daemon"]


def test_a_team_and_a_root_together_are_refused(team: Team, daemon: TeamDaemon) -> None:
    with pytest.raises(shmcache.InvalidRequestError, match="not both"):
        shmcache.open_array("big", team=team.name, root=team.root)


# ---------------------------------------------------------------------- one copy


def _hold_open(user: User, name: str) -> tuple[int, int, int]:
    """A child, as ``user``, that maps ``big`` of the team, touches every page and waits
    for a byte on its pipe: (pid, the pipe to write to, the pipe it answers on)."""

    def hold(answer: int, wait: int) -> None:
        array = shmcache.open_array("big", team=name)
        os.write(answer, f"{float(array.sum())}\n".encode())
        os.read(wait, 1)

    pid, answers, tell = forked_as(user, hold)
    return pid, tell, answers


def _pss_of(pid: int, suffix: str) -> int:
    """Bytes of PSS over ``pid``'s mappings of files whose path ends in ``suffix``."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            inside = line.endswith(suffix)
        elif inside and fields[0] == "Pss:":
            total += int(fields[1]) * 1024
    return total


def test_two_members_share_one_copy(team: Team, daemon: TeamDaemon) -> None:
    with Client(team=team.name, timeout=30) as client:
        version = client.info("big").version
    data_file = f"{team.root}/objects/{version}/data.npy"
    children = [_hold_open(member, team.name) for member in (team.a, team.b)]
    try:
        expected = float(np.arange(DATA_BYTES // 8, dtype=np.float64).sum())
        for _, _, answer in children:
            assert float(os.read(answer, 100).decode()) == expected
        pss = sum(_pss_of(pid, data_file) for pid, _, _ in children)
        size = os.path.getsize(data_file)
        assert 0.95 * size <= pss <= 1.05 * size, f"PSS {pss} over two members for {size} bytes"
    finally:
        for pid, tell, answer in children:
            os.write(tell, b"x")
            os.close(tell)
            os.close(answer)
            os.waitpid(pid, 0)


# ---------------------------------------------------------------------- the outsider


def _connect(path: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)


def _member_writes(name: str) -> str:
    try:
        shmcache.Store(team=name).put_array("mine", np.arange(3))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "wrote"


def _outsider_tries(name: str, data_file: str) -> dict[str, str]:
    """As the outsider: each way in, and the error class and message it met."""
    tries: dict[str, Callable[[], Any]] = {
        "open_array": lambda: shmcache.open_array("big", team=name),
        "list": lambda: shmcache.list_entries(team=name),
        "open_group": lambda: shmcache.open_group("g", team=name),
        "client": lambda: Client(team=name, timeout=5).health(),
        "listdir": lambda: os.listdir(data_file.rsplit("/objects/", 1)[0]),
        "connect": lambda: _connect(data_file.rsplit("/objects/", 1)[0] + "/daemon.sock"),
        "client_socket": lambda: Client(socket=data_file.rsplit("/objects/", 1)[0] + "/daemon.sock").health(),
        "read": lambda: open(data_file, "rb").read(1),  # noqa: SIM115
    }
    met: dict[str, str] = {}
    for what, attempt in tries.items():
        try:
            attempt()
        except Exception as exc:
            met[what] = f"{type(exc).__name__}: {exc}"
        else:
            met[what] = "succeeded"
    return met


def test_an_outsider_cannot_connect_list_or_read_a_byte(team: Team, daemon: TeamDaemon) -> None:
    with Client(team=team.name, timeout=30) as client:
        data_file = f"{team.root}/objects/{client.info('big').version}/data.npy"
    met = as_user(team.outsider, _outsider_tries, team.name, data_file)
    for what in ("open_array", "list", "open_group", "client"):
        assert met[what].startswith("CacheRootError") and "not in its group" in met[what], met
    for what in ("listdir", "read", "connect"):
        assert met[what].startswith("PermissionError"), met
    denied = met["client_socket"]
    assert denied.startswith("DaemonUnavailableError") and "permission denied" in denied, met


def test_a_member_writing_the_root_directly_is_told_to_use_the_daemon(team: Team, daemon: TeamDaemon) -> None:
    met = as_user(team.a, _member_writes, team.name)
    assert met.startswith("CacheRootError") and "daemon" in met, met


def _health(name: str) -> Any:
    with Client(team=name, timeout=10) as client:
        return client.health()


def test_a_peer_outside_the_group_gets_a_403_saying_why(team: Team, daemon: TeamDaemon) -> None:
    """The socket is 0660; a process that holds the team's gid without being a member
    (kept from elsewhere) passes the file mode, and the daemon's peer check refuses it."""
    with pytest.raises(UnauthorizedError, match=f"not a member of team {team.name}") as refused:
        as_user(team.outsider, _health, team.name, groups=[team.outsider.gid, team.gid])
    assert f"usermod -aG {team.group} {team.outsider.name}" in str(refused.value)
    assert as_user(team.a, _health, team.name).pid == daemon.pid


def _health_on(name: str, path: str) -> Any:
    with Client(team=name, socket=path, timeout=10) as client:
        return client.health()


def test_a_team_client_talks_only_to_the_teams_account(
    team: Team, daemon: TeamDaemon, data_dir: Path
) -> None:
    """Someone else listening where a member is pointed (``--socket``, ``$SHMCACHE_SOCKET``)
    gets nothing: the listener must be the teams file's account, not even root."""
    path = data_dir / f"fake-{uuid.uuid4().hex[:6]}.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        os.chmod(path, 0o666)
        listener.listen(1)
        with pytest.raises(UntrustedDaemonError, match="nothing was sent"):
            as_user(team.b, _health_on, team.name, str(path))
    path.unlink()


# ---------------------------------------------------------------------- planted roots and files


def _plant(root: str) -> None:
    """As a member: a look-alike cache of their own, readable by everyone."""
    store = shmcache.Store(root)
    store.put_array("big", np.array([666.0]))
    store.put_array("g/small", np.array([666]))
    store.put_table("t", {"x": [666]})
    store.put_blobs("b", {"x": b"666"})
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)


def _every_read(name: str) -> dict[str, str]:
    """As a member: each read path of team ``name``, and what it raised (or returned)."""
    reads: dict[str, Callable[[], Any]] = {
        "open_array": lambda: shmcache.open_array("big", team=name).tolist(),
        "open_group": lambda: list(shmcache.open_group("g", team=name)),
        "open_table": lambda: shmcache.open_table("t", team=name)[0],
        "open_blobs": lambda: bytes(shmcache.open_blobs("b", team=name)[0]),
        "open": lambda: shmcache.open("g/small", team=name).tolist(),
        "list": lambda: [e.key for e in shmcache.list_entries(team=name)],
        "stats": lambda: shmcache.stats(team=name).entries,
        "Store": lambda: shmcache.Store(team=name).open_array("big").tolist(),
        "dataset": lambda: len(shmcache.torch.CachedDataset("big", team=name)),
        "client": lambda: Client(team=name, timeout=5).health(),
    }
    met: dict[str, str] = {}
    for what, read in reads.items():
        try:
            met[what] = f"returned {read()!r}"
        except Exception as exc:
            met[what] = f"{type(exc).__name__}: {exc}"
    os.environ[ENV_TEAM] = name
    try:
        met["env"] = f"returned {shmcache.open_array('big').tolist()!r}"
    except Exception as exc:
        met["env"] = f"{type(exc).__name__}: {exc}"
    cli = RUNNER.invoke(app, ["ls"])
    met["cli"] = f"exit {cli.exit_code}: {cli.output}"
    return met


@pytest.fixture
def second_root(team: Team) -> Iterator[tuple[str, Path]]:
    """A second team of the same group in the teams file, whose root nobody made yet."""
    name, root = f"{team.name}x", Path(SHM_DIR) / f"shmcache-test-team-{uuid.uuid4().hex[:12]}"
    original = team.teams.file.read_text()
    team.teams.write(original + team.toml().replace(f"[teams.{team.name}]", f"[teams.{name}]").replace(
        f'root = "{team.root}"', f'root = "{root}"'
    ))
    yield name, root
    team.teams.write(original)
    shutil.rmtree(root, ignore_errors=True)


def test_a_look_alike_root_planted_by_a_member_is_refused_on_every_read_path(
    team: Team, daemon: TeamDaemon, second_root: tuple[str, Path]
) -> None:
    name, root = second_root
    as_user(team.a, _plant, str(root))
    met = as_user(team.b, _every_read, name)
    for what, outcome in met.items():
        assert "666" not in outcome, f"{what}: {outcome}"
        assert "CacheRootError" in outcome or what == "cli", f"{what}: {outcome}"
        assert "not to the team's service account" in outcome, f"{what}: {outcome}"
    assert met["cli"].startswith("exit 1")


def _own_teams_file(path: str, text: str) -> None:
    Path(path).write_text(text)


def test_a_teams_file_of_a_member_is_refused_on_every_read_path(team: Team, daemon: TeamDaemon) -> None:
    """A member writes a teams file naming their own look-alike root as the team's; another
    member pointed at it (``SHMCACHE_TEAMS_FILE``) reads nothing from it."""
    planted_root = Path(SHM_DIR) / f"shmcache-test-team-{uuid.uuid4().hex[:12]}"
    planted_file = Path(SHM_DIR) / f"shmcache-test-teams-{uuid.uuid4().hex[:8]}.toml"
    text = team.toml().replace(f'owner = "{team.service.name}"', f'owner = "{team.a.name}"').replace(
        f'root = "{team.root}"', f'root = "{planted_root}"'
    )
    try:
        as_user(team.a, _plant, str(planted_root))
        as_user(team.a, _own_teams_file, str(planted_file), text)
        os.environ[ENV_TEAMS_FILE] = str(planted_file)
        met = as_user(team.b, _every_read, team.name)
    finally:
        os.environ[ENV_TEAMS_FILE] = str(team.teams.file)
        shutil.rmtree(planted_root, ignore_errors=True)
        planted_file.unlink(missing_ok=True)
    for what, outcome in met.items():
        assert "666" not in outcome, f"{what}: {outcome}"
        assert "not root" in outcome and "not trusted" in outcome, f"{what}: {outcome}"


# ---------------------------------------------------------------------- who runs the daemon


def _root_of(name: str) -> str:
    with Client(team=name, timeout=30) as client:
        return client.health().root


def test_one_account_serves_two_teams_and_restarts(
    team: Team, daemon: TeamDaemon, second_root: tuple[str, Path]
) -> None:
    name, root = second_root
    for _ in range(2):  # the second start finds the root made
        second = TeamDaemon(team, team.service, name=name).wait_ready()
        try:
            assert as_user(team.b, _root_of, name) == str(root)
            assert as_user(team.b, _root_of, team.name) == str(team.root)
            st = os.lstat(root)
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (team.service.uid, team.gid, 0o2750)
        finally:
            assert second.stop() == 0, second.log
    assert daemon.exited() is None


def test_serve_team_refuses_root_and_other_accounts(team: Team, daemon: TeamDaemon) -> None:
    root_user = User("root", 0, 0)
    for user, words in (
        (root_user, "refuses to run as root"),
        (team.a, "must run as the team's service account"),
    ):
        refused = TeamDaemon(team, user)
        status = refused.wait_exit()
        log = refused.log
        refused.stop()
        assert status == 1, log
        assert words in log and f"sudo -u {team.service.name}" in log, log


def test_serve_team_refuses_a_root_flag(team: Team) -> None:
    from shmcache.service import SettingsError, load_settings

    with pytest.raises(SettingsError, match="--team takes the root"):
        load_settings({"team": team.name, "root": "/dev/shm/elsewhere"}, env={})
    with pytest.raises(SettingsError, match="--host"):
        load_settings({"team": team.name, "host": "127.0.0.1", "port": 0, "allow_source": ["/"]}, env={})


def test_the_root_variable_and_the_team_variable_together_are_refused(
    team: Team, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_TEAM, team.name)
    monkeypatch.setenv(ENV_ROOT, str(team.root))
    with pytest.raises(shmcache.InvalidRequestError, match=f"both {ENV_ROOT} and {ENV_TEAM}"):
        shmcache.Store()
