"""Teams files and team roots for tests: a trusted teams file needs a root-owned directory
that nobody else can write, outside /tmp and /dev/shm (so only where the tests run as
root); team roots are unique paths under /dev/shm. Everything is removed afterwards."""

from __future__ import annotations

import atexit
import grp
import os
import pickle
import pwd
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from shmcache._disk.layout import ENV_PREFIX, ENV_TEAMS_FILE, SHM_DIR

__all__ = [
    "Team",
    "TeamDaemon",
    "TeamsDir",
    "User",
    "as_user",
    "become",
    "forked_as",
    "groups_of",
    "made_users",
    "real_team",
    "team_toml",
    "teams_dir",
    "unique_team_root",
]

_TRUSTED_PARENTS = ("/var/lib", "/run", "/etc")


class TeamsDir:
    """A root-owned 0755 directory holding ``teams.toml`` (0644)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = path / "teams.toml"

    def write(self, text: str, mode: int = 0o644) -> Path:
        staging = self.path / f".teams.{uuid.uuid4().hex}"
        staging.write_text(text)
        os.chmod(staging, mode)
        os.replace(staging, self.file)
        return self.file


@contextmanager
def teams_dir() -> Iterator[TeamsDir]:
    """A trusted directory for a teams file; skips unless root can make one."""
    if os.geteuid() != 0:
        pytest.skip("a trusted teams file must be root's: needs root")
    for parent in _TRUSTED_PARENTS:
        st = os.stat(parent)
        if st.st_uid == 0 and not st.st_mode & 0o022 and os.access(parent, os.W_OK):
            break
    else:
        pytest.skip("no root-owned directory to hold a trusted teams file")
    path = Path(parent) / f"shmcache-test-{uuid.uuid4().hex[:12]}"
    os.mkdir(path, 0o755)
    os.chmod(path, 0o755)
    try:
        yield TeamsDir(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def unique_team_root() -> Path:
    """A fresh path under /dev/shm for a team root (not created)."""
    return Path(SHM_DIR) / f"shmcache-test-team-{uuid.uuid4().hex[:12]}"


def team_toml(name: str, *, group: str, owner: str, root: Path | None = None, **fields: object) -> str:
    """A ``[teams.NAME]`` table (values written as TOML strings, lists or integers)."""
    lines = [f"[teams.{name}]", f'group = "{group}"', f'owner = "{owner}"']
    if root is not None:
        lines.append(f'root = "{root}"')
    for field, value in fields.items():
        if isinstance(value, str):
            lines.append(f'{field} = "{value}"')
        elif isinstance(value, (list, tuple)):
            lines.append(f"{field} = [" + ", ".join(f'"{item}"' for item in value) + "]")
        else:
            lines.append(f"{field} = {value}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- real users


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(command), capture_output=True, text=True)


def _need_useradd() -> None:
    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("groupadd") is None:
        pytest.skip("needs root, useradd and groupadd to create users")


def _add_user(name: str, *extra: str) -> User:
    """``useradd`` a system account with a group of its own (``extra``: more flags); skips
    the test where that fails."""
    made = _run(
        "useradd", "--system", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin",
        *extra, name,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot create a user: {made.stderr.strip()}")
    entry = pwd.getpwnam(name)
    return User(name, entry.pw_uid, entry.pw_gid)


@contextmanager
def made_users(*roles: str) -> Iterator[dict[str, User]]:
    """One real user per role, each in a group of its own only, removed afterwards."""
    _need_useradd()
    tag = uuid.uuid4().hex[:6]
    made: list[str] = []
    try:
        users: dict[str, User] = {}
        for role in roles:
            users[role] = _add_user(f"shm{role[:4]}{tag}")
            made.append(users[role].name)
        yield users
    finally:
        for name in made:
            _run("userdel", name)
            _run("groupdel", name)


@dataclass
class Team:
    """A team of real accounts: its group, service account, two members and an outsider,
    declared in a trusted teams file; its root a unique path under /dev/shm."""

    name: str
    group: str
    gid: int
    service: User
    a: User
    b: User
    outsider: User
    teams: TeamsDir
    root: Path

    def toml(self, **fields: object) -> str:
        return team_toml(self.name, group=self.group, owner=self.service.name, root=self.root, **fields)


@contextmanager
def real_team(**fields: object) -> Iterator[Team]:
    """Make the accounts (skipping where users cannot be made), yield the team, remove all."""
    _need_useradd()
    tag = uuid.uuid4().hex[:6]
    group = f"shmtg{tag}"
    users: list[str] = []
    groups: list[str] = []
    try:
        done = _run("groupadd", "--system", group)
        if done.returncode != 0:
            pytest.skip(f"cannot create a group: {done.stderr.strip()}")
        groups.append(group)

        def add(name: str, *extra: str) -> User:
            user = _add_user(name, *extra)
            users.append(name)
            groups.append(name)
            return user

        service = add(f"shmts{tag}", "-G", group)
        a = add(f"shmta{tag}", "-G", group)
        b = add(f"shmtb{tag}", "-G", group)
        outsider = add(f"shmto{tag}")
        with teams_dir() as teams:
            team = Team(
                name=f"t{tag}", group=group, gid=grp.getgrnam(group).gr_gid, service=service, a=a, b=b,
                outsider=outsider, teams=teams, root=unique_team_root(),
            )
            teams.write(team.toml(**fields))
            try:
                yield team
            finally:
                shutil.rmtree(team.root, ignore_errors=True)
    finally:
        for name in users:
            _run("userdel", name)
        for name in groups:
            _run("groupdel", name)


@contextmanager
def team_in_env(**fields: object) -> Iterator[Team]:
    """:func:`real_team` with ``$SHMCACHE_TEAMS_FILE`` naming its teams file while it lives
    (what the CLI and ``team=`` read)."""
    with real_team(**fields) as made:
        os.environ[ENV_TEAMS_FILE] = str(made.teams.file)
        try:
            yield made
        finally:
            del os.environ[ENV_TEAMS_FILE]


def groups_of(user: User) -> list[int]:
    """The user's groups as the user database says (what a login would give)."""
    return os.getgrouplist(user.name, user.gid)


