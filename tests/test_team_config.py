"""The teams file: parsed into a :class:`TeamConfig`, trusted only when root alone could
have written it; a team root checked against it (owner, group, modes, parents).

Real files in a root-owned directory (``team_helpers.teams_dir``) and real roots under
/dev/shm, owned by existing system accounts (``daemon``, ``nobody``) through ``chown``."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from team_helpers import TeamsDir, team_toml, teams_dir, unique_team_root

from shmcache import CacheRootError, Store, TeamConfigError, UnknownTeamError
from shmcache._disk.layout import ENV_TEAMS_FILE, PRIVATE_MODES, TEAM_MODES, modes_of
from shmcache._team.config import (
    DEFAULT_TEAMS_FILE,
    TeamConfig,
    default_team_root,
    load_team,
    team_root,
    teams_file,
)

OWNER = "daemon"  # an account that exists on every Linux system, not root
GROUP = "daemon"
OTHER = "nobody"


def _ids() -> tuple[int, int]:
    try:
        return pwd.getpwnam(OWNER).pw_uid, grp.getgrnam(GROUP).gr_gid
    except KeyError:
        pytest.skip(f"no {OWNER} account or group here")


@pytest.fixture
def trusted(monkeypatch: pytest.MonkeyPatch) -> Iterator[TeamsDir]:
    with teams_dir() as made:
        monkeypatch.setenv(ENV_TEAMS_FILE, str(made.file))
        yield made


@pytest.fixture
def team_root_path() -> Iterator[Path]:
    path = unique_team_root()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_teams_file_defaults_to_etc_and_follows_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_TEAMS_FILE, raising=False)
    assert teams_file() == DEFAULT_TEAMS_FILE == Path("/etc/shmcache/teams.toml")
    monkeypatch.setenv(ENV_TEAMS_FILE, "/srv/teams.toml")
    assert teams_file() == Path("/srv/teams.toml")


def test_a_full_team_is_read_with_ids_and_sizes(trusted: TeamsDir) -> None:
    uid, gid = _ids()
    trusted.write(
        team_toml(
            "vision",
            group=GROUP,
            owner=OWNER,
            budget="64GiB",
            user_quota="16GiB",
            admins=["alice"],
            allow_sources=["/data", "s3://lab-datasets/"],
        )
        + team_toml("nlp", group=GROUP, owner=OWNER, root=Path("/dev/shm/nlp-cache"))
    )
    assert load_team("vision") == TeamConfig(
        name="vision",
        group=GROUP,
        gid=gid,
        owner=OWNER,
        uid=uid,
        budget=64 << 30,
        user_quota=16 << 30,
        admins=frozenset({"alice"}),
        allow_sources=("/data", "s3://lab-datasets/"),
        root=default_team_root("vision"),
    )
    assert default_team_root("vision") == Path("/dev/shm/shmcache-team-vision")
    nlp = load_team("nlp")
    assert (nlp.budget, nlp.user_quota, nlp.admins, nlp.allow_sources) == (None, None, frozenset(), ())
    assert nlp.root == Path("/dev/shm/nlp-cache")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[teams.t]\nowner = "daemon"\n', "group is required"),
        ('[teams.t]\ngroup = "daemon"\n', "owner is required"),
        ('[teams.t]\ngroup = "no-such-group-x9"\nowner = "daemon"\n', "'no-such-group-x9' does not exist"),
        ('[teams.t]\ngroup = "daemon"\nowner = "no-such-user-x9"\n', "owner 'no-such-user-x9' is no account"),
        ('[teams.t]\ngroup = "daemon"\nowner = "root"\n', "is root"),
        ('[teams.t]\ngroup = "daemon"\nowner = "daemon"\nbudget = "lots"\n', "budget must be a size"),
        ('[teams.t]\ngroup = "daemon"\nowner = "daemon"\nbudjet = "1GiB"\n', "unknown fields ['budjet']"),
        ('[teams.t]\ngroup = "daemon"\nowner = "daemon"\nadmins = "alice"\n', "admins must be a list"),
        ('[teams.t]\ngroup = "daemon"\nowner = "daemon"\nroot = "rel/dir"\n', "root must be an absolute"),
        ("[teams.t\ngroup = 1\n", "not valid TOML"),
        ('root = "/dev/shm/x"\n', "top-level keys ['root']"),
    ],
)
def test_a_malformed_team_is_a_typed_error_saying_what(trusted: TeamsDir, text: str, words: str) -> None:
    _ids()
    trusted.write(text)
    with pytest.raises(TeamConfigError, match=None) as caught:
        load_team("t")
    assert words in str(caught.value) and str(trusted.file) in str(caught.value)


def test_an_unknown_team_names_the_declared_ones(trusted: TeamsDir) -> None:
    _ids()
    trusted.write(team_toml("vision", group=GROUP, owner=OWNER))
    with pytest.raises(UnknownTeamError, match=r"no team 'audio' in .*declared: vision"):
        load_team("audio")
    with pytest.raises(UnknownTeamError, match="not a team name"):
        load_team("../etc")


def test_no_teams_file_is_an_unknown_team(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_TEAMS_FILE, f"/etc/shmcache-absent-{uuid.uuid4().hex}/teams.toml")
    with pytest.raises(UnknownTeamError, match="no teams file"):
        load_team("vision")


def _refused(words: str) -> str:
    with pytest.raises(CacheRootError) as caught:
        load_team("vision")
    assert words in str(caught.value), str(caught.value)
    return str(caught.value)


def test_a_teams_file_owned_by_a_member_is_refused(trusted: TeamsDir) -> None:
    _ids()
    path = trusted.write(team_toml("vision", group=GROUP, owner=OWNER))
    os.chown(path, pwd.getpwnam(OTHER).pw_uid, -1)
    _refused("not root")


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666])
def test_a_teams_file_others_can_write_is_refused(trusted: TeamsDir, mode: int) -> None:
    _ids()
    trusted.write(team_toml("vision", group=GROUP, owner=OWNER), mode=mode)
    _refused(f"mode {mode:04o}")


def test_a_teams_file_under_a_writable_directory_is_refused(trusted: TeamsDir) -> None:
    _ids()
    trusted.write(team_toml("vision", group=GROUP, owner=OWNER))
    os.chmod(trusted.path, 0o1777)  # as /tmp and /dev/shm are: anyone may add a file there
    message = _refused("can write to it")
    # the fix is to move the file, never to chmod a shared directory such as /tmp
    assert "chmod" not in message and "move the teams file" in message, message


def test_a_teams_file_under_a_directory_of_a_member_is_refused(trusted: TeamsDir) -> None:
    _ids()
    trusted.write(team_toml("vision", group=GROUP, owner=OWNER))
    os.chown(trusted.path, pwd.getpwnam(OTHER).pw_uid, -1)
    _refused("not root")


def test_a_teams_file_in_tmp_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Whoever runs the tests: /tmp is writable by everyone (or the file is not root's)."""
    path = tmp_path / "teams.toml"
    path.write_text(team_toml("vision", group=GROUP, owner=OWNER))
    monkeypatch.setenv(ENV_TEAMS_FILE, str(path))
    with pytest.raises(CacheRootError, match="not trusted"):
        load_team("vision")


