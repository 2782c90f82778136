"""Helpers for the CLI and client tests: a data directory, running the CLI, npy files."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from shmcache.cli import app

_runner = CliRunner()
CLI = [sys.executable, "-c", "from shmcache.cli import main; main()"]


@contextmanager
def data_directory() -> Iterator[Path]:
    """A fresh directory of sources on the tmpfs (fast), removed afterwards."""
    base = Path("/dev/shm" if Path("/dev/shm").is_dir() else os.environ.get("TMPDIR", "/tmp"))
    path = base / f"shmcache-test-data-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run the CLI in this process: ``(exit code, stdout, stderr)``."""
    result = _runner.invoke(app, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


def cli_process(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start the CLI as a subprocess (for signals), without inherited SHMCACHE_* settings."""
    merged = {k: v for k, v in os.environ.items() if not k.startswith("SHMCACHE_")}
    merged.update(env or {})
    return subprocess.Popen(
        [*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=merged
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
