"""What a member of a real team sees from the CLI (and the matching Python calls): another
member's key refused as such, ``--dtype`` on a team put, ``serve`` taking the global
``--team``, messages that name the team, its group and the user.

Real users and groups, a trusted teams file and ``shmcache serve --team`` run as the
service account (``tests/team_helpers.py``); skipped where users cannot be made.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from team_helpers import Team, TeamDaemon, User, as_user, forked_as, team_in_env
from typer.testing import CliRunner

import shmcache
from shmcache import (
    InvalidSourceError,
    NotPermittedError,
    QuotaExceededError,
    SourceNotAllowedError,
    Store,
)
from shmcache._cli.app import app
from shmcache._disk.layout import SHM_DIR

KiB = 1 << 10
QUOTA = 256 * KiB
RUNNER = CliRunner()


@pytest.fixture(scope="module")
def team() -> Iterator[Team]:
    with team_in_env(budget="64MiB", user_quota=f"{QUOTA // KiB}KiB") as made:
        yield made


@pytest.fixture(scope="module")
def daemon(team: Team) -> Iterator[TeamDaemon]:
    started = TeamDaemon(team, team.service).wait_ready()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def homes(team: Team) -> Iterator[Path]:
    """Each member's private directory (0700) in a directory everyone may traverse."""
    path = Path(SHM_DIR) / f"shmcache-test-homes-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    for user in (team.a, team.b, team.outsider):
        home = path / user.name
        home.mkdir(mode=0o700)
        os.chown(home, user.uid, user.gid)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _own(homes: Path, owner: User, name: str, data: np.ndarray, raw: bool = False) -> Path:
    path = homes / owner.name / name
    if raw:
        data.tofile(path)
    else:
        np.save(path, data)
    os.chown(path, owner.uid, owner.gid)
    os.chmod(path, 0o600)
    return path


