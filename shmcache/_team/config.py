"""The administrator's teams file, read only when root alone could have written it.

A team is declared once in ``/etc/shmcache/teams.toml`` (or the file named by
``$SHMCACHE_TEAMS_FILE``)::

    [teams.vision]
    group = "vision"              # the members: a Unix group
    owner = "shmcache-vision"     # the service account that owns the root and runs the daemon
    budget = "64GiB"              # optional
    user_quota = "16GiB"          # optional
    admins = ["alice"]            # optional
    allow_sources = ["/data"]     # optional
    root = "/dev/shm/shmcache-team-vision"   # the default

Everything a member trusts about a team root (whose it is, which group reads it) comes
from this file, so the file is trusted only when it and every directory above it are
owned by root and writable by nobody else: a member who could edit it (or plant one
under ``/tmp``) could point the team at a root of their own. :func:`team_root` then
checks the root itself against the file: owned by the declared account, group the
team's, writable by nobody else.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._disk.layout import ENV_ROOT, ENV_TEAM, ENV_TEAMS_FILE
from .._disk.trust import check_root, describe_uid
from .._units import size_in_bytes
from ..errors import CacheRootError, InvalidRequestError, TeamConfigError, UnknownTeamError

__all__ = [
    "DEFAULT_TEAMS_FILE",
    "TeamConfig",
    "check_team_root",
    "checked_team",
    "default_team_root",
    "load_team",
    "read_trusted_file",
    "team_of",
    "team_root",
    "teams_file",
]

DEFAULT_TEAMS_FILE = Path("/etc/shmcache/teams.toml")
_TEAM_ROOT_PREFIX = "/dev/shm/shmcache-team-"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_FIELDS = {"group", "owner", "budget", "user_quota", "admins", "allow_sources", "root"}
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_MAX_FILE_BYTES = 1 << 20


@dataclass(frozen=True)
class TeamConfig:
    """One ``[teams.NAME]`` table, with its accounts resolved to ids."""

    name: str
    group: str
    gid: int
    owner: str
    uid: int
    budget: int | None
    """Bytes the team's root may hold (None: the tmpfs size bounds it)."""
    user_quota: int | None
    """Bytes each member's entries may hold (None: no per-member limit)."""
    admins: frozenset[str]
    """Members who may evict anyone's entries."""
    allow_sources: tuple[str, ...]
    """Directories and URL prefixes the daemon loads from with its own rights."""
    root: Path


def teams_file() -> Path:
    """``$SHMCACHE_TEAMS_FILE``, else ``/etc/shmcache/teams.toml``."""
    configured = os.environ.get(ENV_TEAMS_FILE)
    return Path(configured) if configured else DEFAULT_TEAMS_FILE


def default_team_root(name: str) -> Path:
    """``/dev/shm/shmcache-team-<name>``: where a team's root is unless the file says otherwise."""
    return Path(_TEAM_ROOT_PREFIX + name)


