"""Commands for scripts and tools: ``shmcache root`` (the root other commands would use, so
curl finds the daemon's socket) and ``shmcache api-docs`` (the OpenAPI schema without a daemon)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import cli
from service_helpers import clean_env

from shmcache._disk.layout import ENV_ROOT, SOCKET_NAME, Layout, default_root


def test_root_prints_the_flag_else_the_environment_else_the_default(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, _ = cli("root")
    assert code == 0 and out == f"{root}\n"
    assert Path(out.strip()) / SOCKET_NAME == Layout(root).socket  # what the README's curl uses
    monkeypatch.chdir(tmp_path)
    code, out, _ = cli("root", "--root", "relative")
    assert code == 0 and out == f"{tmp_path / 'relative'}\n"
    monkeypatch.delenv(ENV_ROOT)
    code, out, _ = cli("root")
    assert code == 0 and out == f"{default_root()}\n"
    assert not root.exists()  # printing the root creates nothing


def test_api_docs_prints_the_schema_the_daemon_serves(root: Path, tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    from service_helpers import app_client

    code, out, err = cli("api-docs")
    assert code == 0, err
    schema = json.loads(out)
    with app_client(tmp_path / "served") as http:
        assert schema == http.get("/openapi.json").json()
    assert "/v1/entries/{key}" in schema["paths"] and schema["info"]["title"] == "shmcache daemon"
    assert not root.exists()  # built on a throwaway root, not on $SHMCACHE_ROOT

    target = tmp_path / "openapi.json"
    code, out, err = cli("api-docs", "--out", str(target))
    assert code == 0 and out == "" and str(target) in err
    assert json.loads(target.read_text()) == schema

    code, _, err = cli("api-docs", "--out", str(tmp_path / "no" / "such" / "dir.json"))
    assert code == 1 and err.startswith("error: ")


def test_api_docs_without_the_service_extra_says_what_to_install() -> None:
    hide = "import sys; sys.modules['fastapi'] = None; from shmcache.cli import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", hide, "api-docs"], capture_output=True, text=True, env=clean_env(), check=False
    )
    assert done.returncode == 1 and done.stdout == ""
    assert "api-docs needs the service extra (fastapi is missing): pip install 'shmcache[service]'" in (
        done.stderr
    )
