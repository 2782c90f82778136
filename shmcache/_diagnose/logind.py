"""Whether systemd-logind will delete the cache when its owner logs out.

With ``RemoveIPC=yes`` (systemd's default since v230), logind removes every file that a
regular user owns under ``/dev/shm`` when that user's last login session ends (systemd
#2039, #4532): a cache put over ssh vanishes at logout while the training run goes on in
tmux. It spares system users (uid <= SYS_UID_MAX), users with lingering enabled
(``loginctl enable-linger``), and files outside ``/dev/shm``. ``doctor`` and ``serve`` ask
:func:`removeipc_risk`; the file system locations are parameters so a test can build a
machine's configuration in a temporary directory.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from pathlib import Path

from .._disk.layout import SHM_DIR

__all__ = ["RemoveIpcRisk", "SystemPaths", "removeipc_risk"]

_SYSTEM_UID_MAX = 999  # systemd's compiled-in default when /etc/login.defs says nothing
_TRUE = {"1", "yes", "y", "true", "t", "on"}
_FALSE = {"0", "no", "n", "false", "f", "off"}


@dataclass(frozen=True)
class SystemPaths:
    """Where this machine keeps what logind reads (``/`` on a real machine)."""

    base: Path = Path("/")

    def at(self, path: str) -> Path:
        return self.base / path.lstrip("/")


@dataclass(frozen=True)
class RemoveIpcRisk:
    """The cache under ``root`` will be deleted when ``user`` logs out; ``fix`` says how not."""

    user: str
    uid: int
    source: str  # the file that set RemoveIPC, or "systemd's default"

    @property
    def summary(self) -> str:
        return (
            f"systemd-logind has RemoveIPC=yes ({self.source}): when {self.user} (uid {self.uid}) "
            "ends their last login session, logind deletes their files under /dev/shm, this cache too"
        )

    @property
    def fix(self) -> str:
        return (
            f"`loginctl enable-linger {self.user}` (keeps them while the user is logged out), or "
            "RemoveIPC=no in /etc/systemd/logind.conf, or run the daemon under a system account "
            "(the team cache)"
        )


def removeipc_risk(
    root: Path, uid: int | None = None, system: SystemPaths | None = None
) -> RemoveIpcRisk | None:
    """The risk that logind removes ``root`` at ``uid``'s logout, or None where there is none."""
    system = system or SystemPaths()
    uid = os.getuid() if uid is None else uid
    shm = os.path.realpath(system.at(SHM_DIR))
    if not os.path.realpath(root).startswith(shm.rstrip("/") + "/"):
        return None  # logind removes POSIX shared memory only (/dev/shm, /dev/mqueue)
    if not system.at("/run/systemd/system").is_dir():
        return None  # not booted with systemd (a container, another init): no logind
    if uid <= _system_uid_max(system):
        return None
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    if system.at(f"/var/lib/systemd/linger/{user}").exists():
        return None
    remove, source = _remove_ipc(system)
    return RemoveIpcRisk(user, uid, source) if remove else None


def _system_uid_max(system: SystemPaths) -> int:
    try:
        text = system.at("/etc/login.defs").read_text(errors="replace")
    except OSError:
        return _SYSTEM_UID_MAX
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "SYS_UID_MAX" and parts[1].isdigit():
            return int(parts[1])
    return _SYSTEM_UID_MAX


def _remove_ipc(system: SystemPaths) -> tuple[bool, str]:
    """RemoveIPC as logind reads it: logind.conf, then drop-ins ordered by file name (a
    name in /etc hides the same name elsewhere); the last setting wins."""
    remove, source = True, "systemd's default"
    files = [system.at("/etc/systemd/logind.conf")]
    dropins: dict[str, Path] = {}
    for directory in ("/usr/lib/systemd/logind.conf.d", "/usr/local/lib/systemd/logind.conf.d",
                      "/run/systemd/logind.conf.d", "/etc/systemd/logind.conf.d"):
        try:
            names = os.listdir(system.at(directory))
        except OSError:
            continue
        for name in names:
            if name.endswith(".conf"):
                dropins[name] = system.at(directory) / name  # later directories take precedence
    files += [dropins[name] for name in sorted(dropins)]
    for path in files:
        value = _login_setting(path, "RemoveIPC")
        if value is not None:
            remove, source = value, "/" + path.relative_to(system.base).as_posix()
    return remove, source


def _login_setting(path: Path, name: str) -> bool | None:
    """The last boolean ``name=`` of the ``[Login]`` section of ``path``, if any."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    section, value = "", None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]").strip()
            continue
        key, sep, setting = line.partition("=")
        if section == "Login" and sep and key.strip() == name:
            word = setting.strip().lower()
            if word in _TRUE:
                value = True
            elif word in _FALSE:
                value = False
    return value
