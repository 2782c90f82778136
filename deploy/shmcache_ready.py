#!/usr/bin/env python3
"""Wait until this node's shmcache daemon answers and has loaded the datasets a job needs.

Used by deploy/slurm/train.sbatch (once per node), deploy/compose (the trainer's first
step) and deploy/kubernetes/train-job.yaml (an init container; the image has it as
``shmcache-ready``): ``python shmcache_ready.py --config preload.toml`` waits for ``GET /v1/health``, then
for the loads still queued or running, then checks that every ``[[datasets]]`` key of the
config (and every ``--key``) is in the cache. Exits 1 with one line naming the node and
what is missing; the socket is found as every client finds it (``$SHMCACHE_SOCKET``, else
``$SHMCACHE_ROOT/daemon.sock``).
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

from shmcache.client import Client

from shmcache import ShmCacheError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the service extra installs tomli
    import tomli as tomllib


def _keys(config: Path | None, extra: list[str]) -> list[str]:
    if config is None:
        return extra
    with open(config, "rb") as fp:
        datasets = tomllib.load(fp).get("datasets", [])
    return [table["key"] for table in datasets] + extra


def _wait_for_health(daemon: Client, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            daemon.health()
            return
        except ShmCacheError as exc:  # DaemonUnavailableError until it listens
            if time.monotonic() > deadline:
                host = socket.gethostname()
                raise SystemExit(f"{host}: no shmcache daemon after {timeout:.0f} s: {exc}") from None
            time.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, help="the daemon's TOML: wait for its [[datasets]]")
    parser.add_argument("--key", action="append", default=[], help="another key that must be cached")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the daemon")
    args = parser.parse_args(argv)
    host = socket.gethostname()
    with Client(timeout=10) as daemon:
        _wait_for_health(daemon, args.timeout)
        try:
            for job in daemon.jobs():
                if job.state in ("queued", "running"):
                    daemon.wait(job.id)  # raises the load's error
        except ShmCacheError as exc:
            raise SystemExit(f"{host}: a preload failed: {type(exc).__name__}: {exc}") from None
        missing = [key for key in _keys(args.config, args.key) if not daemon.list(key)]
        if missing:
            raise SystemExit(f"{host}: not in the cache: {', '.join(missing)} (see the daemon's log)")
        print(f"{host}: shmcache ready, {daemon.stats().entries} entries", flush=True)


if __name__ == "__main__":
    sys.exit(main())
