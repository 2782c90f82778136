"""What the benchmark scripts share: the machine description, scratch directories (on
/dev/shm, else the temp directory), sample statistics and interleaved timing, markdown
tables, targets, the JSON report, PNG plots, process memory (and threads, descriptors), a
``shmcache serve`` to measure against, and an asyncio HTTP load generator for it.

Every script in ``scripts/`` imports this from its own directory (Python puts a script's
directory first on ``sys.path``), so each stays runnable on its own. Only the standard
library is imported up front (``bench_all`` imports this and nothing else); shmcache,
its client and matplotlib are imported by the helpers that need them. Process memory
comes from the package's one smaps reader (``shmcache._diagnose.procfs``), so "own
memory" here is what ``shmcache watch`` calls it; the daemon is driven only through
``shmcache.client.Client``, except the load generator's requests: ``Client`` is synchronous
and spends ~1.4 ms of CPU per request (httpx, then typed records), so 64 of them on
threads on a 2-core machine would measure the GIL, not the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shmcache.client import Client

    from shmcache._diagnose.procfs import Memory

MiB = 1 << 20
GiB = 1 << 30

__all__ = [
    "Connection",
    "Daemon",
    "GiB",
    "HttpRequest",
    "LoadRun",
    "MiB",
    "Samples",
    "Target",
    "alternated",
    "drive",
    "environment",
    "fmt_bytes",
    "fmt_seconds",
    "make_blob_tree",
    "mark",
    "markdown_table",
    "percentile",
    "print_targets",
    "process_counts",
    "process_tree",
    "pyplot",
    "read_memory",
    "round_robin",
    "save_figure",
    "scratch_base",
    "scratch_dir",
    "serve",
    "time_per_op",
    "write_json",
    "write_report",
]


# ---------------------------------------------------------------------- statistics and timing


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0-100) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


@dataclass
class Samples:
    """Repeated measurements of one quantity (one value per repeat)."""

    values: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        self.values.append(value)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def min(self) -> float:
        return min(self.values) if self.values else float("nan")

    @property
    def max(self) -> float:
        return max(self.values) if self.values else float("nan")

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values) if self.values else float("nan")

    def percentile(self, q: float) -> float:
        return percentile(self.values, q) if self.values else float("nan")

    def summary(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.min, "max": self.max, "values": list(self.values)}


def alternated(names: Sequence[str], repeat: int) -> Sequence[str]:
    """``names`` in order on even repeats, reversed on odd ones: a drift in time (a
    warming cache, a noisy neighbour) then hits every method alike."""
    return names if repeat % 2 == 0 else names[::-1]


def round_robin(
    methods: Mapping[str, Callable[[], float]],
    repeats: int,
    *,
    alternate: bool = False,
    before: Callable[[], None] | None = None,
) -> dict[str, Samples]:
    """Run every method once per repeat, interleaved (order ``alternated`` between repeats
    if ``alternate``), ``before()`` ahead of each run; each run returns its measurement."""
    samples = {name: Samples() for name in methods}
    names = list(methods)
    for repeat in range(repeats):
        for name in alternated(names, repeat) if alternate else names:
            if before is not None:
                before()
            samples[name].add(methods[name]())
    return samples


def time_per_op(
    stmt: str | Callable[[], object],
    *,
    number: int = 1,
    per_loop: int = 1,
    namespace: dict[str, Any] | None = None,
    ns: bool = False,
) -> Callable[[], float]:
    """A ``timeit`` loop (``number`` runs of ``stmt``, gc off) as a function returning the
    time per operation: seconds, or nanoseconds with ``ns``; one run of ``stmt`` does
    ``per_loop`` operations."""
    timer = timeit.Timer(stmt, globals=namespace, timer=time.perf_counter_ns if ns else time.perf_counter)
    return lambda: timer.timeit(number) / (number * per_loop)


# ---------------------------------------------------------------------- formatting, targets


@dataclass
class Target:
    """One DESIGN.md target as measured: the row it belongs to, the measured ratio and
    whether it is met (``ok`` None: shown for information, not a target)."""

    target: str
    """The target as DESIGN.md states it, e.g. ``"load .npy >= 0.9x cp"``."""
    row: str
    """What was measured, e.g. ``"1 GiB .npy, Store.put_file vs cp"``."""
    measured: float
    """The measured ratio (or value) the target is checked against."""
    measured_text: str
    ok: bool | None
    note: str = ""


def mark(ok: bool | None) -> str:
    return "" if ok is None else ("✓" if ok else "✗")


def fmt_seconds(seconds: float) -> str:
    if seconds != seconds:  # NaN
        return "n/a"
    if seconds < 1e-6:
        return f"{seconds * 1e9:.0f} ns"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(nbytes: float) -> str:
    if nbytes >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    if nbytes >= MiB:
        return f"{nbytes / MiB:.1f} MiB"
    return f"{nbytes / 1024:.1f} KiB"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]], align: str = "") -> str:
    """A markdown table; ``align`` has one character per column (``l``, ``r`` or ``c``)."""
    align = align.ljust(len(header), "l")
    rules = {"l": "---", "r": "---:", "c": ":-:"}

    def line(cells: Sequence[object]) -> str:
        return "|" + "|".join(f" {cell} " if str(cell) else " " for cell in cells) + "|"

    return "\n".join(
        [line(header), "|" + "|".join(rules[a] for a in align) + "|", *(line(row) for row in rows)]
    )


def print_targets(targets: Sequence[Target]) -> None:
    print(
        markdown_table(
            ["target (DESIGN.md)", "row", "measured", "ok"],
            [
                (t.target, t.row, t.measured_text + (f" ({t.note})" if t.note else ""), mark(t.ok))
                for t in targets
            ],
        )
    )
    checked = [t for t in targets if t.ok is not None]
    met = sum(bool(t.ok) for t in checked)
    print(f"\n{met}/{len(checked)} targets met")


# ---------------------------------------------------------------------- environment, report


def environment() -> dict[str, Any]:
    """The machine and the versions a result was measured with (numpy, torch and
    shmcache where this process imported them)."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fp:
        for line in fp:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    ram = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as fp:
        for line in fp:
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * 1024
                break
    env: dict[str, Any] = {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "ram_bytes": ram,
        "machine": platform.machine(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
    for module in ("numpy", "torch", "shmcache"):
        loaded = sys.modules.get(module)
        if loaded is not None:
            env[module] = getattr(loaded, "__version__", "?")
    return env


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """``data`` as indented JSON (parent directories made; unknown types as ``str``)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fp:
        json.dump(data, fp, indent=1, default=str)


def write_report(
    path: str | os.PathLike[str] | None,
    benchmark: str,
    *,
    quick: bool,
    config: Any,
    results: Any,
    targets: Sequence[Target],
    elapsed_s: float,
    plots: Sequence[Path] = (),
    environment_extra: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """The JSON every script writes with ``--json`` (``bench_all`` reads ``targets``);
    ``extra`` adds top-level keys of the script's own."""
    if path is None:
        return
    report = {
        "benchmark": benchmark,
        "quick": quick,
        "environment": environment() | dict(environment_extra or {}),
        "config": config,
        "elapsed_s": elapsed_s,
        "results": results,
        "targets": [asdict(t) for t in targets],
        "plots": [str(p) for p in plots],
        **(extra or {}),
    }
    write_json(path, report)


# ---------------------------------------------------------------------- scratch space


def scratch_base(on_shm: bool = True) -> Path:
    """/dev/shm when ``on_shm`` and it exists, else the temp directory."""
    from shmcache._disk.layout import SHM_DIR  # here: bench_all imports this module, not shmcache

    return Path(SHM_DIR) if on_shm and os.path.isdir(SHM_DIR) else Path(tempfile.gettempdir())


@contextlib.contextmanager
def scratch_dir(
    prefix: str, on_shm: bool = True, parent: str | os.PathLike[str] | None = None
) -> Iterator[Path]:
    """A fresh directory under ``parent`` (default: ``scratch_base(on_shm)``), removed
    with everything in it on exit, whatever happened."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent if parent is not None else scratch_base(on_shm)))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------- process memory


def read_memory(pid: int, cache_root: str | os.PathLike[str] | None = None) -> Memory | None:
    """``pid``'s memory (rss, pss, uss, own, cache_pss) from the package's smaps reader,
    the numbers ``shmcache watch`` and ``top`` show; None if the process is gone."""
    from shmcache._diagnose.procfs import read_memory as read

    return read(pid, cache_root)


def process_counts(pid: int) -> dict[str, Any]:
    """``pid``'s RSS (bytes), threads and open descriptors (what must stay flat in a soak),
    and the CPU seconds it has used so far (user + system)."""
    memory = read_memory(pid)
    if memory is None:
        raise RuntimeError(f"process {pid} is gone")
    with open(f"/proc/{pid}/status") as fp:
        threads = next(int(line.split()[1]) for line in fp if line.startswith("Threads:"))
    with open(f"/proc/{pid}/stat") as fp:
        utime, stime = fp.read().rpartition(")")[2].split()[11:13]
    cpu = (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")
    return {"rss": memory.rss, "threads": threads, "fds": len(os.listdir(f"/proc/{pid}/fd")), "cpu_s": cpu}


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (DataLoader workers included)."""
    from shmcache._diagnose.procfs import process_tree as tree

    return tree(pid)


# ---------------------------------------------------------------------- plots


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` drawing to PNG (the Agg backend); None, said once on stdout,
    when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install matplotlib)")
        return None
    return plt


def save_figure(fig: Any, out_dir: Path, name: str, dpi: int) -> Path:
    """Write ``fig`` as ``out_dir/name`` (directory made), close it, return the path."""
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------- a daemon to measure


@dataclass
class Daemon:
    """A ``shmcache serve`` subprocess of a root, and a :class:`Client` that talks to it."""

    process: subprocess.Popen[bytes]
    client: Client

    @property
    def pid(self) -> int:
        return self.process.pid


def _shmcache_command() -> list[str]:
    """The ``shmcache`` console script beside this interpreter, else its entry point."""
    script = Path(sys.executable).with_name("shmcache")
    if script.exists():
        return [str(script)]
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name="shmcache")
    code = f"import sys; from {entry.module} import {entry.attr}; sys.exit({entry.attr}())"
    return [sys.executable, "-c", code]


@contextlib.contextmanager
def serve(root: str | os.PathLike[str], *args: str, start_timeout: float = 30.0) -> Iterator[Daemon]:
    """``shmcache serve --root ROOT`` (warnings only in its log) until exit; ready once its
    health answers. Stopped with SIGTERM (killed after 30 s) whatever happened."""
    from shmcache.client import Client

    from shmcache.errors import DaemonUnavailableError

    command = [*_shmcache_command(), "serve", "--root", os.fspath(root), "--log-level", "warning", *args]
    process = subprocess.Popen(command)
    client = Client(root, timeout=600)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                client.health()
                break
            except DaemonUnavailableError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the daemon did not start: {' '.join(command)}") from None
                time.sleep(0.05)
        yield Daemon(process, client)
    finally:
        client.close()
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ---------------------------------------------------------------------- HTTP load on a daemon


class Connection:
    """A minimal keep-alive HTTP/1.1 client over a Unix socket (cheap, so the load
    generator's own CPU does not dominate on a small machine)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, path: Path) -> Connection:
        reader, writer = await asyncio.open_unix_connection(str(path))
        return cls(reader, writer)

    async def request(self, method: str, target: str, body: bytes | None = None) -> int:
        """Send one request (``body`` as JSON), read the whole answer; its status."""
        return (await self.exchange(method, target, body))[0]

    async def exchange(self, method: str, target: str, body: bytes | None = None) -> tuple[int, bytes]:
        """Send one request (``body`` as JSON); the answer's status and body."""
        head = f"{method} {target} HTTP/1.1\r\nHost: shmcache\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self.writer.write(head.encode() + b"\r\n" + (body or b""))
        answer = await self.reader.readuntil(b"\r\n\r\n")
        status = int(answer.split(b" ", 2)[1])
        length = 0
        for line in answer.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await self.reader.readexactly(length)

    async def get(self, target: str) -> int:
        return await self.request("GET", target)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


@dataclass(frozen=True)
class HttpRequest:
    """One request of a load: ``op`` names its kind in the results."""

    op: str
    method: str
    target: str
    body: bytes | None = None


@dataclass
class LoadRun:
    """What :func:`drive` measured: seconds per request by kind, statuses by kind, and the
    requests that got no answer (transport errors, timeouts) by kind."""

    latencies: dict[str, Samples] = field(default_factory=dict)
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    failure_examples: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def all(self) -> Samples:
        return Samples([value for samples in self.latencies.values() for value in samples.values])

    @property
    def requests(self) -> int:
        return sum(len(samples.values) for samples in self.latencies.values())


async def drive(
    socket_path: Path,
    clients: int,
    next_request: Callable[[int, int], HttpRequest],
    *,
    rate: float = 0.0,
    counts: Sequence[int] | None = None,
    duration: float | None = None,
    timeout: float | None = None,
    answered: Callable[[int, HttpRequest, int], None] | None = None,
) -> LoadRun:
    """``clients`` keep-alive connections each sending ``next_request(client, i)`` for
    ``i = 0, 1, ...``: ``counts[client]`` requests, or until ``duration`` seconds have
    passed. All together they offer ``rate`` requests/s, evenly staggered (0: each sends
    its next request as soon as the last one is answered, a saturation test);
    ``answered(client, request, status)`` is told every answer. A request whose
    connection broke, or without an answer within ``timeout`` seconds (if given: a task
    per request, which costs the generator CPU), is a failure; the client then reconnects."""
    run = LoadRun()
    interval = clients / rate if rate > 0 else 0.0
    start_all = time.perf_counter()
    stop_at = None if duration is None else start_all + duration

    async def client(index: int) -> None:
        connection: Connection | None = None
        next_at = start_all + (index / clients) * interval
        i = 0
        limit = None if counts is None else counts[index]
        try:
            while (limit is None or i < limit) and (stop_at is None or time.perf_counter() < stop_at):
                if interval:
                    delay = next_at - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    next_at += interval
                request = next_request(index, i)
                i += 1
                start = time.perf_counter()
                try:
                    if connection is None:
                        connection = await Connection.open(socket_path)
                    answer = connection.request(request.method, request.target, request.body)
                    status = await (answer if timeout is None else asyncio.wait_for(answer, timeout))
                except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as exc:
                    run.failures[request.op] += 1
                    if len(run.failure_examples) < 5:
                        run.failure_examples.append(f"{request.method} {request.target}: {exc!r}")
                    if connection is not None:
                        await connection.close()
                    connection = None
                    continue
                run.latencies.setdefault(request.op, Samples()).add(time.perf_counter() - start)
                run.statuses[request.op, status] += 1
                if answered is not None:
                    answered(index, request, status)
        finally:
            if connection is not None:
                await connection.close()

    await asyncio.gather(*(client(i) for i in range(clients)))
    run.elapsed_s = time.perf_counter() - start_all
    return run


# ---------------------------------------------------------------------- source trees


def make_blob_tree(directory: Path, n: int, min_kib: int, max_kib: int, seed: int = 0) -> int:
    """``n`` files of random bytes, ``min_kib``..``max_kib`` KiB each, 100 per subdirectory
    (an image folder's shape); returns the bytes written."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sizes = rng.integers(min_kib << 10, (max_kib << 10) + 1, size=n)
    pool = rng.integers(0, 256, size=int(sizes.max()) + 4096, dtype=np.uint8).tobytes()
    for i, size in enumerate(sizes.tolist()):
        sub = directory / f"{i // 100:04d}"
        if i % 100 == 0:
            sub.mkdir(parents=True, exist_ok=True)
        start = (i * 4099) % 4096
        (sub / f"{i:06d}.jpg").write_bytes(pool[start : start + size])
    return int(sizes.sum())
# ---------------------------------------------------------------------- data sets


def make_annotations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Issue 11's annotation dicts, ``{"bbox": [4 floats], "label": int, "id": str}``, n of
    them, deterministic for a seed (what ``share()`` of a Dataset's annotations sees)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    boxes = np.round(rng.uniform(0, 640, size=(n, 4)), 2).tolist()
    labels = rng.integers(0, 80, size=n).tolist()
    return [
        {"bbox": box, "label": label, "id": f"ann-{seed}-{i:09d}"}
        for i, (box, label) in enumerate(zip(boxes, labels, strict=True))
    ]


def write_random_npy(path: Path, nbytes: int, chunk: int = 64 * MiB) -> None:
    """A float32 ``.npy`` of ``nbytes`` random data bytes, written in chunks (no big copy in RAM)."""
    import numpy as np

    rng = np.random.default_rng(0)
    count = nbytes // 4
    with open(path, "wb") as fp:
        np.lib.format.write_array_header_1_0(fp, {"descr": "<f4", "fortran_order": False, "shape": (count,)})
        left = count
        while left:
            n = min(left, chunk // 4)
            fp.write(rng.random(n, dtype=np.float32).tobytes())
            left -= n