def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = RUNNER.invoke(app, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.output


def _put_file(team: str, key: str, path: Path | str, overwrite: bool) -> list[str]:
    return shmcache.put_file(key, path, team=team, overwrite=overwrite)


def test_putting_over_another_members_key_is_not_permitted_not_an_unreadable_source(
    team: Team, daemon: TeamDaemon, homes: Path
) -> None:
    alices = _own(homes, team.a, "vocab.npy", np.arange(4.0))
    bobs = _own(homes, team.b, "vocab.npy", np.arange(8.0))
    assert as_user(team.a, _put_file, team.name, "vision/vocab", alices, False) == ["vision/vocab"]
    with pytest.raises(NotPermittedError, match="replace"):
        as_user(team.b, _put_file, team.name, "vision/vocab", bobs, True)
    code, out = as_user(
        team.b, _cli, "put", str(bobs), "--key", "vision/vocab", "--team", team.name, "--overwrite"
    )
    assert code == 1 and "replace" in out and "cannot be read" not in out, out
    assert Store(team=team.name).open_array("vision/vocab").tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_team_put_of_a_raw_token_file_takes_its_dtype(team: Team, daemon: TeamDaemon, homes: Path) -> None:
    tokens = _own(homes, team.a, "train.bin", np.arange(1000, dtype=np.uint16), raw=True)
    code, out = as_user(
        team.a, _cli, "put", str(tokens), "--key", "a/tok", "--dtype", "uint16", "--team", team.name
    )
    assert code == 0 and "a/tok" in out, out
    array = Store(team=team.name).open_array("a/tok")
    assert array.dtype == np.uint16 and array.tolist() == list(range(1000))


def _ask_daemon_to_load(team: str, key: str, path: Path) -> object:
    from shmcache.client import Client

    with Client(team=team, timeout=30) as client:
        return client.put_file(key, path)


def test_refusals_show_the_put_syntax_that_exists(team: Team, daemon: TeamDaemon, homes: Path) -> None:
    alices = _own(homes, team.a, "syntax.npy", np.arange(3.0))
    with pytest.raises(SourceNotAllowedError, match=r"`shmcache put PATH --key KEY --team NAME`"):
        as_user(team.a, _ask_daemon_to_load, team.name, "a/syntax", alices)
    with pytest.raises(InvalidSourceError, match=r"`shmcache put URL --key KEY --team NAME`"):
        as_user(team.a, _put_file, team.name, "a/url", "s3://bucket/x.npy", False)


def _put_ones(team: str, key: str, nbytes: int) -> object:
    return shmcache.put_array(key, np.ones(nbytes, dtype=np.uint8), team=team, overwrite=True)


def _client_stats(team: str) -> object:
    from shmcache.client import Client

    with Client(team=team, timeout=30) as client:
        return client.stats()


def test_a_quota_refusal_suggests_commands_on_the_team(team: Team, daemon: TeamDaemon, homes: Path) -> None:
    as_user(team.b, _put_ones, team.name, "b/big", 200 * KiB)
    with pytest.raises(QuotaExceededError, match=rf"`shmcache --team {team.name} ls` shows the OWNER"):
        as_user(team.b, _put_ones, team.name, "b/more", 200 * KiB)
    more = _own(homes, team.b, "more.npy", np.zeros(200 * KiB, dtype=np.uint8))
    code, out = as_user(team.b, _cli, "put", str(more), "--key", "b/cli", "--team", team.name)
    assert code == 1 and f"`shmcache --team {team.name} ls` shows the OWNER" in out, out
    code, out = as_user(team.b, _cli, "--team", team.name, "put", str(more), "--key", "b/cli")
    assert code == 1 and f"`shmcache --team {team.name} ls`" in out, out


def test_a_non_member_is_told_the_real_group_and_user(team: Team, daemon: TeamDaemon) -> None:
    fix = f"usermod -aG {team.group} {team.outsider.name}"
    code, out = as_user(team.outsider, _cli, "--team", team.name, "ls")
    assert code == 1 and fix in out and "(gid" not in out, out
    with pytest.raises(shmcache.CacheRootError, match=fix):
        as_user(team.outsider, _client_stats, team.name)


def _open_missing(team: str) -> str:
    try:
        shmcache.open_array("a/never-put", team=team)
    except shmcache.KeyNotFoundError as exc:
        return str(exc)
    return "opened"


def test_a_missing_key_in_a_team_says_how_to_put_it_there(team: Team, daemon: TeamDaemon) -> None:
    message = as_user(team.a, _open_missing, team.name)
    assert f"no entry 'a/never-put' in team {team.name}'s cache" in message
    assert f"team={team.name!r}" in message and f"`shmcache --team {team.name} put`" in message


def test_team_stats_say_what_the_daemon_cannot_scan(team: Team, daemon: TeamDaemon) -> None:
    """The team's daemon may not read members' /proc/PID/maps: its held_by_readers leaves
    their mappings out, and stats say so rather than a bare 0 B."""
    as_user(team.a, _put_ones, team.name, "a/held", 4 * KiB)

    def hold(answer: int, wait: int) -> None:
        array = shmcache.open_array("a/held", team=team.name)
        os.write(answer, f"{int(array.sum())}\n".encode())
        os.read(wait, 1)

    pid, answers, tell = forked_as(team.b, hold)
    try:
        assert os.read(answers, 64).strip() == str(4 * KiB).encode()
        code, out = as_user(team.a, _cli, "--team", team.name, "stats")
        assert code == 0, out
        found = re.search(r"not counted: what (\d+) members' processes map \(the daemon may not", out)
        assert found is not None and int(found[1]) >= 1, out  # bob's reader (and this stats command)
        unseen = as_user(team.a, _stats_unseen, team.name)
        assert isinstance(unseen, int) and unseen >= 1
    finally:
        os.close(tell)
        os.waitpid(pid, 0)
        os.close(answers)


def _stats_unseen(team: str) -> object:
    from shmcache.client import Client

    with Client(team=team, timeout=30) as client:
        return client.stats().held_by_readers_unseen
