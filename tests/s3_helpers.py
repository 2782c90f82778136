"""A real S3-compatible server for the remote-source tests and benchmarks: moto's server mode
in a subprocess on 127.0.0.1 (so a test can kill it), its request log kept in a file (so a
test can count the GETs each object got), and s3fs/boto3 clients pointed at it."""

from __future__ import annotations

import io
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "KEY",
    "SECRET",
    "Cancelled",
    "MotoServer",
    "cancel_once_started",
    "moto_server",
    "npy_bytes",
    "put_object",
    "unique_bucket",
]

KEY = "testing"
SECRET = "testing"
_REQUEST = re.compile(
    r'"(?:\x1b\[[0-9;]*m)*(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP/1\.1'
)  # werkzeug colours some
_START_WAIT_S = 30.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MotoServer:
    """``python -m moto.server`` on a free loopback port; ``env`` adds to its environment
    (``INITIAL_NO_AUTH_ACTION_COUNT=0`` makes it check credentials)."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"moto-{self.port}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        deadline = time.monotonic() + _START_WAIT_S
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError(f"moto server did not start:\n{self.log_path.read_text()}") from None
                time.sleep(0.05)

    def options(self, **extra: Any) -> dict[str, Any]:
        """s3fs storage options for this server (a fresh filesystem instance: no shared cache)."""
        return {
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            "skip_instance_cache": True,
            **extra,
        }

    def boto(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=KEY,
            aws_secret_access_key=SECRET,
            region_name="us-east-1",
        )

    def requests(self, method: str, path_part: str) -> list[str]:
        """Logged requests of ``method`` whose path contains ``path_part``."""
        self._log.flush()
        found = []
        for line in self.log_path.read_text().splitlines():
            match = _REQUEST.search(line)
            if match and match.group(1) == method and path_part in match.group(2):
                found.append(match.group(2))
        return found

    def kill(self) -> None:
        """SIGKILL: the server dies mid-request, as a crashed endpoint would."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


@contextmanager
def moto_server(log_dir: Path, env: dict[str, str] | None = None) -> Iterator[MotoServer]:
    server = MotoServer(log_dir, env)
    try:
        yield server
    finally:
        server.stop()


def unique_bucket(server: MotoServer) -> str:
    """A new empty bucket (each test its own: they share the server)."""
    name = f"b-{uuid.uuid4().hex[:12]}"
    server.boto().create_bucket(Bucket=name)
    return name


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def put_object(s3: MotoServer, bucket: str, name: str, body: bytes) -> None:
    s3.boto().put_object(Bucket=bucket, Key=name, Body=body)


class Cancelled(Exception):
    """What :func:`cancel_once_started` raises."""


def cancel_once_started(done: int, _total: int) -> None:
    """A progress callback that cancels a load as the daemon's cancel does (it raises) once
    any byte has come."""
    if done:
        raise Cancelled("cancelled on request")
