"""Diagnosis behind ``shmcache doctor``, ``top`` and ``watch``: environment checks, per-process
memory from ``/proc``, and the growth verdict for a sampled process.

Only the CLI imports this module (``import shmcache`` never does). It needs psutil for
process trees (imported lazily) and never imports torch, FastAPI or httpx: the daemon
is probed with a raw HTTP request over its Unix socket.
"""

from __future__ import annotations

import csv
import http.client
import json
import multiprocessing
import os
import resource
import socket
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ._disk.fs import free_bytes, total_bytes
from ._disk.layout import Layout
from ._store import Store
from ._units import human_bytes

__all__ = [
    "GROWTH_MIN_BYTES",
    "SLOPE_MIN_BYTES_PER_MIN",
    "STEP_MIN_BYTES",
    "WARMUP_S",
    "Check",
    "Memory",
    "ProcessRow",
    "Series",
    "Verdict",
    "WatchRecorder",
    "daemon_request",
    "judge",
    "mapping_processes",
    "process_tree",
    "read_memory",
    "run_checks",
]

MiB = 1 << 20
Status = Literal["ok", "warn", "fail"]

# ---------------------------------------------------------------------- verdict thresholds

WARMUP_S = 3.0
"""Samples from a process's first seconds are ignored: imports, the first prefetch round
and allocator arenas settle there, and that rise is not a leak."""
SLOPE_MIN_BYTES_PER_MIN = 2 * MiB
"""A process is *growing* only if its robust slope is at least 2 MiB/min ..."""
GROWTH_MIN_BYTES = 8 * MiB
"""... and the fitted growth over its judged samples (slope x duration) is at least 8 MiB.
The pair ignores allocator jitter of a few MiB on short runs and still catches a slow
leak on a long one (2 MiB/min for 4 min)."""
STEP_MIN_BYTES = 64 * MiB
"""A forked worker whose private memory rose this much since it started copied part of
its parent (a fork-started DataLoader worker itself adds a few MiB)."""
MIN_SAMPLES = 4
MIN_SPAN_S = 2.0
MAX_FIT_POINTS = 120
"""Theil-Sen is quadratic in the points: longer traces are thinned evenly first."""


# ---------------------------------------------------------------------- memory of a process


@dataclass(frozen=True)
class Memory:
    """One process's memory from ``/proc/PID/smaps``, in bytes."""

    rss: int
    pss: int
    uss: int
    """Private_Clean + Private_Dirty over every mapping."""
    own: int
    """Private anonymous memory: heap, anonymous mappings and copied (CoW) pages of
    private file mappings. Pages of shared files (the cache's entries, torch's shared
    tensors) are excluded even while only this process maps them: they are not copies.
    This is what a copy-on-write leak grows."""
    cache_pss: int = 0
    """PSS of mappings of files under the cache root (when a root was given)."""


def read_memory(pid: int, cache_root: str | os.PathLike[str] | None = None) -> Memory | None:
    """Memory of ``pid`` from ``/proc/PID/smaps``; None if it is gone or not ours to read."""
    prefix = (os.path.realpath(cache_root) + "/").encode() if cache_root is not None else None
    rss = pss = uss = own = cache_pss = 0
    m_private = m_anon = m_pss = 0
    m_file = m_cache = False

    def close_mapping() -> None:
        nonlocal own, cache_pss
        own += min(m_private, m_anon) if m_file else m_private
        if m_cache:
            cache_pss += m_pss

    try:
        with open(f"/proc/{pid}/smaps", "rb") as smaps:
            data = smaps.read()
    except OSError:  # exited, or another user's process
        return None
    for line in data.split(b"\n"):
        name, colon, rest = line.partition(b":")
        if not colon:
            continue
        if b" " in name:  # a mapping's header: "start-end perms offset dev inode [path]"
            close_mapping()
            fields = line.split(maxsplit=5)
            path = fields[5] if len(fields) == 6 else b""
            m_file = path.startswith(b"/")
            m_cache = prefix is not None and path.startswith(prefix)
            m_private = m_anon = m_pss = 0
            continue
        if name == b"Rss":
            rss += int(rest.split()[0]) * 1024
        elif name == b"Pss":
            m_pss = int(rest.split()[0]) * 1024
            pss += m_pss
        elif name == b"Private_Clean" or name == b"Private_Dirty":
            value = int(rest.split()[0]) * 1024
            uss += value
            m_private += value
        elif name == b"Anonymous":
            m_anon = int(rest.split()[0]) * 1024
    close_mapping()
    return Memory(rss=rss, pss=pss, uss=uss, own=own, cache_pss=cache_pss)


