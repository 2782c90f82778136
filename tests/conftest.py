"""Shared fixtures: every test gets its own cache root on the real tmpfs; the daemon tests of a
module share one real ``shmcache serve`` and one directory of sources.

Before any test runs, every ``SHMCACHE_*`` variable of the caller is dropped and
``$SHMCACHE_ROOT`` points at a sandbox root of this test process (``isolate_environment``):
a test, a CLI or a script started without a root never reaches the user's default root or
daemon (``tests/test_isolation.py`` runs tests beside a daemon on the default root).

- ``root``: a fresh root path (not created), also ``$SHMCACHE_ROOT``; removed afterwards.
- ``store``: a :class:`shmcache.Store` on ``root``.
- ``data_dir`` (module): a fresh, created directory for source files on the tmpfs; removed afterwards.
- ``daemon_args`` / ``daemon_env`` (module): the ``shmcache serve`` flags and extra environment of
  ``daemon``; a test module overrides them to run its daemon differently. Defaults:
  ``--allow-source <data_dir> --max-load-rate 64MiB``, no extra environment.
- ``daemon`` (module): a :class:`service_helpers.Daemon` serving a fresh root (``.root``) on its
  Unix socket, started with ``daemon_args`` without the caller's ``SHMCACHE_*`` variables; stopped
  (SIGTERM) and its root removed afterwards. Put sources in ``data_dir``; name keys with
  ``service_helpers.unique`` since the daemon is shared by the module's tests.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from service_helpers import (
    LOAD_RATE,
    Daemon,
    fresh_root,
    isolate_environment,
    running_daemon,
    sandbox_root,
    scratch_dir,
    temporary_root,
)

import shmcache
from shmcache._disk.layout import ENV_ROOT

if TYPE_CHECKING:
    from s3_helpers import MotoServer


def pytest_configure(config: pytest.Config) -> None:
    isolate_environment()


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(sandbox_root(), ignore_errors=True)


@pytest.fixture
def root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh cache root on /dev/shm (the real tmpfs), also set as SHMCACHE_ROOT."""
    path = fresh_root()
    monkeypatch.setenv(ENV_ROOT, str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def store(root: Path) -> shmcache.Store:
    return shmcache.Store(root)


@pytest.fixture(scope="module")
def data_dir() -> Iterator[Path]:
    """A directory of sources on the tmpfs (fast), shared by the module's tests."""
    with scratch_dir("data") as path:
        yield path


@pytest.fixture(scope="module")
def daemon_args(data_dir: Path) -> tuple[str, ...]:
    """Flags of the module's ``daemon``: sources from ``data_dir`` only, loads slow enough to catch."""
    return ("--allow-source", str(data_dir), "--max-load-rate", str(LOAD_RATE))


@pytest.fixture(scope="module")
def daemon_env() -> dict[str, str]:
    """Environment variables the module's ``daemon`` gets on top of the caller's (minus ``SHMCACHE_*``)."""
    return {}


@pytest.fixture(scope="module")
def daemon(daemon_args: tuple[str, ...], daemon_env: dict[str, str]) -> Iterator[Daemon]:
    """A real ``shmcache serve`` on a fresh root's Unix socket, shared by the module's tests."""
    with temporary_root() as path, running_daemon(path, *daemon_args, env=daemon_env) as running:
        yield running


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoServer]:
    """A local S3 server (moto) for the module's remote tests (which skip without moto)."""
    from s3_helpers import moto_server  # deferred: only the remote tests have moto

    with scratch_dir("moto") as logs, moto_server(logs) as server:
        yield server


@pytest.fixture
def bucket(s3: MotoServer) -> str:
    """A new, empty bucket on ``s3`` for each test."""
    from s3_helpers import unique_bucket

    return unique_bucket(s3)
