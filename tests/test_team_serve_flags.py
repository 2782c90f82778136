"""``shmcache serve`` takes the team as every other command does: ``shmcache --team NAME
serve`` (the global flag) and ``$SHMCACHE_TEAM`` (without ``--root``) serve the team's root
as its service account; two different teams are refused.

Real users and groups, a trusted teams file (``tests/team_helpers.py``); skipped where
users cannot be made. A module of its own: each test starts its own daemon of the team.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from cli_helpers import cli
from team_helpers import Team, TeamDaemon, team_in_env

from shmcache import CacheRootError, Store
from shmcache._disk.layout import ENV_ROOT, ENV_TEAM


@pytest.fixture(scope="module")
def team() -> Iterator[Team]:
    with team_in_env(budget="64MiB") as made:
        yield made


def _serves_the_team_root(team: Team, daemon: TeamDaemon) -> str:
    """The daemon's log, once it served the team's root (and stopped cleanly)."""
    try:
        daemon.wait_ready()
        log = daemon.log
        assert str(team.root) in log, log
        assert Store(team=team.name).stats().root == str(team.root)
        assert (team.root / "daemon.sock").exists()
    finally:
        assert daemon.stop() == 0
    return log


def test_the_global_team_flag_serves_the_teams_root(team: Team) -> None:
    _serves_the_team_root(team, TeamDaemon(team, team.service, argv=["--team", team.name, "serve"]))


def test_the_exported_team_serves_the_teams_root_with_a_notice(team: Team) -> None:
    daemon = TeamDaemon(team, team.service, argv=["serve"], env={ENV_TEAM: team.name})
    log = _serves_the_team_root(team, daemon)
    assert f"notice: serving team {team.name}'s root (${ENV_TEAM})" in log, log


def test_two_teams_or_the_team_and_root_variables_are_refused(team: Team) -> None:
    code, _, err = cli("--team", team.name, "serve", "--team", "other")
    assert code == 2 and "two teams" in err, err
    code, _, err = cli("serve", env={ENV_TEAM: team.name, ENV_ROOT: "/dev/shm/elsewhere"})
    assert code == 2 and f"both {ENV_ROOT} and {ENV_TEAM}" in err, err


def test_writes_to_a_team_root_without_its_daemon_say_it_is_not_running(team: Team) -> None:
    """(No daemon runs in these tests between their own.) Not the store's refusal of a put."""
    for args in (["evict", "k"], ["cleanup"], ["budget", "set", "1GiB"], ["budget", "clear"]):
        code, _, err = cli("--team", team.name, *args)
        assert code == 1 and f"team {team.name}'s daemon is not running" in err, (args, err)
        assert f"shmcache serve --team {team.name}" in err and team.service.name in err, err
        assert "put" not in err, err
    with pytest.raises(CacheRootError, match=rf"`shmcache --team {team.name} put PATH --key KEY`"):
        Store(team=team.name).put_array("k", np.zeros(3))
