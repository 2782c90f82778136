"""Helpers for the daemon tests: scratch directories on the tmpfs, a real ``shmcache serve``
subprocess, talking to it over its socket, big sparse sources.

The one place that picks the scratch base (``/dev/shm``, else ``$TMPDIR``): the fixtures of
``conftest.py`` and every helper build on :func:`fresh_root` / :func:`scratch_dir`.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from shmcache._disk.layout import ENV_PREFIX, SHM_DIR, SOCKET_NAME

if TYPE_CHECKING:  # httpx and fastapi come with the service extra: imported where a test talks HTTP
    import httpx
    from fastapi.testclient import TestClient

__all__ = [
    "LOAD_RATE",
    "Daemon",
    "app_client",
    "clean_env",
    "disk_usage",
    "fresh_root",
    "isolate_environment",
    "load",
    "running_daemon",
    "sandbox_root",
    "scratch_base",
    "scratch_dir",
    "serve_command",
    "temporary_root",
    "unique",
    "wait_for",
    "wait_job",
    "write_big_npy",
]

LOAD_RATE = 64 << 20
"""Bytes/s per load of the shared daemon: a 1 GiB sparse source takes ~16 s, so it can be caught running."""

_SHMCACHE = Path(sys.executable).with_name("shmcache")
_READY = re.compile(r"listening on (\S+)(?: and (http://\S+))?")
_NPY_HEADER_SIZE = 128
_MOUNT_WAIT_S = 60.0


def scratch_base() -> Path:
    """Where test roots and sources go: the real tmpfs when there is one (fast, like the cache)."""
    shm = Path(SHM_DIR)
    return shm if shm.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


_SANDBOX: list[Path] = []  # this test process's stand-in for the default root (set once)


def sandbox_root() -> Path:
    """The root that this test process (and every subprocess it starts through
    :func:`clean_env`) uses where nothing names one: never the user's own default root."""
    if not _SANDBOX:
        _SANDBOX.append(scratch_base() / f"shmcache-test-sandbox-{uuid.uuid4().hex[:12]}")
    return _SANDBOX[0]


def isolate_environment() -> Path:
    """Make this test process forget the user's cache: drop every ``SHMCACHE_*`` variable
    (a socket, a token, a config, a team of the user's) and point ``SHMCACHE_ROOT`` at
    :func:`sandbox_root`. Called once per test process, before any test runs, so neither a
    test nor a subprocess it starts can reach the user's root or daemon by default."""
    for name in [name for name in os.environ if name.startswith(ENV_PREFIX)]:
        del os.environ[name]
    os.environ[f"{ENV_PREFIX}ROOT"] = str(sandbox_root())
    return sandbox_root()


def fresh_root() -> Path:
    """A new, not yet created, path for a cache root."""
    return scratch_base() / f"shmcache-test-{uuid.uuid4().hex[:12]}"


@contextmanager
def temporary_root() -> Iterator[Path]:
    """A fresh root path (not created), removed afterwards with whatever was put there."""
    root = fresh_root()
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def scratch_dir(kind: str = "data") -> Iterator[Path]:
    """A fresh, created directory on the scratch base (e.g. for source files), removed afterwards."""
    path = scratch_base() / f"shmcache-test-{kind}-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)



@contextmanager
def mounted_tmpfs(mountpoint: Path, options: str) -> Iterator[Path]:
    """A tmpfs of its own at ``mountpoint`` (created here) with mount ``options`` (``size=8m``,
    ``nr_inodes=64``...), for tests of a full or small file system; skips where it cannot be
    mounted (not root, no ``mount``); unmounted afterwards whatever happens."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mountpoint.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mountpoint)],
            capture_output=True,
            text=True,
            timeout=_MOUNT_WAIT_S,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        umount = ["umount", str(mountpoint)]
        if subprocess.run(umount, capture_output=True, timeout=_MOUNT_WAIT_S).returncode:
            subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, timeout=_MOUNT_WAIT_S)

def unique(name: str) -> str:
    """``name`` with a random suffix: tests sharing a daemon or a data directory do not collide."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