def become(user: User, groups: list[int] | None = None) -> None:
    """In a forked child: drop to ``user`` (with ``groups``, default its own), without
    ``SHMCACHE_*`` variables but the teams file's."""
    os.setgroups(groups_of(user) if groups is None else groups)
    os.setgid(user.gid)
    os.setuid(user.uid)
    for name in [name for name in os.environ if name.startswith(ENV_PREFIX) and name != ENV_TEAMS_FILE]:
        del os.environ[name]


def as_user(user: User, fn: Callable[..., Any], *args: Any, groups: list[int] | None = None) -> Any:
    """``fn(*args)`` in a forked child running as ``user``: its return value, or the
    exception it raised, raised again here. (The interpreter may live where other users
    cannot read: a child imports nothing new, so everything it runs is imported first.)"""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child process
        os.close(read_end)
        try:
            become(user, groups)
            outcome: tuple[str, Any] = ("returned", fn(*args))
        except BaseException as exc:
            outcome = ("raised", exc)
        try:
            payload = pickle.dumps(outcome)
        except Exception as exc:
            payload = pickle.dumps(("raised", RuntimeError(f"unpicklable outcome {outcome!r}: {exc}")))
        with os.fdopen(write_end, "wb") as out:
            out.write(payload)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as from_child:
        payload = from_child.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and payload, f"child as {user.name} died: {status}"
    kind, value = pickle.loads(payload)
    if kind == "raised":
        raise value
    return value


