"""``shmcache doctor``: the checks for what breaks shared-memory caches on this machine,
each with a fix.

The /dev/shm size and free space (Docker's 64 MB default), a cgroup memory limit below the
cache, the root's owner and mode, the daemon (probed with :class:`shmcache.client.Client`,
imported only when its socket exists), the root's budget (exceeded, or above the tmpfs size), the
multiprocessing start method, ``ulimit -n``, vm.overcommit, systemd-logind's RemoveIPC
(which deletes a regular user's /dev/shm files at logout), and the GPU (``gpu``).
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import stat
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from .._disk.fs import free_bytes, total_bytes
from .._disk.layout import ENV_ROOT, SHM_DIR, Layout
from .._disk.trust import untrusted_reason
from .._store import Store, StoreStats
from .._store.catalog import partial_bytes
from .._units import human_bytes
from ..errors import DaemonUnavailableError, ShmCacheError, UntrustedDaemonError
from .gpu import gpu_report
from .hugepages import huge_pages_report
from .logind import removeipc_risk

__all__ = ["Check", "Status", "run_checks"]

MiB = 1 << 20
Status = Literal["ok", "warn", "fail"]
_PROBE_TIMEOUT_S = 3.0


@dataclass
class Check:
    """One finding of ``shmcache doctor``."""

    name: str
    status: Status
    summary: str
    fix: str = ""
    details: dict[str, Any] = field(default_factory=dict)


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
            f"point --root / {ENV_ROOT} at a tmpfs such as {SHM_DIR}", details,
        )
    if free < 64 * MiB or free < capacity // 20:
        return Check(
            name, "warn", summary + " (almost full: puts will fail with CacheFullError)",
            "shmcache ls / evict unused entries, shmcache cleanup, or grow the tmpfs: " + docker_fix, details,
        )
    if capacity < 2 << 30:
        return Check(name, "warn", summary + " (small for datasets)", docker_fix, details)
    return Check(name, "ok", summary, "", details)


def _note_partial(check: Check, layout: Layout) -> Check:
    """Name the bytes of partial writes in the root's ``tmp/`` (no entry counts them) when
    they hold half or more of what the file system uses: what fills it, then."""
    partial = partial_bytes(layout)
    used = check.details.get("capacity", 0) - check.details.get("free", 0)
    if partial >= max(MiB, used // 2):
        check.details["partial_bytes"] = partial
        check.summary += (
            f"; {human_bytes(partial)} of what is used is partial writes in {layout.tmp} (writes in "
            "progress or left by dead writers: `shmcache cleanup` frees the dead ones)"
        )
    return check


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


def _check_root(root: Path, owner: tuple[int, int] | None = None) -> Check:
    details: dict[str, Any] = {"root": str(root)}
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        parent = _existing_ancestor(root.parent)
        if not os.access(parent, os.W_OK | os.X_OK):
            return Check(
                "root", "fail", f"{root} does not exist and {parent} is not writable by you",
                f"pick a writable root with --root or {ENV_ROOT}", details,
            )
        return Check("root", "ok", f"{root} does not exist yet (created 0700 on the first put)", "", details)
    except OSError as exc:
        return Check("root", "fail", f"cannot stat {root}: {exc.strerror}", "pick another root", details)
    details.update(uid=st.st_uid, mode=oct(stat.S_IMODE(st.st_mode)))
    untrusted = untrusted_reason(root, st, owner)  # what makes every read and write refuse the root
    if untrusted is not None:
        return Check("root", "fail", *untrusted, details)
    mode = stat.S_IMODE(st.st_mode)
    # Writable by others fails above; readable only leaks the data (a team root's group reads).
    if mode & (0o007 if owner is not None else 0o077):
        return Check(
            "root", "warn", f"{root} is mode {mode:04o}: other users may read the cache",
            f"chmod 700 {root} (unless you shared it with a group on purpose)", details,
        )
    if owner is not None:  # check_root already refused a member who cannot read it
        return Check("root", "ok", f"{root}: the team's (uid {owner[0]}, gid {owner[1]}), mode {mode:04o}",
                     "", details)
    if not os.access(root, os.R_OK | os.W_OK | os.X_OK):
        return Check(
            "root", "fail", f"{root} is mode {mode:04o}: you cannot use it", f"chmod 700 {root}", details
        )
    return Check("root", "ok", f"{root}: yours, mode {mode:04o}", "", details)


def _check_daemon(root: Path, socket_path: Path, team: str | None = None) -> tuple[Check, StoreStats | None]:
    """The daemon's health, and its stats (budget included) when it answers. A daemon that
    holds the root's pid file locked lives, even when it does not answer: that fails. A
    team's root is written through its daemon alone: none there is a warning."""
    details: dict[str, Any] = {"socket": str(socket_path)}
    if team is not None:
        none = Check(
            "daemon", "warn",
            f"team {team}'s daemon is not running ({socket_path}): reads work, but every put, "
            "cache() and evict of a member fails until it runs",
            f"ask an administrator to start it (systemctl start shmcache-team@{team})", details,
        ), None
    else:
        none = Check(
            "daemon", "ok",
            f"no daemon on {socket_path} (optional: reads never need it; `shmcache serve` shares loads)",
            "", details,
        ), None
    if not os.path.exists(socket_path) and not os.path.exists(Layout(root).pid_file):
        return none
    try:  # httpx: only when there is a socket or a pid file to probe
        from ..client import Client
        from ..client._liveness import live_daemon
    except ImportError as exc:  # pragma: no cover - httpx is a dependency; a --no-deps install
        return Check(
            "daemon", "warn", f"{socket_path} exists, but it cannot be probed ({exc.name} is missing)",
            "pip install httpx", details,
        ), None
    live = live_daemon(root)
    if live is not None:
        details["pid"] = live.pid
    if live is not None and not socket_path.exists():
        return Check(
            "daemon", "fail", f"daemon {live} lives (it holds {live.pid_file} locked) but has no socket "
            f"at {socket_path}",
            "it is starting or stopping, or listens on another socket (started with --socket): pass that "
            "path with --socket", details,
        ), None
    if not socket_path.exists():
        return none  # only a pid file a killed daemon left
    restart = "check the daemon's log; restart it with `shmcache serve`"
    try:
        with Client(root, timeout=_PROBE_TIMEOUT_S, socket=socket_path) as client:
            health = client.health()
            stats = client.stats()
    except DaemonUnavailableError as exc:
        if live is not None:
            pid = live.pid if live.pid is not None else f"$(cat {live.pid_file})"
            stopped = live.stopped
            return Check(
                "daemon", "fail",
                f"daemon {live} lives (it holds {live.pid_file} locked) but does not answer on {socket_path} "
                f"within {_PROBE_TIMEOUT_S:g} s" + (": it is stopped (SIGSTOP or Ctrl+Z)" if stopped else ""),
                (f"resume it: kill -CONT {pid}" if stopped else
                 f"it is hung or overloaded: check its log, or restart it (kill -TERM {pid}, then "
                 "`shmcache serve`)") + "; until then shmcache commands fail (--local works without it; "
                "the root's budget still holds)", details,
            ), None
        return Check(
            "daemon", "warn", f"{socket_path} exists but nothing answers ({exc.__cause__ or exc})",
            "a daemon died without cleaning up: start it again with `shmcache serve` "
            "(it replaces the stale socket)", details,
        ), None
    except UntrustedDaemonError as exc:  # another user listens on the socket: never trust it
        return Check(
            "daemon", "fail", str(exc),
            f"remove {socket_path} if it is not your daemon's, or point SHMCACHE_SOCKET at yours",
            details,
        ), None
    except ShmCacheError as exc:  # an error status, or an answer that is not JSON
        return Check(
            "daemon", "warn", f"daemon on {socket_path} failed GET /v1/health: {exc}", restart, details
        ), None
    except (TypeError, ValueError, AttributeError) as exc:  # JSON, but not a health record
        return Check(
            "daemon", "warn", f"daemon on {socket_path} answered GET /v1/health with no health record "
            f"({exc})", restart, details,
        ), None
    details.update(status=200, health=asdict(health))  # the Client returned: HTTP 200 OK
    return Check(
        "daemon", "ok",
        f"daemon pid {health.pid} (shmcache {health.version}) answers on {socket_path}, "
        f"up {health.uptime_s:.0f} s",
        "", details,
    ), stats


