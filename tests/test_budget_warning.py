"""A budget larger than the tmpfs never evicts (the file system fills first): accepted, but
said by the daemon at start, by ``shmcache stats`` and by ``shmcache doctor``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_helpers import invoke
from service_helpers import running_daemon

import shmcache


def _capacity(root: Path) -> int:
    shmcache.Store(root).prepare()
    st = os.statvfs(root)
    return st.f_blocks * st.f_frsize


def test_budget_above_the_file_system_is_named(root: Path) -> None:
    capacity = _capacity(root)
    warning = shmcache.Store(root, max_bytes=2 * capacity).stats().budget_warning
    assert warning is not None and "larger than the file system" in warning and "--max-bytes" in warning
    assert shmcache.Store(root, max_bytes=capacity // 2).stats().budget_warning is None
    assert shmcache.Store(root).stats().budget_warning is None


@pytest.mark.integration
def test_daemon_stats_and_doctor_warn_about_a_budget_above_the_tmpfs(root: Path) -> None:
    budget = 2 * _capacity(root)
    with running_daemon(root, "--max-bytes", str(budget)) as daemon:
        assert "WARNING" in daemon.log and "larger than the file system" in daemon.log

        text = invoke("stats", "--root", str(root))
        assert text.exit_code == 0 and "larger than the file system" in text.stderr
        report = json.loads(invoke("stats", "--root", str(root), "--json").stdout)
        assert report["daemon"] and report["budget"] == budget
        assert len(report["warnings"]) == 1 and "larger than the file system" in report["warnings"][0]

        doctor = json.loads(invoke("doctor", "--root", str(root), "--json").stdout)
        checks = {check["name"]: check for check in doctor["checks"]}
        assert checks["budget"]["status"] == "warn" and "--max-bytes" in checks["budget"]["fix"]


@pytest.mark.integration
def test_a_fitting_budget_gets_no_warning(root: Path) -> None:
    with running_daemon(root, "--max-bytes", str(_capacity(root) // 4)) as daemon:
        report = json.loads(invoke("stats", "--root", str(root), "--json").stdout)
        assert report["warnings"] == []
        doctor = json.loads(invoke("doctor", "--root", str(root), "--json").stdout)
        assert {check["name"]: check for check in doctor["checks"]}["budget"]["status"] == "ok"
        assert "larger than the file system" not in daemon.log
