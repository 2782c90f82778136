"""Control-API benchmark: concurrent clients doing list/stats against a real ``shmcache serve``.

Starts a daemon on a fresh root on /dev/shm with ``--entries`` entries, opens ``--clients``
keep-alive connections to its Unix socket and sends ``--ops`` requests in all, alternating
``GET /v1/entries?prefix=...`` and ``GET /v1/stats``. Each client paces itself to
``--rate`` requests per second in total (0: as fast as the daemon answers, i.e. a
saturation test where latency is clients / throughput by Little's law). Prints latency
percentiles and the daemon's RSS before and after as a markdown table with the targets
of DESIGN.md (p99 < 10 ms; RSS flat: growth < 5 %).

    python scripts/bench_api.py            # 10,000 operations
    python scripts/bench_api.py --quick    # 500 operations (CI)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

import shmcache

P99_TARGET_MS = 10.0
RSS_GROWTH_TARGET = 0.05


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Connection:
    """A minimal keep-alive HTTP/1.1 client over a Unix socket (cheap, so the client's own
    CPU does not dominate on a small machine)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, path: Path) -> Connection:
        reader, writer = await asyncio.open_unix_connection(str(path))
        return cls(reader, writer)

    async def get(self, target: str) -> int:
        self.writer.write(f"GET {target} HTTP/1.1\r\nHost: shmcache\r\n\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await self.reader.readexactly(length)
        return status

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def run_clients(
    socket_path: Path, ops: int, clients: int, rate: float, prefixes: list[str]
) -> list[float]:
    latencies: list[float] = []
    per_client = [ops // clients + (1 if i < ops % clients else 0) for i in range(clients)]
    interval = clients / rate if rate > 0 else 0.0
    start_all = time.perf_counter()

    async def client(index: int, count: int) -> None:
        connection = await Connection.open(socket_path)
        try:
            next_at = start_all + (index / clients) * interval
            for i in range(count):
                if interval:
                    delay = next_at - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    next_at += interval
                target = (
                    f"/v1/entries?prefix={prefixes[(index + i) % len(prefixes)]}" if i % 2 else "/v1/stats"
                )
                start = time.perf_counter()
                status = await connection.get(target)
                latencies.append(time.perf_counter() - start)
                if status != 200:
                    raise RuntimeError(f"GET {target} answered {status}")
        finally:
            await connection.close()

    await asyncio.gather(*(client(i, n) for i, n in enumerate(per_client)))
    return latencies


def start_daemon(root: Path) -> subprocess.Popen[bytes]:
    command = [
        str(Path(sys.executable).with_name("shmcache")),
        "serve",
        "--root",
        str(root),
        "--log-level",
        "warning",
    ]
    if not Path(command[0]).exists():
        command[:1] = [sys.executable, "-c", "from shmcache.cli import main; main()"]
    process = subprocess.Popen(command)
    deadline = time.monotonic() + 30
    while not (root / "daemon.sock").exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the daemon did not start")
        time.sleep(0.05)
    return process


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="500 operations (for CI)")
    parser.add_argument("--ops", type=int, default=10_000, help="operations in all (default 10,000)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    parser.add_argument("--entries", type=int, default=200, help="entries in the cache (default 200)")
    parser.add_argument(
        "--rate",
        type=float,
        default=1000.0,
        help="offered load in requests/s, all clients together (default 1000; 0 = saturate)",
    )
    args = parser.parse_args()
    ops = 500 if args.quick else args.ops

    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    root = base / f"shmcache-bench-api-{uuid.uuid4().hex[:12]}"
    store = shmcache.Store(root)
    prefixes = [f"ds{i}" for i in range(10)]
    for i in range(args.entries):
        store.put_array(f"{prefixes[i % len(prefixes)]}/item{i}", np.arange(64, dtype=np.float32))
    process = start_daemon(root)
    try:
        socket_path = root / "daemon.sock"
        asyncio.run(run_clients(socket_path, 2000, args.clients, 0, prefixes))  # warm-up
        rss_before = rss_bytes(process.pid)
        started = time.perf_counter()
        latencies = asyncio.run(run_clients(socket_path, ops, args.clients, args.rate, prefixes))
        elapsed = time.perf_counter() - started
        rss_after = rss_bytes(process.pid)
        saturated = asyncio.run(run_clients(socket_path, min(ops, 2000), args.clients, 0, prefixes))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        shutil.rmtree(root, ignore_errors=True)

    p50, p99 = percentile(latencies, 50) * 1e3, percentile(latencies, 99) * 1e3
    growth = (rss_after - rss_before) / rss_before
    sat_p50, sat_p99 = percentile(saturated, 50) * 1e3, percentile(saturated, 99) * 1e3

    def mark(ok: bool) -> str:
        return "✓" if ok else "✗"

    offered = f"{args.rate:g} req/s offered" if args.rate > 0 else "saturating"
    print(
        f"\n{ops} operations (list/stats alternating), {args.clients} clients over the Unix socket, "
        f"{args.entries} entries, {offered}; achieved {len(latencies) / elapsed:.0f} req/s, "
        f"{os.cpu_count()} CPUs\n"
    )
    print("| measure | value | target |")
    print("|---|---:|---|")
    print(f"| latency p50 | {p50:.2f} ms | |")
    print(f"| latency p99 | {p99:.2f} ms | < {P99_TARGET_MS:g} ms {mark(p99 < P99_TARGET_MS)} |")
    print(f"| mean | {statistics.fmean(latencies) * 1e3:.2f} ms | |")
    print(f"| daemon RSS before | {rss_before / 2**20:.1f} MiB | |")
    print(
        f"| daemon RSS after | {rss_after / 2**20:.1f} MiB | growth < {RSS_GROWTH_TARGET:.0%} "
        f"{mark(growth < RSS_GROWTH_TARGET)} ({growth:+.1%}) |"
    )
    print(
        f"| saturated ({args.clients} clients back to back): throughput | "
        f"{len(saturated) / max(sum(saturated) / args.clients, 1e-9):.0f} req/s | |"
    )
    print(f"| saturated: p50 / p99 | {sat_p50:.1f} / {sat_p99:.1f} ms | (= clients / throughput) |")


if __name__ == "__main__":
    main()