def _check_budget(stats: StoreStats) -> Check:
    """The root's budget: exceeded by the entries (fail), or larger than the file system
    it must fit in (warn)."""
    details = {
        "budget": stats.budget, "capacity": stats.capacity, "used": stats.used,
        "packed_held": stats.packed_held,
    }
    held = _packed_held_note(stats)
    if stats.over_budget and stats.budget is not None:
        return Check(
            "budget", "fail",
            f"the entries use {human_bytes(stats.used)}, more than the root's budget of "
            f"{human_bytes(stats.budget)} (over by {human_bytes(stats.used - stats.budget)}){held}",
            "the next put evicts least-recently-used entries that are neither pinned nor mapped; "
            "free space now with `shmcache evict KEY`, or raise the budget: `shmcache budget set SIZE`",
            details,
        )
    if stats.budget_warning is not None:
        return Check(
            "budget", "warn", stats.budget_warning,
            "lower the budget (`shmcache budget set SIZE`, or restart the daemon with a smaller "
            "--max-bytes or --max-fraction), or enlarge the tmpfs",
            details,
        )
    if stats.budget is None:
        return Check(
            "budget", "ok", f"no budget: puts are bounded by the file system only{held}", "", details
        )
    return Check(
        "budget", "ok",
        f"{human_bytes(stats.used)} used of the root's budget of {human_bytes(stats.budget)}, which fits "
        f"the file system ({human_bytes(stats.capacity)}){held}",
        "", details,
    )