def forked_as(
    user: User,
    work: Callable[[int, int], None],
    *,
    close: tuple[int, ...] = (),
    groups: list[int] | None = None,
) -> tuple[int, int, int]:
    """Fork a child that runs ``work(report_fd, hold_fd)`` as ``user`` (with ``groups``, as
    :func:`become`; exit status 0 if it returned): ``(pid, read end of its reports, write
    end whose closing releases its hold_fd)``. ``close``: the parent's descriptors of other
    children (their release ends) that this one must not keep open, or they would never
    see EOF."""
    report_r, report_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child process
        code = 1
        try:
            for fd in (report_r, hold_w, *close):
                os.close(fd)
            become(user, groups)
            work(report_w, hold_r)
            code = 0
        finally:
            os._exit(code)
    os.close(report_w)
    os.close(hold_r)
    return pid, report_r, hold_w


class TeamDaemon:
    """``shmcache serve --team NAME`` (``name``, default the team's) in a forked child running
    as ``user`` (the team's service account, or whoever a test says), its stderr in a file;
    ``args`` are more flags; ``argv`` replaces the whole command line, ``env`` is set in the child."""

    def __init__(
        self,
        team: Team,
        user: User,
        *args: str,
        name: str | None = None,
        argv: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        _import_the_daemon()
        self.team = team
        name = team.name if name is None else name
        self.log_path = Path(SHM_DIR) / f"shmcache-test-daemon-{uuid.uuid4().hex[:8]}.log"
        atexit.register(self.log_path.unlink, missing_ok=True)  # a daemon that exited itself too
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        os.fchmod(log_fd, 0o666)
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - child process
            code = 1
            try:
                os.dup2(log_fd, 2)
                sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - the child's
                become(user)
                os.environ.update(env or {})
                from shmcache._cli.app import app

                command = ["serve", "--team", name, *args] if argv is None else argv
                app(command, prog_name="shmcache", standalone_mode=False)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException as exc:
                os.write(2, f"daemon child failed: {exc!r}\n".encode())
            finally:
                os._exit(code)
        os.close(log_fd)
        self.status: int | None = None

    @property
    def log(self) -> str:
        try:
            return self.log_path.read_text()
        except FileNotFoundError:
            return ""

    def exited(self) -> int | None:
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
        return self.status

    def wait_ready(self, timeout: float = 60.0) -> TeamDaemon:
        deadline = time.monotonic() + timeout
        while "listening on" not in self.log:
            if self.exited() is not None or time.monotonic() > deadline:
                raise AssertionError(f"team daemon did not start (exit {self.status}):\n{self.log}")
            time.sleep(0.05)
        return self

    def wait_exit(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while self.exited() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"team daemon did not exit:\n{self.log}")
            time.sleep(0.05)
        assert self.status is not None
        return self.status

    def stop(self) -> int:
        if self.exited() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                return self.wait_exit(30)
            except AssertionError:
                os.kill(self.pid, signal.SIGKILL)
        status = self.wait_exit(30)
        self.log_path.unlink(missing_ok=True)
        return status


def _import_the_daemon() -> None:
    """What ``serve`` imports on demand, imported here (as root) before a child drops to
    an account that may not read the interpreter's files."""
    import importlib

    for name in (
        "shmcache._cli.app",
        "shmcache._cli.serve",
        "shmcache.service",
        "shmcache.service.server",
        "shmcache.service.app",
        "shmcache.service.team",
        "uvicorn.loops.auto",
        "uvicorn.loops.asyncio",
        "uvicorn.lifespan.on",
        "uvicorn.protocols.http.httptools_impl",
        "uvicorn.protocols.http.auto",
        "uvicorn.protocols.websockets.auto",
        "uvicorn.middleware.proxy_headers",
        "shmcache.client",
        "httpx",
    ):
        importlib.import_module(name)
    try:
        importlib.import_module("uvicorn.loops.uvloop")
        importlib.import_module("uvloop")
    except ImportError:
        pass
