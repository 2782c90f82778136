"""Teams files and team roots for tests: a trusted teams file needs a root-owned directory
that nobody else can write, outside /tmp and /dev/shm (so only where the tests run as
root); team roots are unique paths under /dev/shm. Everything is removed afterwards."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from shmcache._disk.layout import SHM_DIR

__all__ = ["TeamsDir", "team_toml", "teams_dir", "unique_team_root"]

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
