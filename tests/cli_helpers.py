"""Helpers for the CLI tests: the one CliRunner wrapper, the CLI as a subprocess, npy files,
a stale socket."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
from click.testing import Result
from service_helpers import clean_env
from typer.testing import CliRunner

from shmcache.cli import app

__all__ = ["CLI", "cli", "cli_process", "errors_only", "invoke", "save", "stale_socket"]

_runner = CliRunner()
CLI = [sys.executable, "-c", "from shmcache.cli import main; main()"]
"""The CLI as a subprocess, through its console entry point's function."""


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    """Run the CLI in this process (stdout and stderr apart; an exception that escapes
    the command, as with ``--debug``, is kept in ``result.exception``)."""
    return _runner.invoke(app, list(args), env=env)


def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run the CLI in this process: ``(exit code, stdout, stderr)``."""
    result = invoke(*args, env=env)
    return result.exit_code, result.stdout, result.stderr


def cli_process(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start the CLI as a subprocess (for signals), without inherited SHMCACHE_* settings."""
    return subprocess.Popen(
        [*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(env)
    )


def save(path: Path, array: np.ndarray) -> Path:
    np.save(path, array, allow_pickle=False)
    return path


def errors_only(stderr: str) -> list[str]:
    """stderr lines other than notices."""
    return [line for line in stderr.strip().splitlines() if line and not line.startswith("notice:")]


def stale_socket(path: Path) -> None:
    """A socket file nobody listens on (what a ``kill -9``ed daemon leaves)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()
