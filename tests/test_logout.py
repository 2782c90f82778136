"""Where the cache will not last (issue 18 item 14): systemd-logind's RemoveIPC deletes a
regular user's /dev/shm files at logout. Each machine's configuration is built as real files
under a temporary base directory, read the way logind reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import cli

from shmcache._diagnose.logind import SystemPaths, removeipc_risk

UID = 60_123  # a regular uid with no passwd entry: named by its number


@pytest.fixture
def machine(tmp_path: Path) -> SystemPaths:
    """A systemd machine with no logind configuration at all (RemoveIPC's default: yes)."""
    for directory in ("dev/shm", "run/systemd/system", "etc/systemd", "var/lib/systemd/linger"):
        (tmp_path / directory).mkdir(parents=True)
    return SystemPaths(tmp_path)


def _write(machine: SystemPaths, path: str, text: str) -> None:
    target = machine.at(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def _root(machine: SystemPaths) -> Path:
    return machine.at("/dev/shm") / f"shmcache-{UID}"


def test_default_removeipc_deletes_a_regular_users_cache(machine: SystemPaths) -> None:
    risk = removeipc_risk(_root(machine), UID, machine)
    assert risk is not None and risk.source == "systemd's default" and risk.user == str(UID)
    assert "RemoveIPC=yes" in risk.summary and "/dev/shm" in risk.summary
    assert f"loginctl enable-linger {UID}" in risk.fix and "RemoveIPC=no" in risk.fix


def test_no_risk_where_logind_spares_the_files(machine: SystemPaths, tmp_path: Path) -> None:
    assert removeipc_risk(tmp_path / "elsewhere" / "root", UID, machine) is None  # not /dev/shm
    assert removeipc_risk(_root(machine), 500, machine) is None  # a system user
    _write(machine, "/etc/login.defs", "# comment\nSYS_UID_MAX\t60999\n")
    assert removeipc_risk(_root(machine), UID, machine) is None  # system by this machine's rule
    machine.at("/etc/login.defs").unlink()
    _write(machine, f"/var/lib/systemd/linger/{UID}", "")
    assert removeipc_risk(_root(machine), UID, machine) is None  # lingering
    machine.at(f"/var/lib/systemd/linger/{UID}").unlink()
    machine.at("/run/systemd/system").rmdir()
    assert removeipc_risk(_root(machine), UID, machine) is None  # no systemd: no logind


def test_logind_conf_and_drop_ins_are_read_in_order(machine: SystemPaths) -> None:
    _write(machine, "/etc/systemd/logind.conf", "[Login]\n#RemoveIPC=yes\nRemoveIPC=no\n")
    assert removeipc_risk(_root(machine), UID, machine) is None
    _write(machine, "/etc/systemd/logind.conf", "[Other]\nRemoveIPC=no\n")  # another section
    assert removeipc_risk(_root(machine), UID, machine) is not None
    _write(machine, "/etc/systemd/logind.conf", "[Login]\nRemoveIPC=no\n")
    _write(machine, "/usr/lib/systemd/logind.conf.d/20-vendor.conf", "[Login]\nRemoveIPC=yes\n")
    risk = removeipc_risk(_root(machine), UID, machine)
    assert risk is not None and risk.source == "/usr/lib/systemd/logind.conf.d/20-vendor.conf"
    _write(machine, "/etc/systemd/logind.conf.d/20-vendor.conf", "[Login]\nRemoveIPC=off\n")  # hides it
    assert removeipc_risk(_root(machine), UID, machine) is None
    _write(machine, "/run/systemd/logind.conf.d/90-late.conf", "[Login]\nRemoveIPC=true\n")
    risk = removeipc_risk(_root(machine), UID, machine)
    assert risk is not None and risk.source == "/run/systemd/logind.conf.d/90-late.conf"


def test_doctor_reports_the_logout_check(root: Path) -> None:
    _, out, _ = cli("doctor", "--json", "--root", str(root))
    checks = {check["name"]: check for check in json.loads(out)["checks"]}
    assert checks["logout"]["status"] in ("ok", "warn")
    expected = removeipc_risk(root)
    assert (checks["logout"]["status"] == "warn") == (expected is not None)