def _packed_held_note(stats: StoreStats) -> str:
    """What directory puts' manifests hold beyond their entries (counted in ``used``), and
    what frees it; empty below 1 MiB (every manifest holds a few KiB of headers, alignment
    and page rounding beyond its entries: not worth a word after every put)."""
    if stats.packed_held < 1 << 20:
        return ""
    return (
        f"; {human_bytes(stats.packed_held)} of it is held by directory puts' manifests beyond their "
        "entries (mostly evicted packed entries, whose pages return only with their batch): evicting "
        "the rest of that directory put, or putting it again, frees it"
    )


def _root_stats(store: Store) -> tuple[StoreStats | None, Check | None]:
    """The root's stats read here (no daemon answers), or the failed check that says why not."""
    if not store.layout.root.is_dir():
        return None, None
    try:
        return store.stats(), None
    except (ShmCacheError, OSError) as exc:
        return None, Check("budget", "fail", f"cannot read the budget: {exc}", "see the message", {})


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


def _check_logout(root: Path) -> Check:
    risk = removeipc_risk(root)
    if risk is None:
        return Check("logout", "ok", "the cache outlives its owner's logout (no RemoveIPC risk)", "", {})
    return Check("logout", "warn", risk.summary, risk.fix, {"user": risk.user, "source": risk.source})


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


def run_checks(root: Path, socket_path: Path | None = None, team: str | None = None) -> list[Check]:
    """Every check of ``shmcache doctor``, in order (``socket_path``: the daemon's socket,
    default the root's; ``team``: ``root`` is that team's, checked as the teams file says)."""
    store = Store(root) if team is None else Store(team=team)
    try:
        entries = store.list() if store.layout.entries.is_dir() else []
    except Exception:  # an unreadable root is reported by the root check
        entries = []
    used = sum(entry.size for entry in entries)
    checks = [_note_partial(_check_space("shm", store.root, "the cache root"), store.layout)]
    shm = Path(SHM_DIR)
    if shm.is_dir() and _mount_of(shm)[0] != checks[0].details.get("mount"):
        checks.append(_check_space("dev_shm", shm, "torch's DataLoader batches"))
    tmpfs_capacity = checks[0].details.get("capacity")
    checks += [
        _check_cgroup(used, tmpfs_capacity if isinstance(tmpfs_capacity, int) else None),
        _check_root(store.root, store.layout.owner),
        _check_logout(store.root),
    ]
    daemon, daemon_stats = _check_daemon(
        store.root, socket_path if socket_path is not None else store.layout.socket, team
    )
    checks.append(daemon)
    stats, unreadable = (daemon_stats, None) if daemon_stats is not None else _root_stats(store)
    if stats is not None:
        checks.append(_check_budget(stats))
    elif unreadable is not None:
        checks.append(unreadable)
    checks += [
        _check_start_method(),
        _check_open_files(len(entries)),
        _check_overcommit(),
        Check("huge_pages", *huge_pages_report(store.root)),  # type: ignore[arg-type]
        _check_held(store),
        Check("gpu", *gpu_report(store.root)),  # type: ignore[arg-type]
    ]
    return checks