def test_a_link_to_a_planted_teams_file_is_refused(trusted: TeamsDir, tmp_path: Path) -> None:
    _ids()
    planted = tmp_path / "teams.toml"
    planted.write_text(team_toml("vision", group=GROUP, owner=OWNER))
    os.symlink(planted, trusted.file)
    _refused("not trusted")


def _make_root(path: Path, uid: int, gid: int, mode: int = 0o750) -> None:
    os.mkdir(path)
    os.chown(path, uid, gid)
    os.chmod(path, mode)


def test_team_root_returns_the_checked_root(trusted: TeamsDir, team_root_path: Path) -> None:
    uid, gid = _ids()
    trusted.write(team_toml("vision", group=GROUP, owner=OWNER, root=team_root_path))
    assert team_root("vision") == team_root_path  # not made yet: nothing to read, nothing refused
    _make_root(team_root_path, uid, gid)
    assert team_root("vision") == team_root_path


def test_a_look_alike_root_of_a_member_is_refused(trusted: TeamsDir, team_root_path: Path) -> None:
    _, gid = _ids()
    trusted.write(team_toml("vision", group=GROUP, owner=OWNER, root=team_root_path))
    _make_root(team_root_path, pwd.getpwnam(OTHER).pw_uid, gid)
    with pytest.raises(CacheRootError, match="not to the team's service account"):
        team_root("vision")


