"""``shmcache serve --team NAME``: the daemon of a team root, run as the team's service
account.

Before anything is served: the teams file is read (it alone says where the root is, who
owns it and which group reads it), the process must be that account (never root), the
root is created (or checked) owned by the account with the team's group, setgid, mode
02750 (so everything made under it gets the group: directories 0750, files 0640, per
``_disk/layout.modes_of``), the umask lets nothing reach others, and the team's budget and
allowed sources become the daemon's settings. Connections on the socket (0660) are then
accepted from the account, root and the members of the team's group (:class:`TeamPeers`);
anyone else gets a 403 saying why.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import stat
import time
from pathlib import Path

from shmcache._disk.layout import TEAM_ROOT_MODE
from shmcache._disk.trust import describe_uid
from shmcache._sources.urls import is_url, local_path_of
from shmcache._team.config import TeamConfig, check_team_root, load_team
from shmcache.errors import CacheRootError, TeamConfigError

from .settings import Settings

__all__ = ["TEAM_ROOT_MODE", "TEAM_SOCKET_MODE", "TEAM_UMASK", "TeamPeers", "prepare_team"]

logger = logging.getLogger(__name__)

TEAM_SOCKET_MODE = 0o660
"""The daemon's socket: the account and the group connect (the peer check comes after)."""
TEAM_UMASK = 0o027
"""Nothing the daemon creates is writable by the group or reachable by others."""
_MEMBERSHIP_TTL_S = 10.0
"""How long a uid's group membership is believed before it is looked up again."""


def prepare_team(settings: Settings) -> tuple[Settings, TeamConfig]:
    """Check who runs the daemon, make or check the team's root, and return the settings
    the daemon runs with (the team's root, budget and allowed sources) and the team."""
    assert settings.team is not None
    config = load_team(settings.team)
    _refuse_wrong_account(config)
    os.umask(TEAM_UMASK)
    check_team_root(config)  # its parents, and the root if it exists (owner, group, modes)
    _make_root(config)
    check_team_root(config)
    update: dict[str, object] = {
        "root": config.root,
        "allow_source": tuple(_allowed(config)),
    }
    if config.budget is not None:
        update["max_bytes"] = config.budget
    logger.info(
        "team %s: root %s (owner %s, group %s), budget %s", config.name, config.root, config.owner,
        config.group, "none" if config.budget is None else config.budget,
    )
    return settings.model_copy(update=update), config


def _refuse_wrong_account(config: TeamConfig) -> None:
    me = os.geteuid()
    run_as = (
        f"run it as {config.owner} (sudo -u {config.owner} shmcache serve --team {config.name}, "
        f"or systemctl start shmcache-team@{config.name})"
    )
    if me == 0:
        raise CacheRootError(
            f"shmcache serve --team {config.name} refuses to run as root: the team's daemon runs as "
            f"its service account {config.owner} so that a bug cannot reach beyond the team's root; {run_as}"
        )
    if me != config.uid:
        raise CacheRootError(
            f"shmcache serve --team {config.name} must run as the team's service account "
            f"{describe_uid(config.uid)}, not as {describe_uid(me)}; {run_as}"
        )
    if config.gid != os.getegid() and config.gid not in os.getgroups():
        raise TeamConfigError(
            f"the service account {config.owner} is not in the team's group {config.group}: add it "
            f"(usermod -aG {config.group} {config.owner}) and start the daemon again"
        )


def _make_root(config: TeamConfig) -> None:
    """Create the root (private until its group and mode are set), or set an existing
    one of ours to the team's group and mode."""
    root = config.root
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise CacheRootError(f"cannot create team root {root}: {exc.strerror}") from exc
    st = os.lstat(root)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == config.uid:  # else check_team_root says why
        if st.st_gid != config.gid:
            os.chown(root, -1, config.gid)
        if stat.S_IMODE(st.st_mode) != TEAM_ROOT_MODE:
            os.chmod(root, TEAM_ROOT_MODE)


def _allowed(config: TeamConfig) -> list[Path | str]:
    """The team's ``allow_sources`` as the daemon's ``--allow-source`` takes them."""
    allowed: list[Path | str] = []
    for source in config.allow_sources:
        local = local_path_of(source) if is_url(source) else source
        if local is None:
            allowed.append(source.rstrip("/"))
            continue
        real = Path(os.path.realpath(local))
        if not real.is_dir():
            raise TeamConfigError(f"team {config.name}: allow_sources names {real}, which is not a directory")
        allowed.append(real)
    return allowed


def _name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class TeamPeers:
    """Who may use a team daemon's socket: the service account, root, and the members of
    the team's group (supplementary or primary, from the user database, looked up again
    every few seconds so that ``usermod`` takes effect)."""

    def __init__(self, config: TeamConfig) -> None:
        self.config = config
        self._known: dict[int, tuple[float, bool]] = {}

    def refusal(self, uid: int) -> str | None:
        """None if ``uid`` may connect; else why not (the 403's detail)."""
        if uid in (0, self.config.uid):
            return None
        now = time.monotonic()
        known = self._known.get(uid)
        if known is None or now - known[0] > _MEMBERSHIP_TTL_S:
            known = (now, self._is_member(uid))
            self._known[uid] = known
        if known[1]:
            return None
        return (
            f"{describe_uid(uid)} is not a member of team {self.config.name} (group {self.config.group}); "
            f"an administrator adds members with: usermod -aG {self.config.group} {_name(uid)}"
        )

    def _is_member(self, uid: int) -> bool:
        try:
            user = pwd.getpwuid(uid)
        except KeyError:
            return False
        try:
            return self.config.gid in os.getgrouplist(user.pw_name, user.pw_gid)
        except OSError:
            return user.pw_name in grp.getgrgid(self.config.gid).gr_mem
