"""Control-API soak: 64 concurrent clients mixing list, info, small loads and evictions
against a real ``shmcache serve`` for a bounded time.

Starts a daemon on a fresh root on /dev/shm with ``--entries`` entries, warms it up with
the mixed load (``--warmup``: thread pools, caches, the job history, allocator arenas
reach their steady size), then runs two phases over keep-alive connections to its Unix
socket (``_benchlib.drive``, the load generator ``bench_api.py`` uses), each at the same
offered ``--rate`` (default 128 req/s: 2 per client):

- **reads**, the baseline: ``GET /v1/entries?prefix=...`` and ``GET /v1/entries/{key}``
  (list and info, 83:17);
- **mixed**, the soak: list 50%, info 10%, ``PUT /v1/entries/{key}`` of a small ``.npy``
  (``--put-kib``) 20%, ``DELETE /v1/entries/{key}`` of a key the client loaded 20%.

It reports latency percentiles per kind and overall (as the clients see them, and inside
the daemon from its ``/metrics`` histogram), errors (5xx, no answer; a 404 of an evict that
raced its load is counted apart and retried), the CPU the daemon and the generator used,
and the daemon's RSS, threads and open descriptors (fresh, warmed up, during and after the
mixed phase), with the targets: p99 < 50 ms at 64 clients, no errors, RSS flat (growth
<= 5% over the mixed phase). ``--json`` writes it all for ``bench_all.py``.

    python scripts/soak_api.py              # 30 s warm-up, 30 s reads, 60 s mixed
    python scripts/soak_api.py --quick      # 1 s + 1 s + 2 s (CI)
    python scripts/soak_api.py --rate 256   # where the knee is on this machine
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _benchlib import (
    Connection,
    HttpRequest,
    LoadRun,
    MiB,
    Target,
    drive,
    environment,
    fmt_seconds,
    markdown_table,
    print_targets,
    process_counts,
    scratch_dir,
    serve,
    write_report,
)
from shmcache.client import Client

import shmcache
from shmcache.errors import KeyNotFoundError

P99_TARGET_S = 0.050
RSS_GROWTH_TARGET = 0.05
MIX = {"list": 50, "info": 10, "put": 20, "evict": 20}
READS = {"list": 83, "info": 17}
_BUCKET = re.compile(r"shmcache_request_duration_seconds_bucket\{(?P<labels>.*)\} (?P<count>\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


class Mix:
    """The requests of each client: kinds drawn by weight from a seeded generator. A client
    evicts only keys it loaded, the oldest first and once their load has had ``settle``
    seconds to finish (it loads instead when it has none), and evicts instead of loading
    when it holds ``HOLD`` keys; a key whose load had not finished yet (404) is evicted
    again later. So the cache keeps its size, and every eviction has something to remove."""

    HOLD = 4

    def __init__(
        self,
        weights: dict[str, int],
        prefixes: list[str],
        keys: list[str],
        source: Path,
        clients: int,
        seed: int = 0,
        settle: float = 0.5,
    ) -> None:
        self.kinds = list(weights)
        self.p = np.array([weights[k] for k in self.kinds], dtype=float) / sum(weights.values())
        self.prefixes, self.keys, self.source, self.settle = prefixes, keys, str(source), settle
        self.rng = [np.random.default_rng([seed, c]) for c in range(clients)]
        self.loaded: list[deque[tuple[float, str]]] = [deque() for _ in range(clients)]
        self.serial = 0

    def __call__(self, client: int, i: int) -> HttpRequest:
        rng = self.rng[client]
        kind = self.kinds[rng.choice(len(self.kinds), p=self.p)]
        loaded = self.loaded[client]
        if kind == "put" and len(loaded) >= self.HOLD:
            kind = "evict"  # a client holds a few keys at most: the cache keeps its size
        if kind == "evict" and loaded and loaded[0][0] <= time.monotonic():
            return HttpRequest("evict", "DELETE", f"/v1/entries/{loaded.popleft()[1]}")
        if kind in ("put", "evict"):
            self.serial += 1
            key = f"soak/c{client}/k{self.serial}"
            body = json.dumps({"source": self.source, "overwrite": True}).encode()
            return HttpRequest("put", "PUT", f"/v1/entries/{key}", body)
        if kind == "list":
            prefix = self.prefixes[rng.integers(len(self.prefixes))]
            return HttpRequest("list", "GET", f"/v1/entries?prefix={prefix}")
        return HttpRequest("info", "GET", f"/v1/entries/{self.keys[rng.integers(len(self.keys))]}")

    def held(self) -> list[str]:
        """The keys the clients loaded and have not evicted (to evict after the phase)."""
        return [key for loaded in self.loaded for _, key in loaded]

    def answered(self, client: int, request: HttpRequest, status: int) -> None:
        key = request.target.removeprefix("/v1/entries/")
        if (request.op == "put" and status == 202) or (request.op == "evict" and status == 404):
            self.loaded[client].append((time.monotonic() + self.settle, key))


def errors_of(run: LoadRun) -> dict[str, int]:
    """Requests that failed, by kind: no answer, or a status other than the expected ones
    (a 404 of an evict whose load had not finished is expected; see ``raced``)."""
    expected = {"list": {200}, "info": {200}, "put": {202}, "evict": {200, 404}}
    errors = dict(run.failures)
    for (kind, status), n in run.statuses.items():
        if status not in expected.get(kind, {200}):
            errors[kind] = errors.get(kind, 0) + n
    return errors


def _own_cpu() -> float:
    times = os.times()
    return times.user + times.system


def summarize(run: LoadRun, daemon_cpu_s: float, generator_cpu_s: float) -> dict[str, Any]:
    errors = errors_of(run)
    kinds: dict[str, Any] = {}
    for kind, samples in sorted(run.latencies.items()):
        kinds[kind] = {
            "requests": len(samples.values),
            "p50_s": samples.percentile(50),
            "p99_s": samples.percentile(99),
            "max_s": samples.max,
            "errors": errors.get(kind, 0),
            "statuses": {str(status): n for (k, status), n in sorted(run.statuses.items()) if k == kind},
        }
    every = run.all
    return {
        "requests": run.requests,
        "elapsed_s": run.elapsed_s,
        "throughput": run.requests / run.elapsed_s if run.elapsed_s else 0.0,
        "p50_s": every.percentile(50),
        "p99_s": every.percentile(99),
        "max_s": every.max,
        "errors": sum(errors.values()),
        "raced_evicts": run.statuses.get(("evict", 404), 0),
        "daemon_cpu_s": daemon_cpu_s,
        "generator_cpu_s": generator_cpu_s,
        "failure_examples": run.failure_examples,
        "kinds": kinds,
    }


def server_histogram(socket_path: Path) -> dict[str, dict[float, float]]:
    """The daemon's own request-latency histogram (``/metrics``): route -> cumulative count
    per bucket bound, over every status. Time spent inside the daemon's app only."""

    async def fetch() -> bytes:
        connection = await Connection.open(socket_path)
        try:
            return (await connection.exchange("GET", "/metrics"))[1]
        finally:
            await connection.close()

    buckets: dict[str, dict[float, float]] = {}
    for line in asyncio.run(fetch()).decode().splitlines():
        match = _BUCKET.match(line)
        if match:
            labels = dict(_LABEL.findall(match["labels"]))
            counts = buckets.setdefault(f"{labels['method']} {labels['route']}", {})
            bound = float(labels["le"])
            counts[bound] = counts.get(bound, 0.0) + float(match["count"])
    return buckets


