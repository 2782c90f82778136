"""Shared fixtures: every test gets its own cache root on the real tmpfs."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import shmcache

SHM = Path("/dev/shm")


@pytest.fixture
def root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh cache root on /dev/shm (the real tmpfs), also set as SHMCACHE_ROOT."""
    base = SHM if SHM.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    path = base / f"shmcache-test-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("SHMCACHE_ROOT", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def store(root: Path) -> shmcache.Store:
    return shmcache.Store(root)