def read_trusted_file(path: Path) -> bytes:
    """The bytes of ``path``, if it and every directory above it (links resolved) are
    owned by root and writable by nobody else; :class:`CacheRootError` saying which is
    not, :class:`UnknownTeamError` if there is no such file."""
    if not path.is_absolute():
        raise CacheRootError(f"teams file {path} is a relative path; name it by its absolute path")
    real = Path(os.path.realpath(path))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise UnknownTeamError(
            f"no teams file {path}: an administrator declares teams there (see docs/team.md), "
            f"or set {ENV_TEAMS_FILE} to the file that declares them"
        ) from None
    except OSError as exc:
        raise CacheRootError(f"cannot read teams file {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CacheRootError(f"teams file {path} is not a regular file")
        try:
            real_st = os.lstat(real)
        except OSError:
            real_st = None
        if real_st is None or (real_st.st_dev, real_st.st_ino) != (st.st_dev, st.st_ino):
            raise CacheRootError(f"teams file {path} changed while it was checked; try again")
        _refuse_unless_root_only(real, st, "teams file")
        for parent in real.parents:
            try:
                parent_st = os.lstat(parent)
            except OSError as exc:
                raise CacheRootError(
                    f"cannot check directory {parent} of teams file {path}: {exc.strerror}"
                ) from exc
            _refuse_unless_root_only(parent, parent_st, f"directory {parent} above teams file")
        data = os.read(fd, _MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_FILE_BYTES:
        raise TeamConfigError(
            f"teams file {path} is over {_MAX_FILE_BYTES} bytes; it declares teams, nothing else"
        )
    return data


def _refuse_unless_root_only(path: Path, st: os.stat_result, what: str) -> None:
    shown = f"{what} {path}" if what == "teams file" else what
    if st.st_uid != 0:
        raise CacheRootError(
            f"{shown} belongs to {describe_uid(st.st_uid)}, not root: anyone who can edit it could "
            "point the team at a root of their own, so it is not trusted; an administrator keeps "
            "it root-owned (e.g. /etc/shmcache/teams.toml, mode 0644)"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & _WRITABLE_BY_OTHERS:
        raise CacheRootError(
            f"{shown} is mode {mode:04o}: users other than root can write to it, so the teams file "
            "is not trusted; "
            + (
                f"keep it where only root can write (chmod go-w {path})"
                if what == "teams file"
                else "move the teams file to a directory only root can write (e.g. "
                "/etc/shmcache/teams.toml), not under /tmp or /dev/shm, whose modes must stay as they are"
            )
        )


def load_team(name: str) -> TeamConfig:
    """The team ``name`` as the trusted teams file declares it.

    Raises :class:`CacheRootError` (the file is not trusted), :class:`TeamConfigError`
    (it is malformed) or :class:`UnknownTeamError` (no such team, or no file)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise UnknownTeamError(
            f"{name!r} is not a team name (letters, digits, '_', '.', '-'; at most 64, starting with a "
            "letter or digit)"
        )
    if sys.version_info >= (3, 11):  # deferred: only team roots need a TOML parser
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib

    path = teams_file()
    raw = read_trusted_file(path)
    try:
        document = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise TeamConfigError(f"teams file {path} is not valid TOML: {exc}") from None
    extra = set(document) - {"teams"}
    if extra:
        raise TeamConfigError(
            f"teams file {path} has top-level keys {sorted(extra)}; it holds [teams.NAME] tables only"
        )
    teams = document.get("teams", {})
    if not isinstance(teams, dict):
        raise TeamConfigError(f"teams file {path}: 'teams' must be tables [teams.NAME]")
    table = teams.get(name)
    if table is None:
        declared = ", ".join(sorted(teams)) or "none"
        raise UnknownTeamError(
            f"no team {name!r} in {path} (declared: {declared}); ask an administrator to add it"
        )
    if not isinstance(table, dict):
        raise TeamConfigError(f"teams file {path}: teams.{name} must be a table [teams.{name}]")
    return _team_of(name, table, path)


def _team_of(name: str, table: dict[str, Any], path: Path) -> TeamConfig:
    where = f"teams file {path}, [teams.{name}]"
    unknown = set(table) - _FIELDS
    if unknown:
        raise TeamConfigError(f"{where}: unknown fields {sorted(unknown)} (known: {sorted(_FIELDS)})")
    group = _required_string(table, "group", where)
    owner = _required_string(table, "owner", where)
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        raise TeamConfigError(f"{where}: group {group!r} does not exist (groupadd {group})") from None
    try:
        uid = pwd.getpwnam(owner).pw_uid
    except KeyError:
        raise TeamConfigError(
            f"{where}: owner {owner!r} is no account (see deploy/systemd/ for a sysusers.d line)"
        ) from None
    if uid == 0:
        raise TeamConfigError(
            f"{where}: owner {owner!r} is root; the team daemon runs as a dedicated service account"
        )
    root_value = table.get("root")
    if root_value is None:
        root = default_team_root(name)
    elif isinstance(root_value, str) and os.path.isabs(root_value):
        root = Path(os.path.normpath(root_value))
    else:
        raise TeamConfigError(f"{where}: root must be an absolute path, got {root_value!r}")
    return TeamConfig(
        name=name,
        group=group,
        gid=gid,
        owner=owner,
        uid=uid,
        budget=_size(table, "budget", where),
        user_quota=_size(table, "user_quota", where),
        admins=frozenset(_strings(table, "admins", where)),
        allow_sources=tuple(_strings(table, "allow_sources", where)),
        root=root,
    )


def _required_string(table: dict[str, Any], field: str, where: str) -> str:
    value = table.get(field)
    if not isinstance(value, str) or not value:
        raise TeamConfigError(
            f"{where}: {field} is required (a name, e.g. {field} = \"vision\"), got {value!r}"
        )
    return value


def _size(table: dict[str, Any], field: str, where: str) -> int | None:
    value = table.get(field)
    if value is None:
        return None
    try:
        size = size_in_bytes(value)
    except ValueError as exc:
        raise TeamConfigError(f"{where}: {field} {exc}") from None
    if size < 0:
        raise TeamConfigError(f"{where}: {field} must be >= 0, got {value!r}")
    return size


def _strings(table: dict[str, Any], field: str, where: str) -> list[str]:
    value = table.get(field, [])
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise TeamConfigError(f"{where}: {field} must be a list of strings, got {value!r}")
    return value


def team_root(name: str) -> Path:
    """The root of team ``name``, after checking it against the trusted teams file: a
    real directory owned by the declared account, group the team's, writable by nobody
    else. :class:`CacheRootError` says why not; a root that does not exist yet is
    returned as it is (there is nothing in it to read, and only its account can make it)."""
    return checked_team(name).root


def checked_team(name: str) -> TeamConfig:
    """:func:`load_team`, then :func:`check_team_root` of its root."""
    config = load_team(name)
    check_team_root(config)
    return config


def team_of(root: object, team: str | None) -> str | None:
    """The team a caller means: ``team``, else ``$SHMCACHE_TEAM`` when no ``root`` is
    given; None for a personal root. Both ``root`` and ``team`` (or both variables) are
    an :class:`InvalidRequestError`: the one root to use would be a guess."""
    if team is not None:
        if root is not None:
            raise InvalidRequestError(
                f"pass root= or team=, not both (root={root!r}, team={team!r}): a team's root "
                "comes from the administrator's teams file"
            )
        return team
    if root is not None:
        return None
    from_env = os.environ.get(ENV_TEAM) or None
    if from_env is not None and os.environ.get(ENV_ROOT):
        raise InvalidRequestError(
            f"both {ENV_ROOT} and {ENV_TEAM} are set: unset one ({ENV_TEAM} uses the team's root)"
        )
    return from_env


def check_team_root(config: TeamConfig) -> None:
    """Refuse (:class:`CacheRootError`) ``config.root`` unless it, and every directory
    above it, is safe: the root owned by the team's account and group, not writable by
    others; each parent owned by root or that account, and writable by others only when
    sticky (as ``/dev/shm`` is: nobody can rename another's entry in it)."""
    root = config.root
    for parent in reversed(root.parents):
        try:
            st = os.lstat(parent)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise CacheRootError(f"cannot reach team root {root}: {parent}: {exc.strerror}") from exc
        if stat.S_ISLNK(st.st_mode):
            raise CacheRootError(
                f"team root {root} is under a symlink ({parent}); the teams file must name its real path"
            )
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid not in (0, config.uid) or (mode & _WRITABLE_BY_OTHERS and not mode & stat.S_ISVTX):
            raise CacheRootError(
                f"team root {root} is under {parent} ({describe_uid(st.st_uid)}, mode {mode:04o}), which "
                "users other than root and the team's account can rename or replace; the teams file "
                "must name a root under /dev/shm or a directory only root can write"
            )
    check_root(str(root), owner=(config.uid, config.gid))