def server_percentiles(
    before: dict[str, dict[float, float]], after: dict[str, dict[float, float]]
) -> dict[str, dict[str, float]]:
    """Per route, requests and the bucket bounds holding p50 and p99 between two histograms."""
    result = {}
    for route, counts in after.items():
        delta = {le: n - before.get(route, {}).get(le, 0.0) for le, n in counts.items()}
        total = delta.get(float("inf"), 0.0)
        if total > 0:
            bounds = sorted(delta)
            result[route] = {"requests": total, "top_bucket_s": bounds[-2]} | {
                f"p{q}_le_s": _finite(next(le for le in bounds if delta[le] >= total * q / 100))
                for q in (50, 99)
            }
    return result


def _finite(bound: float) -> float | None:
    return None if bound == float("inf") else bound


def _bucket(bound: float | None, top: float) -> str:
    return f"> {fmt_seconds(top)}" if bound is None else f"<= {fmt_seconds(bound)}"


class RssSampler:
    """The RSS of a process once a second while in the ``with`` block (is growth still going on?)."""

    def __init__(self, pid: int, interval: float = 1.0) -> None:
        self.pid, self.interval = pid, interval
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(process_counts(self.pid)["rss"])

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def wait_idle(client: Client, timeout: float = 60.0) -> dict[str, int]:
    """Wait until the daemon has no queued or running load; the jobs it remembers by state."""
    deadline = time.monotonic() + timeout
    while True:
        jobs = client.jobs()
        if not any(job.active for job in jobs) or time.monotonic() > deadline:
            states: dict[str, int] = {}
            for job in jobs:
                states[job.state] = states.get(job.state, 0) + 1
            return states
        time.sleep(0.1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 s warm-up, 2 s reads, 5 s mixed (for CI)")
    parser.add_argument(
        "--warmup",
        type=float,
        default=45.0,
        help="seconds of mixed load before measuring (default 45: over 1,000 loads at the default rate, "
        "so the job history is full)",
    )
    parser.add_argument(
        "--duration", type=float, default=60.0, help="seconds of the mixed phase (default 60)"
    )
    parser.add_argument("--reads-duration", type=float, default=30.0, help="seconds of the reads phase")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    parser.add_argument("--entries", type=int, default=200, help="entries in the cache (default 200)")
    parser.add_argument(
        "--rate",
        type=float,
        default=128.0,
        help="offered requests/s, all clients together (default 128: 2 per client; 0 = saturate)",
    )
    parser.add_argument("--put-kib", type=int, default=64, help="size of each loaded .npy (default 64 KiB)")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    duration, reads_duration, warmup = (
        (2.0, 1.0, 1.0) if args.quick else (args.duration, args.reads_duration, args.warmup)
    )
    started = time.perf_counter()

    prefixes = [f"ds{i}" for i in range(10)]
    keys = [f"{prefixes[i % len(prefixes)]}/item{i}" for i in range(args.entries)]
    with scratch_dir("shmcache-soak-api-") as scratch:
        root, source = scratch / "root", scratch / "small.npy"
        np.save(source, np.zeros(args.put_kib * 1024 // 4, dtype=np.float32))
        store = shmcache.Store(root)
        for key in keys:
            store.put_array(key, np.arange(64, dtype=np.float32))
        with serve(root) as daemon:
            assert daemon.client.socket_path is not None
            socket_path = daemon.client.socket_path

            def phase(weights: dict[str, int], seconds: float) -> dict[str, Any]:
                """One phase's summary, with the CPU the daemon and this load generator used."""
                mix = Mix(weights, prefixes, keys, source, args.clients)
                daemon_cpu, own_cpu = process_counts(daemon.pid)["cpu_s"], _own_cpu()
                histogram = server_histogram(socket_path)
                run = asyncio.run(
                    drive(
                        socket_path,
                        args.clients,
                        mix,
                        rate=args.rate,
                        duration=seconds,
                        timeout=30.0,
                        answered=mix.answered,
                    )
                )
                summary = summarize(
                    run, process_counts(daemon.pid)["cpu_s"] - daemon_cpu, _own_cpu() - own_cpu
                )
                summary["server"] = server_percentiles(histogram, server_histogram(socket_path))
                summary["daemon_after_run"] = process_counts(daemon.pid)
                summary["jobs"] = wait_idle(daemon.client)
                summary["daemon_after_idle"] = process_counts(daemon.pid)
                summary["entries_after"] = daemon.client.stats().entries
                for key in mix.held():  # the next phase starts from the same entries
                    with contextlib.suppress(KeyNotFoundError):
                        daemon.client.evict(key)
                return summary

            fresh = process_counts(daemon.pid)
            phase(MIX, warmup)  # thread pools, caches, the job history, allocator arenas
            reads = phase(READS, reads_duration)
            before = process_counts(daemon.pid)
            with RssSampler(daemon.pid) as sampler:
                mixed = phase(MIX, duration)

    results = {
        "warmup_s": warmup,
        "reads": reads,
        "mixed": mixed,
        "daemon_fresh": fresh,
        "rss_during_mixed": sampler.samples,
        "daemon_before": before,
        "daemon_after_run": mixed["daemon_after_run"],
        "daemon_after_idle": mixed["daemon_after_idle"],
        "jobs": mixed["jobs"],
        "entries_after": mixed["entries_after"],
    }
    targets = report(args, duration, reads_duration, results)
    write_report(
        args.json,
        "soak_api",
        quick=args.quick,
        config={
            "clients": args.clients,
            "entries": args.entries,
            "rate": args.rate,
            "put_kib": args.put_kib,
            "warmup_s": warmup,
            "duration_s": duration,
            "reads_duration_s": reads_duration,
            "mix": MIX,
            "reads": READS,
        },
        results=results,
        targets=targets,
        elapsed_s=time.perf_counter() - started,
    )
    return 0


def report(
    args: argparse.Namespace, duration: float, reads_duration: float, results: dict[str, Any]
) -> list[Target]:
    """Print the tables; the targets."""
    reads, mixed = results["reads"], results["mixed"]
    before, after_run, after = (
        results["daemon_before"],
        results["daemon_after_run"],
        results["daemon_after_idle"],
    )
    offered = f"{args.rate:g} req/s offered" if args.rate > 0 else "saturating"
    env = environment()
    print(
        f"\n{args.clients} clients over the Unix socket, {args.entries} entries, {offered}, "
        f"{env['cpus']} CPUs; warm-up {results['warmup_s']:g} s, reads {reads_duration:g} s, "
        f"then mixed {duration:g} s "
        f"({', '.join(f'{k} {v}%' for k, v in MIX.items())}; loads of {args.put_kib} KiB)\n"
    )
    rows: list[list[object]] = []
    for name, phase in (("reads", reads), ("mixed", mixed)):
        cores = phase["daemon_cpu_s"] / phase["elapsed_s"]
        per_request = phase["daemon_cpu_s"] / max(phase["requests"], 1)
        generator = phase["generator_cpu_s"] / phase["elapsed_s"]
        rows.append(
            [
                f"**{name}**",
                phase["requests"],
                f"{phase['throughput']:.0f} req/s",
                fmt_seconds(phase["p50_s"]),
                fmt_seconds(phase["p99_s"]),
                fmt_seconds(phase["max_s"]),
                phase["errors"],
                f"{cores:.2f} cores, {fmt_seconds(per_request)}/req (generator {generator:.2f})",
            ]
        )
        for kind, k in phase["kinds"].items():
            rows.append(
                [
                    f"{name}: {kind}",
                    k["requests"],
                    "",
                    fmt_seconds(k["p50_s"]),
                    fmt_seconds(k["p99_s"]),
                    fmt_seconds(k["max_s"]),
                    k["errors"],
                    "",
                ]
            )
    header = ["requests", "n", "throughput", "p50", "p99", "max", "errors", "daemon CPU"]
    print(markdown_table(header, rows, "lrrrrrrl"))
    print("\ninside the daemon's app (its /metrics histogram: the bucket holding p50 / p99)\n")
    server_rows = [
        [
            f"{name}: {route}",
            f"{r['requests']:.0f}",
            _bucket(r["p50_le_s"], r["top_bucket_s"]),
            _bucket(r["p99_le_s"], r["top_bucket_s"]),
        ]
        for name, phase in (("reads", reads), ("mixed", mixed))
        for route, r in sorted(phase["server"].items())
        if not route.endswith("/metrics")
    ]
    print(markdown_table(["route", "n", "p50", "p99"], server_rows, "lrrr"))
    growth = (after["rss"] - before["rss"]) / before["rss"]
    fresh, during = results["daemon_fresh"], results["rss_during_mixed"] or [after_run["rss"]]
    print()
    print(
        markdown_table(
            [
                "daemon",
                "fresh",
                "before mixed (warmed up)",
                "max during mixed",
                "after mixed",
                "after its loads",
            ],
            [
                [
                    "RSS",
                    f"{fresh['rss'] / MiB:.1f} MiB",
                    f"{before['rss'] / MiB:.1f} MiB",
                    f"{max(during) / MiB:.1f} MiB",
                    f"{after_run['rss'] / MiB:.1f} MiB",
                    f"{after['rss'] / MiB:.1f} MiB ({growth:+.1%})",
                ],
                ["threads", fresh["threads"], before["threads"], "", after_run["threads"], after["threads"]],
                ["descriptors", fresh["fds"], before["fds"], "", after_run["fds"], after["fds"]],
            ],
            "lrrrrr",
        )
    )
    print(
        f"\nloads: {results['jobs']}; evictions that raced their load (404, retried): "
        f"{mixed['raced_evicts']}; entries at the end: {results['entries_after']}"
    )
    for example in mixed["failure_examples"]:
        print(f"  no answer: {example}")
    print()
    p99 = mixed["p99_s"]
    targets = [
        Target(
            f"control API p99 < {P99_TARGET_S * 1e3:g} ms, {args.clients} clients, loads and evictions",
            f"soak, mixed ({offered})",
            p99,
            fmt_seconds(p99),
            p99 < P99_TARGET_S,
            f"reads alone: {fmt_seconds(reads['p99_s'])}",
        ),
        Target(
            "no failed request under load",
            "soak, mixed: errors",
            mixed["errors"],
            str(mixed["errors"]),
            mixed["errors"] == 0,
        ),
        Target(
            f"daemon memory flat under loads and evictions (growth <= {RSS_GROWTH_TARGET:.0%})",
            f"soak: RSS over {duration:g} s mixed",
            growth,
            f"{before['rss'] / MiB:.1f} -> {after['rss'] / MiB:.1f} MiB ({growth:+.1%}); threads "
            f"{before['threads']} -> {after['threads']}, descriptors {before['fds']} -> {after['fds']}",
            growth <= RSS_GROWTH_TARGET,
        ),
    ]
    print_targets(targets)
    return targets


if __name__ == "__main__":
    sys.exit(main())
