"""deploy/systemd/: the team daemon's unit passes ``systemd-analyze verify`` (where systemd
is installed; skipped otherwise) with the hardening the docs promise, and its sysusers.d,
tmpfiles.d and teams.toml examples agree with each other and with what ``serve --team``
makes (the default root, its owner, group and mode)."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from shmcache.service.team import TEAM_ROOT_MODE

from shmcache._team.config import default_team_root

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SYSTEMD = Path(__file__).resolve().parents[1] / "deploy" / "systemd"
UNIT = SYSTEMD / "shmcache-team@.service"
TEAM = "vision"


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False, empty_lines_in_values=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    parser.read(UNIT)
    return parser


def test_the_unit_verifies_cleanly(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    instance = tmp_path / f"shmcache-team@{TEAM}.service"
    instance.symlink_to(UNIT)
    done = subprocess.run([analyze, "verify", str(instance)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if "shmcache-team@" in line]
    assert done.returncode == 0 and not complaints, done.stdout + done.stderr


def test_the_unit_runs_the_team_daemon_as_its_account_hardened() -> None:
    service = _unit()["Service"]
    assert service["ExecStart"].endswith("shmcache serve --team %i")
    assert service["User"] == "shmcache-%i"
    assert service["UMask"] == "0027"
    assert service["Restart"] == "on-failure"
    assert service["NoNewPrivileges"] == "yes"
    assert service["ProtectSystem"] == "strict"
    assert service["PrivateTmp"] == "yes"
    assert service["RestrictAddressFamilies"] == "AF_UNIX"
    assert service["ReadWritePaths"] == "-" + str(default_team_root("%i"))
    assert "PrivateDevices" not in service  # a private /dev would have a /dev/shm of its own


def test_the_examples_agree_on_the_team() -> None:
    team = tomllib.loads((SYSTEMD / "teams.toml").read_text())["teams"][TEAM]
    sysusers = [
        line.split()
        for line in (SYSTEMD / "sysusers.d" / f"shmcache-team-{TEAM}.conf").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ["g", team["group"], "-"] in sysusers
    assert ["m", team["owner"], team["group"]] in sysusers
    assert any(fields[:3] == ["u", team["owner"], "-"] for fields in sysusers)
    assert team["owner"] == _unit()["Service"]["User"].replace("%i", TEAM)
    tmpfiles = [
        line.split()
        for line in (SYSTEMD / "tmpfiles.d" / f"shmcache-team-{TEAM}.conf").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert tmpfiles == [
        ["d", str(default_team_root(TEAM)), f"{TEAM_ROOT_MODE:o}", team["owner"], team["group"], "-"]
    ]


def test_the_example_teams_file_declares_only_known_fields() -> None:
    from shmcache._team import config

    teams = tomllib.loads((SYSTEMD / "teams.toml").read_text())["teams"]
    for table in teams.values():
        assert set(table) <= config._FIELDS
        assert {"group", "owner"} <= set(table)
