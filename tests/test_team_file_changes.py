"""What an edit of the teams file does at the team daemon's next start: the budget follows
the file, a line removed included; a budget the file did not set stays.

Real users and groups, a trusted teams file (``tests/team_helpers.py``); skipped where
users cannot be made. Each test starts and stops its own daemons of its own team.
"""

from __future__ import annotations

from team_helpers import Team, TeamDaemon, as_user, team_in_env

from shmcache._disk.layout import Layout
from shmcache._store.budget import read_budget, write_budget

MiB = 1 << 20


def _start_and_stop(team: Team) -> str:
    """One start of the team's daemon, served then stopped cleanly; its log."""
    daemon = TeamDaemon(team, team.service)
    try:
        daemon.wait_ready()
        log = daemon.log
    finally:
        assert daemon.stop() == 0
    return log


def test_a_budget_removed_from_the_teams_file_is_removed_at_the_next_start() -> None:
    with team_in_env(budget="64MiB") as team:
        _start_and_stop(team)
        record = read_budget(Layout(team.root))
        assert record is not None and record.max_bytes == 64 * MiB
        assert record.set_by == f"teams file [teams.{team.name}]"

        team.teams.write(team.toml(budget="32MiB"))  # changed: the new one, at the next start
        _start_and_stop(team)
        record = read_budget(Layout(team.root))
        assert record is not None and record.max_bytes == 32 * MiB

        team.teams.write(team.toml())  # the line removed: no budget, not the old one
        log = _start_and_stop(team)
        assert read_budget(Layout(team.root)) is None
        assert "no longer sets a budget" in log, log


def test_a_budget_the_teams_file_did_not_set_stays_when_the_file_sets_none() -> None:
    with team_in_env() as team:
        _start_and_stop(team)  # makes the root
        as_user(team.service, write_budget, Layout(team.root), 16 * MiB, "shmcache budget set")
        _start_and_stop(team)
        record = read_budget(Layout(team.root))
        assert record is not None and (record.max_bytes, record.set_by) == (16 * MiB, "shmcache budget set")


def test_doctor_warns_that_a_teams_daemon_is_down() -> None:
    """Reads need no daemon, but a member's every write does: a team root without its
    daemon is a warning naming the fix, not "no daemon (optional)"."""
    import json

    from cli_helpers import cli

    with team_in_env() as team:
        _start_and_stop(team)  # makes the root; the daemon is down now
        _, out, _ = cli("--team", team.name, "doctor", "--json")
        checks = {check["name"]: check for check in json.loads(out)["checks"]}
        daemon = checks["daemon"]
        assert daemon["status"] == "warn", daemon
        assert "put" in daemon["summary"] and f"shmcache-team@{team.name}" in daemon["fix"], daemon