def command_line(pid: int, width: int = 80) -> str:
    """The process's command line (its name in brackets if it has none), shortened."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fp:
            raw = fp.read()
        text = " ".join(raw.replace(b"\0", b" ").decode(errors="replace").split())
        if not text:
            with open(f"/proc/{pid}/comm", "rb") as fp:
                text = f"[{fp.read().decode(errors='replace').strip()}]"
    except OSError:
        return "?"
    return text if len(text) <= width else text[: width - 1] + "…"


def parent_pid(pid: int) -> int:
    """PPID from ``/proc/PID/stat`` (0 if the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fp:
            data = fp.read()
    except OSError:
        return 0
    return int(data[data.rindex(b")") + 2 :].split()[1])


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants (DataLoader workers included)."""
    import psutil  # type: ignore[import-untyped]  # lazily: only top/watch need it

    try:
        parent = psutil.Process(pid)
        children = parent.children(recursive=True)
    except psutil.Error:
        return []
    return [pid, *(child.pid for child in children)]


# ---------------------------------------------------------------------- top


@dataclass(frozen=True)
class ProcessRow:
    """One line of ``shmcache top``."""

    pid: int
    command: str
    entries: list[str]
    """Keys it maps (``<evicted>`` for versions no longer published)."""
    memory: Memory


def mapping_processes(store: Store) -> tuple[list[ProcessRow], int]:
    """Processes that map entries of ``store``, by PSS (largest first), and the bytes of
    evicted or replaced entries still held by them."""
    scan = store.scan_mappings()
    key_of = {entry.version: entry.key for entry in store.list()}
    keys_by_pid: dict[int, set[str]] = {}
    for version, pids in scan.pids_by_version.items():
        for pid in pids:
            keys_by_pid.setdefault(pid, set()).add(key_of.get(version, "<evicted>"))
    rows = []
    for pid, keys in keys_by_pid.items():
        memory = read_memory(pid, store.root / "objects")
        if memory is not None:
            rows.append(ProcessRow(pid, command_line(pid), sorted(keys), memory))
    rows.sort(key=lambda row: (-row.memory.pss, row.pid))
    return rows, scan.deleted_bytes


# ---------------------------------------------------------------------- watch verdict


@dataclass(frozen=True)
class Verdict:
    """Whether one process's private memory grew while it was watched."""

    pid: int
    state: Literal["growing", "stepped", "flat", "short"]
    slope: float
    """Bytes per minute (Theil-Sen estimate over the samples after warm-up)."""
    growth: float
    """Fitted growth over the judged samples: slope x their duration, bytes."""
    span_s: float
    samples: int
    rise: float = 0.0
    """Private anonymous memory at its highest minus at the first sample, warm-up included."""
    forked: bool = False
    """A forked child (same command line as its parent): a DataLoader worker under fork."""

    def describe(self) -> str:
        if self.state == "short":
            return f"too short to judge ({self.samples} samples over {self.span_s:.1f} s after warm-up)"
        rate = f"{self.slope / MiB:+.1f} MiB/min"
        if self.state == "flat":
            return f"flat ({rate}, {self.growth / MiB:+.1f} MiB over {self.span_s:.0f} s)"
        if self.state == "stepped":
            return (
                f"flat now ({rate}) after its private memory rose {self.rise / MiB:+.1f} MiB since it "
                "started: a forked worker that copied this much holds its own copy of the Dataset's "
                "Python objects (copy-on-write)"
            )
        text = (
            f"growing at {self.slope / MiB:.1f} MiB/min ({self.growth / MiB:+.1f} MiB over "
            f"{self.span_s:.0f} s)"
        )
        if self.forked:
            return text + ": the copy-on-write leak signature"
        return text + " (a parent also grows as its forked workers copy pages it shared with them)"


def theil_sen(times: Sequence[float], values: Sequence[float]) -> float:
    """Median of the pairwise slopes: one spike or a sawtooth cannot tilt it."""
    n = len(times)
    if n > MAX_FIT_POINTS:
        picks = [round(i * (n - 1) / (MAX_FIT_POINTS - 1)) for i in range(MAX_FIT_POINTS)]
        times = [times[i] for i in picks]
        values = [values[i] for i in picks]
        n = MAX_FIT_POINTS
    slopes = sorted(
        (values[j] - values[i]) / (times[j] - times[i])
        for i in range(n)
        for j in range(i + 1, n)
        if times[j] > times[i]
    )
    if not slopes:
        return 0.0
    mid = len(slopes) // 2
    return slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2


def judge(
    pid: int,
    times: Sequence[float],
    owns: Sequence[float],
    warmup_s: float = WARMUP_S,
    forked: bool = False,
) -> Verdict:
    """Verdict over one process's samples (``times`` in seconds, ascending; ``owns`` in bytes).

    The first ``warmup_s`` seconds after its first sample are skipped (at most half of
    what was seen). *growing* needs slope >= SLOPE_MIN_BYTES_PER_MIN and fitted growth
    >= GROWTH_MIN_BYTES; fewer than MIN_SAMPLES samples or MIN_SPAN_S seconds is *short*.
    A ``forked`` worker that is flat now but rose by STEP_MIN_BYTES since its first
    sample is *stepped*: it copied that much early (a short epoch hides the slope).
    """
    if not times:
        return Verdict(pid, "short", 0.0, 0.0, 0.0, 0)
    rise = max(owns) - owns[0]
    skip = min(warmup_s, (times[-1] - times[0]) / 2)
    start = next(i for i, t in enumerate(times) if t - times[0] >= skip)
    t, v = list(times[start:]), list(owns[start:])
    span = t[-1] - t[0]
    if len(t) < MIN_SAMPLES or span < MIN_SPAN_S:
        return Verdict(pid, "short", 0.0, 0.0, span, len(t), rise, forked)
    slope = theil_sen(t, v) * 60.0
    growth = slope * span / 60.0
    if slope >= SLOPE_MIN_BYTES_PER_MIN and growth >= GROWTH_MIN_BYTES:
        state: Literal["growing", "stepped", "flat"] = "growing"
    elif forked and rise >= STEP_MIN_BYTES:
        state = "stepped"
    else:
        state = "flat"
    return Verdict(pid, state, slope, growth, span, len(t), rise, forked)


# ---------------------------------------------------------------------- doctor


@dataclass
class Check:
    """One finding of ``shmcache doctor``."""

    name: str
    status: Status
    summary: str
    fix: str = ""
    details: dict[str, Any] = field(default_factory=dict)


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def daemon_request(
    socket_path: str | os.PathLike[str],
    method: str,
    path: str,
    body: Any = None,
    timeout: float = 5.0,
) -> tuple[int, Any]:
    """One HTTP request to the daemon over its Unix socket: (status, parsed JSON body).

    Raises OSError when nothing answers (no socket, refused, timeout).
    """
    connection = _UnixHTTPConnection(os.fspath(socket_path), timeout)
    try:
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        connection.request(method, path, body=payload, headers=headers)
        response = connection.getresponse()
        raw = response.read()
    except http.client.HTTPException as exc:
        raise OSError(f"bad answer from {socket_path}: {exc}") from exc
    finally:
        connection.close()
    try:
        return response.status, json.loads(raw) if raw else None
    except ValueError:
        return response.status, raw.decode(errors="replace")


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _mount_of(path: Path) -> tuple[str, str]:
    """(mount point, file system type) holding ``path``, from ``/proc/self/mounts``."""
    real = os.path.realpath(path)
    best = ("/", "?")
    try:
        with open("/proc/self/mounts") as fp:
            for line in fp:
                parts = line.split()
                if len(parts) < 3:
                    continue
                point = parts[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best[0]):
                    best = (point, parts[2])
    except OSError:
        pass
    return best


def _check_space(name: str, path: Path, purpose: str) -> Check:
    probe = _existing_ancestor(path)
    mount, fstype = _mount_of(probe)
    try:
        capacity, free = total_bytes(probe), free_bytes(probe)
    except OSError as exc:
        return Check(name, "fail", f"cannot stat {probe}: {exc.strerror}", "check that the path exists")
    details = {"path": str(path), "mount": mount, "fstype": fstype, "capacity": capacity, "free": free}
    summary = (
        f"{mount} ({fstype}) holds {purpose}: {human_bytes(capacity)}, {human_bytes(free)} free"
    )
    docker_fix = (
        "in Docker, start the container with --shm-size=<size> (e.g. --shm-size=32g) or --ipc=host; "
        "on Kubernetes, mount an emptyDir with medium: Memory at /dev/shm; elsewhere "
        "`mount -o remount,size=<size> " + mount + "`"
    )
    if capacity < 256 * MiB:
        return Check(
            name, "fail",
            summary + " (Docker's default /dev/shm is 64 MB; DataLoader workers die with a bus error)",
            docker_fix, details,
        )
    if fstype not in ("tmpfs", "hugetlbfs", "ramfs", "?"):
        return Check(
            name, "warn", summary + f" (not a tmpfs: {fstype} may be disk-backed and slow)",
            "point --root / SHMCACHE_ROOT at a tmpfs such as /dev/shm", details,
        )
    if free < 64 * MiB or free < capacity // 20:
        return Check(
            name, "warn", summary + " (almost full: puts will fail with CacheFullError)",
            "shmcache ls / evict unused entries, shmcache cleanup, or grow the tmpfs: " + docker_fix, details,
        )
    if capacity < 2 << 30:
        return Check(name, "warn", summary + " (small for datasets)", docker_fix, details)
    return Check(name, "ok", summary, "", details)


def _cgroup_memory_limit() -> tuple[int | None, str]:
    """The tightest memory limit over this process's cgroup and its ancestors (v2 or v1)."""
    try:
        with open("/proc/self/cgroup") as fp:
            lines = fp.read().splitlines()
    except OSError:
        return None, ""
    candidates: list[tuple[Path, str]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, rel = parts
        if hierarchy == "0" and not controllers:
            candidates.append((Path("/sys/fs/cgroup") / rel.lstrip("/"), "memory.max"))
        elif "memory" in controllers.split(","):
            candidates.append((Path("/sys/fs/cgroup/memory") / rel.lstrip("/"), "memory.limit_in_bytes"))
    best: int | None = None
    where = ""
    for start, filename in candidates:
        base = Path("/sys/fs/cgroup/memory" if filename.endswith("in_bytes") else "/sys/fs/cgroup")
        directory = start if start.is_dir() else base  # inside a cgroup namespace: the mount is ours
        while True:
            try:
                text = (directory / filename).read_text().strip()
            except OSError:
                text = ""
            if text and text != "max":
                value = int(text)
                if value < (1 << 62) and (best is None or value < best):
                    best, where = value, str(directory / filename)
            if directory == base or directory == directory.parent:
                break
            directory = directory.parent
    return best, where


def _check_cgroup(used: int, tmpfs_capacity: int | None) -> Check:
    limit, where = _cgroup_memory_limit()
    details: dict[str, Any] = {
        "limit": limit, "file": where, "cache_used": used, "tmpfs_capacity": tmpfs_capacity,
    }
    if limit is None:
        return Check("cgroup", "ok", "no cgroup memory limit", "", details)
    summary = f"cgroup memory limit {human_bytes(limit)} ({where}); cache uses {human_bytes(used)}"
    charged = (
        "tmpfs pages are charged to the memory cgroup of the process that first wrote them, "
        "so the cache counts against this limit next to your training processes"
    )
    if used >= limit:
        return Check(
            "cgroup", "fail", summary + ": the cache alone exceeds the limit",
            f"{charged}: raise the limit (docker run --memory, Kubernetes resources.limits.memory), "
            "or evict entries / give the daemon a budget below it (shmcache serve --max-bytes)", details,
        )
    if tmpfs_capacity is not None and tmpfs_capacity > limit:
        return Check(
            "cgroup", "warn",
            summary + f"; the tmpfs ({human_bytes(tmpfs_capacity)}) is larger than the limit",
            f"{charged}: filling the cache can get processes OOM-killed; give the daemon a budget "
            "well below the limit (shmcache serve --max-bytes / --max-fraction) or raise the limit",
            details,
        )
    return Check("cgroup", "ok", summary, "", details)


def _check_root(root: Path) -> Check:
    details: dict[str, Any] = {"root": str(root)}
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        parent = _existing_ancestor(root.parent)
        if not os.access(parent, os.W_OK | os.X_OK):
            return Check(
                "root", "fail", f"{root} does not exist and {parent} is not writable by you",
                "pick a writable root with --root or SHMCACHE_ROOT", details,
            )
        return Check("root", "ok", f"{root} does not exist yet (created 0700 on the first put)", "", details)
    except OSError as exc:
        return Check("root", "fail", f"cannot stat {root}: {exc.strerror}", "pick another root", details)
    details.update(uid=st.st_uid, mode=oct(stat.S_IMODE(st.st_mode)))
    if stat.S_ISLNK(st.st_mode):
        return Check(
            "root", "fail", f"{root} is a symlink (someone could plant one in /dev/shm)",
            f"use the real path {os.path.realpath(root)}, or remove the link", details,
        )
    if not stat.S_ISDIR(st.st_mode):
        return Check("root", "fail", f"{root} is not a directory", "remove it or pick another root", details)
    if st.st_uid != os.geteuid():
        return Check(
            "root", "fail", f"{root} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()})",
            "pick another root with --root / SHMCACHE_ROOT (someone may have planted it), or run as "
            f"uid {st.st_uid}", details,
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        return Check(
            "root", "warn", f"{root} is mode {mode:04o}: other users may read or change the cache",
            f"chmod 700 {root} (unless you shared it with a group on purpose)", details,
        )
    if not os.access(root, os.R_OK | os.W_OK | os.X_OK):
        return Check(
            "root", "fail", f"{root} is mode {mode:04o}: you cannot use it", f"chmod 700 {root}", details
        )
    return Check("root", "ok", f"{root}: yours, mode {mode:04o}", "", details)


def _check_daemon(socket_path: Path) -> Check:
    details: dict[str, Any] = {"socket": str(socket_path)}
    if not socket_path.exists():
        return Check(
            "daemon", "ok",
            f"no daemon on {socket_path} (optional: reads never need it; `shmcache serve` shares loads)",
            "", details,
        )
    try:
        status, body = daemon_request(socket_path, "GET", "/v1/health", timeout=3.0)
    except OSError as exc:
        return Check(
            "daemon", "warn", f"{socket_path} exists but nothing answers ({exc})",
            "a daemon died without cleaning up: start it again with `shmcache serve` "
            "(it replaces the stale socket)", details,
        )
    details.update(status=status, health=body)
    if status == 200 and isinstance(body, dict):
        return Check(
            "daemon", "ok",
            f"daemon pid {body.get('pid')} (shmcache {body.get('version')}) answers on {socket_path}, "
            f"up {float(body.get('uptime_s', 0.0)):.0f} s",
            "", details,
        )
    return Check(
        "daemon", "warn", f"daemon on {socket_path} answered HTTP {status} to GET /v1/health",
        "check the daemon's log; restart it with `shmcache serve`", details,
    )


def _check_start_method() -> Check:
    default = multiprocessing.get_all_start_methods()[0]  # documented: the platform default first
    chosen = multiprocessing.get_start_method(allow_none=True) or default
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    details = {"default": default, "python": version}
    if chosen == "fork":
        summary = (
            f"default start method: fork (Python {version}). Workers inherit the Dataset: Python "
            "lists/dicts in it are copied page by page as workers read them (copy-on-write growth); "
            "keep them in shmcache (shmcache.share). Python 3.14 defaults to forkserver."
        )
    else:
        summary = (
            f"default start method: {chosen} (Python {version}). Every DataLoader worker receives the "
            "Dataset pickled: shmcache arrays and containers pickle as a reference (key + version); "
            "a numpy.memmap or a big list is copied whole into every worker."
        )
    return Check("start_method", "ok", summary, "", details)


def _check_open_files(entries: int) -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    details = {"soft": soft, "hard": hard, "entries": entries}
    if sys.version_info >= (3, 13):
        return Check(
            "open_files", "ok", f"ulimit -n {soft} (Python 3.13+ maps entries without holding descriptors)",
            "", details,
        )
    limit = hard if hard != resource.RLIM_INFINITY else 1 << 20
    summary = (
        f"ulimit -n {soft} (hard {hard}); on Python < 3.13 each attached entry holds a descriptor "
        "(shmcache lifts the soft limit to the hard one)"
    )
    if entries + 256 > limit:
        return Check(
            "open_files", "fail", summary + f": {entries} entries cannot all be open in one process",
            "raise the hard limit (ulimit -Hn, docker run --ulimit nofile=65536:65536, "
            "LimitNOFILE= in systemd), or store fewer, larger entries", details,
        )
    if limit < 4096:
        return Check(
            "open_files", "warn", summary + f": a process can attach at most ~{limit - 256} entries",
            "raise the hard limit (ulimit -Hn, docker run --ulimit nofile=65536:65536), or store "
            "fewer, larger entries", details,
        )
    return Check("open_files", "ok", summary, "", details)


def _check_overcommit() -> Check:
    try:
        with open("/proc/sys/vm/overcommit_memory") as fp:
            mode = int(fp.read().strip())
    except (OSError, ValueError):
        return Check("overcommit", "ok", "vm.overcommit_memory unknown (no /proc/sys)", "", {})
    details = {"overcommit_memory": mode}
    if mode == 2:
        return Check(
            "overcommit", "warn",
            "vm.overcommit_memory=2 (strict): writable private mappings (shmcache.torch tensors map "
            "entries copy-on-write) are charged in full against CommitLimit and can fail with ENOMEM",
            "sysctl vm.overcommit_memory=0, or raise vm.overcommit_ratio", details,
        )
    return Check("overcommit", "ok", f"vm.overcommit_memory={mode}", "", details)


def _check_held(store: Store) -> Check:
    try:
        scan = store.scan_mappings()
    except OSError as exc:
        return Check("held", "ok", f"cannot scan /proc: {exc}", "", {})
    if scan.deleted_bytes == 0:
        return Check("held", "ok", "no evicted entry is still held by a process", "", {"deleted_bytes": 0})
    return Check(
        "held", "warn",
        f"{human_bytes(scan.deleted_bytes)} of evicted or replaced entries are still mapped by live "
        "processes (the memory returns when they exit or drop their arrays)",
        "`shmcache top` shows which processes map `<evicted>` entries", {"deleted_bytes": scan.deleted_bytes},
    )


def run_checks(root: Path, socket_path: Path | None = None) -> list[Check]:
    """Every check of ``shmcache doctor``, in order."""
    store = Store(root)
    layout = Layout(store.root)
    try:
        entries = store.list() if layout.entries.is_dir() else []
    except Exception:  # an unreadable root is reported by the root check
        entries = []
    used = sum(entry.size for entry in entries)
    checks = [_check_space("shm", store.root, "the cache root")]
    shm = Path("/dev/shm")
    if shm.is_dir() and _mount_of(shm)[0] != checks[0].details.get("mount"):
        checks.append(_check_space("dev_shm", shm, "torch's DataLoader batches"))
    tmpfs_capacity = checks[0].details.get("capacity")
    checks += [
        _check_cgroup(used, tmpfs_capacity if isinstance(tmpfs_capacity, int) else None),
        _check_root(store.root),
        _check_daemon(socket_path if socket_path is not None else store.root / "daemon.sock"),
        _check_start_method(),
        _check_open_files(len(entries)),
        _check_overcommit(),
        _check_held(store),
    ]
    return checks


# ---------------------------------------------------------------------- watch recording


@dataclass
class Series:
    """Samples of one process seen by ``watch``."""

    pid: int
    ppid: int
    command: str
    times: list[float] = field(default_factory=list)
    memories: list[Memory] = field(default_factory=list)


CSV_HEADER = ("time_s", "pid", "ppid", "cmd", "rss", "pss", "uss", "own", "cache_pss")


class WatchRecorder:
    """Samples a process tree into a CSV (one row per process per sample) and keeps the
    series for the verdict and the plot."""

    def __init__(self, csv_path: Path, started: float, cache_root: Path | None = None) -> None:
        self.csv_path = csv_path
        self.cache_root = cache_root
        self.started = started
        self.series: dict[int, Series] = {}
        self.root_pid = -1
        self._file = open(csv_path, "w", newline="")  # noqa: SIM115 - closed in close()
        self._writer = csv.writer(self._file)
        self._writer.writerow(CSV_HEADER)

    def sample(self, root_pid: int, now: float) -> int:
        """One sample of ``root_pid`` and its descendants; returns how many were read."""
        seen = 0
        self.root_pid = root_pid
        elapsed = now - self.started
        for pid in process_tree(root_pid):
            memory = read_memory(pid, self.cache_root)
            if memory is None:
                continue
            series = self.series.get(pid)
            if series is None:
                series = self.series[pid] = Series(pid, parent_pid(pid), command_line(pid, 120))
            series.times.append(elapsed)
            series.memories.append(memory)
            self._writer.writerow(
                (f"{elapsed:.3f}", pid, series.ppid, series.command, memory.rss, memory.pss, memory.uss,
                 memory.own, memory.cache_pss)
            )
            seen += 1
        self._file.flush()
        return seen

    def close(self) -> None:
        self._file.close()

    def verdicts(self) -> list[tuple[Series, Verdict]]:
        out = []
        for s in self.series.values():
            parent = self.series.get(s.ppid)
            forked = s.pid != self.root_pid and parent is not None and parent.command == s.command
            out.append((s, judge(s.pid, s.times, [m.own for m in s.memories], forked=forked)))
        return out

    def plot(self, png_path: Path, title: str) -> bool:
        """USS and PSS per process over time; False (nothing written) without matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return False
        fig, (ax_uss, ax_pss) = plt.subplots(1, 2, figsize=(13, 5), sharex=True)
        shown = sorted(self.series.values(), key=lambda s: -max((m.pss for m in s.memories), default=0))
        for n, s in enumerate(shown):
            label = f"{s.pid} main" if s.pid == self.root_pid else f"{s.pid} child of {s.ppid}"
            kwargs: dict[str, Any] = {"label": label if n < 12 else None, "linewidth": 1.2}
            line = ax_uss.plot(s.times, [m.uss / MiB for m in s.memories], **kwargs)[0]
            ax_pss.plot(s.times, [m.pss / MiB for m in s.memories], color=line.get_color(), **kwargs)
        for ax, what in ((ax_uss, "USS (private)"), (ax_pss, "PSS (proportional share)")):
            ax.set_title(f"{what} per process")
            ax.set_xlabel("seconds since start")
            ax.set_ylabel("MiB")
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
        ax_uss.legend(fontsize="small")
        fig.suptitle(title[:120])
        fig.tight_layout()
        fig.savefig(png_path, dpi=100)
        plt.close(fig)
        return True