def test_a_root_of_another_group_or_writable_by_others_is_refused(
    trusted: TeamsDir, team_root_path: Path
) -> None:
    uid, _ = _ids()
    trusted.write(team_toml("vision", group=GROUP, owner=OWNER, root=team_root_path))
    _make_root(team_root_path, uid, grp.getgrnam("nogroup").gr_gid if _has_group("nogroup") else 0)
    with pytest.raises(CacheRootError, match="not the team's"):
        team_root("vision")
    os.chown(team_root_path, uid, grp.getgrnam(GROUP).gr_gid)
    os.chmod(team_root_path, 0o770)
    with pytest.raises(CacheRootError, match="mode 0770"):
        team_root("vision")


def test_a_symlinked_team_root_is_refused(trusted: TeamsDir, team_root_path: Path) -> None:
    uid, gid = _ids()
    real = unique_team_root()
    _make_root(real, uid, gid)
    try:
        os.symlink(real, team_root_path)
        trusted.write(team_toml("vision", group=GROUP, owner=OWNER, root=team_root_path))
        with pytest.raises(CacheRootError, match="symlink"):
            team_root("vision")
    finally:
        os.unlink(team_root_path)
        shutil.rmtree(real)


def test_a_root_under_a_directory_a_member_can_write_is_refused(trusted: TeamsDir, tmp_path: Path) -> None:
    _ids()
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chown(parent, pwd.getpwnam(OTHER).pw_uid, -1)
    trusted.write(team_toml("vision", group=GROUP, owner=OWNER, root=parent / "root"))
    with pytest.raises(CacheRootError, match="can rename or replace"):
        team_root("vision")


def _has_group(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


# ---------------------------------------------------------------------- modes of what writers make


@pytest.mark.parametrize(
    ("root_mode", "modes"),
    [
        (0o700, PRIVATE_MODES),
        (0o755, PRIVATE_MODES),  # a directory a user made for $SHMCACHE_ROOT stays private inside
        (0o750, PRIVATE_MODES),
        (0o2755, PRIVATE_MODES),  # others may read the root: not a team root
        (0o2700, PRIVATE_MODES),
        (0o2750, TEAM_MODES),
    ],
)
def test_the_root_decides_the_modes_of_what_is_made(root_mode: int, modes: tuple[int, int]) -> None:
    assert modes_of(root_mode | 0o040000) == modes  # S_IFDIR, as stat gives it


def _modes_under(root: Path) -> set[tuple[str, int]]:
    found: set[tuple[str, int]] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISDIR(st.st_mode):
                found.add(("dir", stat.S_IMODE(st.st_mode) & 0o777))  # setgid inherited in a team root
            elif not stat.S_ISLNK(st.st_mode):  # entry links are 0777 whatever the umask
                found.add(("file", stat.S_IMODE(st.st_mode)))
    return found


def _fill(root: Path) -> None:
    store = Store(root)
    store.put_array("a/b", np.arange(10))
    store.put_strings("s", ["x"])
    store.set_budget(1 << 30)
    store.cache("c", lambda: np.zeros(3))
    store.evict("s")


@pytest.mark.parametrize(("root_mode", "expected"), [(0o755, {("dir", 0o700), ("file", 0o600)}),
                                                     (0o2750, {("dir", 0o750), ("file", 0o640)})])
def test_writers_make_entries_with_the_roots_modes(
    team_root_path: Path, root_mode: int, expected: set[tuple[str, int]]
) -> None:
    os.mkdir(team_root_path)
    os.chmod(team_root_path, root_mode)
    _fill(team_root_path)
    assert _modes_under(team_root_path) == expected
