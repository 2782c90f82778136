"""Real local users for tests (``useradd``), and running a function as one of them in a
forked child. Skips where users cannot be made (not root, no ``useradd``).

The child never imports anything new (the interpreter may live where other users cannot
read): import what it runs before calling :func:`as_user`.
"""

from __future__ import annotations

import os
import pickle
import pwd
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from shmcache._disk.layout import ENV_PREFIX

__all__ = ["User", "as_user", "made_users"]


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


def _add_user(name: str, groups: Sequence[str]) -> User:
    command = ["useradd", "--system", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin"]
    if groups:
        command += ["--groups", ",".join(groups)]
    done = subprocess.run([*command, name], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot create a user: {done.stderr.strip()}")
    entry = pwd.getpwnam(name)
    return User(name, entry.pw_uid, entry.pw_gid, tuple(os.getgrouplist(name, entry.pw_gid)))


@contextmanager
def made_users(*roles: str, groups: Sequence[str] = ()) -> Iterator[dict[str, User]]:
    """One real user per role (in ``groups`` too, made first if missing), removed afterwards."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to create users")
    tag = uuid.uuid4().hex[:6]
    made: list[User] = []
    made_groups: list[str] = []
    try:
        for group in groups:
            if subprocess.run(["groupadd", "--system", group], capture_output=True).returncode != 0:
                pytest.skip(f"cannot create group {group}")
            made_groups.append(group)
        users = {}
        for role in roles:
            users[role] = _add_user(f"shm{role[:4]}{tag}", groups)
            made.append(users[role])
        yield users
    finally:
        for user in made:
            subprocess.run(["userdel", user.name], capture_output=True)
            subprocess.run(["groupdel", user.name], capture_output=True)
        for group in made_groups:
            subprocess.run(["groupdel", group], capture_output=True)


def as_user(user: User, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a forked child running as ``user`` (with its groups, no
    ``SHMCACHE_*`` variables): its return value, or the exception it raised, raised here."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child process
        os.close(read_end)
        try:
            os.setgroups(list(user.groups))
            os.setgid(user.gid)
            os.setuid(user.uid)
            for name in [name for name in os.environ if name.startswith(ENV_PREFIX)]:
                del os.environ[name]
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