def clean_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without any ``SHMCACHE_*`` setting but the sandbox as the
    default root (a subprocess that is given no root never falls back to the user's), plus ``env``."""
    merged = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    merged[f"{ENV_PREFIX}ROOT"] = str(sandbox_root())
    merged.update(env or {})
    return merged


def serve_command(root: Path, *args: str) -> list[str]:
    if _SHMCACHE.exists():
        return [str(_SHMCACHE), "serve", "--root", str(root), *args]
    return [
        sys.executable,
        "-c",
        "from shmcache.cli import main; main()",
        "serve",
        "--root",
        str(root),
        *args,
    ]


class Daemon:
    """A ``shmcache serve`` subprocess without inherited ``SHMCACHE_*`` settings (``env`` adds
    some); its stderr is collected in ``log``, its TCP address (if any) in ``tcp_url``.
    ``nofile`` starts it under that (soft, hard) descriptor limit."""

    def __init__(
        self,
        root: Path,
        *args: str,
        env: dict[str, str] | None = None,
        nofile: tuple[int, int] | None = None,
    ) -> None:
        self.root = root
        self.args = args
        self.log = ""
        self.tcp_url: str | None = None
        self.process = subprocess.Popen(
            serve_command(root, *args),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(env),
            preexec_fn=None if nofile is None else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, nofile),
        )
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()

    def _read_log(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log += line
            match = _READY.search(line)
            if match:
                self.tcp_url = match.group(2)
                self._ready.set()
        self._ready.set()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def socket_path(self) -> Path:
        return self.root / SOCKET_NAME

    def wait_ready(self, timeout: float = 30.0) -> Daemon:
        if not self._ready.wait(timeout) or self.process.poll() is not None:
            self.process.poll()
            raise AssertionError(f"daemon did not start (exit {self.process.returncode}):\n{self.log}")
        return self

    def wait_exit(self, timeout: float = 30.0) -> int:
        code = self.process.wait(timeout)
        self._reader.join(5)
        return code

    def client(self, timeout: float = 30.0) -> httpx.Client:
        """A raw HTTP client on the daemon's Unix socket."""
        import httpx

        return httpx.Client(
            transport=httpx.HTTPTransport(uds=str(self.socket_path)),
            base_url="http://shmcache",
            timeout=timeout,
        )

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signum)

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                return self.wait_exit(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.wait_exit(timeout)


@contextmanager
def running_daemon(
    root: Path,
    *args: str,
    env: dict[str, str] | None = None,
    nofile: tuple[int, int] | None = None,
    ready_s: float = 30.0,
) -> Iterator[Daemon]:
    daemon = Daemon(root, *args, env=env, nofile=nofile).wait_ready(ready_s)
    try:
        yield daemon
    finally:
        daemon.stop()


def wait_job(
    client: httpx.Client,
    job_id: str,
    timeout: float = 30.0,
    states: tuple[str, ...] = ("done", "failed", "cancelled"),
) -> dict[str, Any]:
    """Poll a job until it reaches one of ``states``."""
    deadline = time.monotonic() + timeout
    while True:
        job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").raise_for_status().json()
        if job["state"] in states:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job still {job['state']} after {timeout} s: {job}")
        time.sleep(0.01)


def wait_for(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def load(client: httpx.Client, key: str, source: Path | str, **options: Any) -> dict[str, Any]:
    """PUT a load and wait for its job to finish; returns the job."""
    response = client.put(f"/v1/entries/{key}", json={"source": str(source), **options})
    assert response.status_code == 202, response.text
    return wait_job(client, response.json()["id"])


def write_big_npy(path: Path, nbytes: int) -> Path:
    """A valid uint8 ``.npy`` of ``nbytes`` data bytes, sparse (instant to create)."""
    header = _npy_header(np.dtype(np.uint8), (nbytes,))
    with open(path, "wb") as fp:
        fp.write(header)
        fp.truncate(len(header) + nbytes)
    return path


def _npy_header(dtype: np.dtype[Any], shape: tuple[int, ...]) -> bytes:
    text = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape})
    body = text.encode("latin1")
    padding = _NPY_HEADER_SIZE - 10 - len(body) - 1
    return (
        b"\x93NUMPY\x01\x00" + (_NPY_HEADER_SIZE - 10).to_bytes(2, "little") + body + b" " * padding + b"\n"
    )


def disk_usage(path: Path) -> int:
    """Bytes actually allocated under ``path`` (sparse-aware)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


@contextmanager
def app_client(
    root: Path,
    *,
    env: dict[str, str] | None = None,
    config_file: Path | None = None,
    **flags: Any,
) -> Iterator[TestClient]:
    """The daemon's app in this process (``create_app(load_settings(...))``) behind a
    ``TestClient``; the lifespan (start-up cleanup, preloads; cancelling loads on exit) runs.

    ``flags`` are settings as ``shmcache serve`` flags give them; ``env`` replaces the
    environment (default: none), so the caller's ``SHMCACHE_*`` variables do not leak in.
    """
    from fastapi.testclient import TestClient
    from shmcache.service import create_app, load_settings

    settings = load_settings({"root": root, **flags}, env=env or {}, config_file=config_file)
    with TestClient(create_app(settings), base_url="http://localhost") as client:  # a loopback Host
        yield client
