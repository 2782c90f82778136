"""Helpers for the daemon tests: run a real ``shmcache serve`` and talk to it over its socket."""

from __future__ import annotations

import os
import re
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
from typing import Any

import httpx
import numpy as np

SHM = Path("/dev/shm")
_SHMCACHE = Path(sys.executable).with_name("shmcache")
_READY = re.compile(r"listening on (\S+)(?: and (http://\S+))?")
_NPY_HEADER_SIZE = 128


def fresh_root() -> Path:
    base = SHM if SHM.is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"shmcache-test-{uuid.uuid4().hex[:12]}"


@contextmanager
def temporary_root() -> Iterator[Path]:
    root = fresh_root()
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


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
    """A ``shmcache serve`` subprocess; its stderr is collected in ``log``."""

    def __init__(self, root: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.args = args
        self.log = ""
        self.tcp_url: str | None = None
        merged = {k: v for k, v in os.environ.items() if not k.startswith("SHMCACHE_")}
        merged.update(env or {})
        self.process = subprocess.Popen(
            serve_command(root, *args),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=merged,
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
        return self.root / "daemon.sock"

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
def running_daemon(root: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Daemon]:
    daemon = Daemon(root, *args, env=env).wait_ready()
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
