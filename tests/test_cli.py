"""The ``shmcache`` command against a real temporary root (in-process, no daemon yet)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import shmcache
from shmcache.cli import app

runner = CliRunner()


def _run(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_put_ls_info_stats_evict_round_trip(root: Path, tmp_path: Path) -> None:
    data = np.arange(12, dtype=np.int32).reshape(3, 4)
    np.save(tmp_path / "a.npy", data)
    code, out, _ = _run("put", str(tmp_path / "a.npy"), "--key", "feats/a", "--root", str(root))
    assert code == 0 and out.split() == ["feats/a"]
    np.testing.assert_array_equal(shmcache.open_array("feats/a", root=root), data)

    code, out, _ = _run("ls", "--json", "--root", str(root))
    listed = json.loads(out)
    assert code == 0 and [e["key"] for e in listed] == ["feats/a"]
    assert listed[0]["shape"] == [3, 4] and listed[0]["dtype"] == "int32"

    code, out, _ = _run("ls", "--root", str(root))
    assert code == 0 and "feats/a" in out and "3x4" in out

    code, out, _ = _run("info", "feats/a", "--root", str(root))
    assert code == 0 and json.loads(out)["source"] == str(tmp_path / "a.npy")

    code, out, _ = _run("stats", "--json", "--root", str(root))
    assert code == 0 and json.loads(out)["entries"] == 1

    code, out, _ = _run("evict", "feats/a", "--root", str(root))
    assert code == 0 and "evicted feats/a" in out
    assert shmcache.Store(root).list() == []


def test_root_comes_from_the_environment(root: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "b.npy", np.ones(3))
    code, _, _ = _run("put", str(tmp_path / "b.npy"), "--key", "b")
    assert code == 0
    assert [e.key for e in shmcache.Store(root).list()] == ["b"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["put", "/does/not/exist", "--key", "x"], "does not exist"),
        (["put", "{src}", "--key", "bad key"], "invalid key"),
        (["evict", "missing"], "no entry 'missing'"),
        (["info", "missing"], "no entry 'missing'"),
    ],
)
def test_failures_exit_1_with_a_one_line_message(
    root: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    np.save(tmp_path / "src.npy", np.ones(2))
    argv = [a.replace("{src}", str(tmp_path / "src.npy")) for a in args]
    code, out, err = _run(*argv)
    assert code == 1
    assert message in err and "Traceback" not in err + out
    assert len(err.strip().splitlines()) == 1


def test_existing_key_needs_overwrite(root: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "c.npy", np.ones(2))
    assert _run("put", str(tmp_path / "c.npy"), "--key", "c")[0] == 0
    code, _, err = _run("put", str(tmp_path / "c.npy"), "--key", "c")
    assert code == 1 and "already exists" in err
    assert _run("put", str(tmp_path / "c.npy"), "--key", "c", "--overwrite")[0] == 0


def test_usage_errors_exit_2(root: Path) -> None:
    assert _run("ls", "--no-such-option")[0] == 2
    assert _run("put")[0] == 2


def test_cleanup_reports_freed_bytes(root: Path) -> None:
    code, out, _ = _run("cleanup", "--root", str(root))
    assert code == 0 and out.startswith("freed ")


def test_demo_runs_end_to_end_in_a_subprocess(root: Path) -> None:
    cli = [sys.executable, "-c", "from shmcache.cli import main; main()"]
    done = subprocess.run(
        [*cli, "demo", "--rows", "1000"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "ok: workers saw the same data" in done.stdout
    assert shmcache.Store(root).info("demo/features").shape == (1000, 64)


def test_help_lists_every_command() -> None:
    code, out, _ = _run("--help")
    assert code == 0
    for command in ("put", "ls", "info", "evict", "cleanup", "stats", "verify", "serve", "demo"):
        assert command in out
