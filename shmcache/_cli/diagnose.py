"""``shmcache doctor``, ``top`` and ``watch``: why is memory where it is, and is it growing.

Registered on the main Typer app by :func:`register`; the logic lives in ``shmcache._diagnose``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer

from .._store import Store
from .._units import human_bytes
from ..errors import ShmCacheError
from .backend import command_team, local_store, resolve_root
from .common import fail, print_table
from .options import JsonOption, RootOption, SocketOption

__all__ = ["register"]

_Snapshot = Callable[[], tuple[list[str], list[tuple[str, ...]], str]]
_README_FIX = 'README, "Fixing DataLoader memory growth": keep big Python lists/dicts in shmcache.share(...)'
_TRACEMALLOC_HINT = (
    "For Python objects, tracemalloc says which lines allocated what stays: tracemalloc.start() "
    "(or PYTHONTRACEMALLOC=1), take tracemalloc.take_snapshot() twice and print "
    "later.compare_to(earlier, 'lineno')[:10]"
)
_PLOT_INSTALL = "pip install 'shmcache[plot]'; from a checkout: pip install -e '.[plot]'"


def register(app: typer.Typer) -> None:
    """Add ``doctor``, ``top`` and ``watch`` to ``app``."""
    app.command()(doctor)
    app.command()(top)
    app.command(context_settings={"allow_interspersed_args": False})(watch)


def doctor(
    root: RootOption = None,
    socket_path: SocketOption = None,
    as_json: JsonOption = False,
) -> None:
    """Check the machine for what breaks shared-memory caches, and say how to fix it.

    /dev/shm size and free space (Docker's 64 MB default), a cgroup memory limit below the
    cache, root ownership and mode, the daemon, the multiprocessing start method,
    `ulimit -n`, vm.overcommit. Exit code 1 if any check fails.
    """
    from .._diagnose.doctor import run_checks

    team = command_team(root)
    if team is None:
        checks = run_checks(Store(root).root, socket_path)
    else:
        checks = run_checks(team.root, socket_path, team=team.name)
    failed = any(c.status == "fail" for c in checks)
    if as_json:
        report = {"ok": not failed, "checks": [asdict(c) for c in checks]}
        typer.echo(json.dumps(report, indent=1, default=str))
    else:
        labels = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}
        width = max(len(c.name) for c in checks)
        for check in checks:
            typer.echo(f"{labels[check.status]}  {check.name.ljust(width)}  {check.summary}")
            if check.fix:
                typer.echo(f"      {' ' * width}  fix: {check.fix}")
        counts = {s: sum(c.status == s for c in checks) for s in ("ok", "warn", "fail")}
        typer.echo(f"{counts['ok']} ok, {counts['warn']} warnings, {counts['fail']} failed")
    if failed:
        raise typer.Exit(1)


def top(
    root: RootOption = None,
    once: Annotated[bool, typer.Option("--once", help="Print one snapshot and exit.")] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between refreshes.")] = 2.0,
) -> None:
    """Processes that map cache entries: pid, entries, RSS, PSS, USS, cache PSS, command.

    Sorted by PSS. PSS divides each shared page among the processes that map it, so
    summing PSS counts the cache once however many processes read it; CACHE is the part
    of PSS that is the cache's pages. Refreshes until Ctrl+C unless --once.
    """
    from .._diagnose.top import mapping_processes

    store = local_store(root)

    def snapshot() -> tuple[list[str], list[tuple[str, ...]], str]:
        rows, held = mapping_processes(store)
        header = ["PID", "ENTRIES", "RSS", "PSS", "USS", "CACHE", "COMMAND"]
        table: list[tuple[str, ...]] = [
            (str(r.pid), _entries_cell(r.entries), human_bytes(r.memory.rss), human_bytes(r.memory.pss),
             human_bytes(r.memory.uss), human_bytes(r.memory.cache_pss), r.command)
            for r in rows
        ]
        total = sum(r.memory.pss for r in rows)
        cache = sum(r.memory.cache_pss for r in rows)
        footer = (
            f"{len(rows)} processes map entries of {store.root}: total PSS {human_bytes(total)}, "
            f"of which cache pages {human_bytes(cache)}"
        )
        if held:
            footer += f"; evicted entries still held: {human_bytes(held)}"
        return header, table, footer

    try:
        if once or not sys.stdout.isatty():
            while True:
                header, table, footer = snapshot()
                print_table(header, table)
                typer.echo(footer)
                if once:
                    return
                time.sleep(interval)
                typer.echo("")
        _live_top(snapshot, interval)
    except ShmCacheError as exc:
        raise fail(exc) from None
    except KeyboardInterrupt:
        return


def _live_top(snapshot: _Snapshot, interval: float) -> None:
    from rich.live import Live
    from rich.table import Table

    def render() -> Table:
        header, rows, footer = snapshot()
        table = Table(*header, caption=footer, caption_justify="left")
        for row in rows:
            table.add_row(*row)
        return table

    with Live(render(), auto_refresh=False, screen=False) as live:
        while True:
            time.sleep(interval)
            live.update(render(), refresh=True)


def watch(
    command: Annotated[list[str], typer.Argument(help="The command to run, after --.", show_default=False)],
    interval: Annotated[float, typer.Option("--interval", min=0.05, help="Seconds between samples.")] = 1.0,
    out: Annotated[
        Path, typer.Option("--out", help="Directory for the CSV and the PNG (created if needed).")
    ] = Path("shmcache-watch"),
    root: RootOption = None,
) -> None:
    """Run COMMAND and sample the memory of its whole process tree (DataLoader workers too).

    Writes a CSV (time_s, pid, ppid, cmd, rss, pss, uss, own, cache_pss; bytes) while it runs and a
    PNG of USS/PSS per process at the end (needs the plot extra), then prints a verdict per
    process: flat, or growing at N MiB/min (judged on `own`, private anonymous memory, after a
    3 s warm-up: growing means >= 2 MiB/min and >= 8 MiB in total). Each process is sampled
    every 0.2 s in its first 3 s, so a short-lived forked worker is judged on its whole life:
    growing if it copied a tenth of what it inherited. The exit code is COMMAND's; Ctrl+C
    reaches COMMAND. Example: shmcache watch -- python train.py
    """
    from .._diagnose.growth import GROWTH_MIN_BYTES, SLOPE_MIN_BYTES_PER_MIN, WARMUP_S
    from .._diagnose.watch import WatchRecorder

    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    csv_path = out / f"watch-{stamp}-{os.getpid()}.csv"
    png_path = csv_path.with_suffix(".png")
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        typer.echo(f"error: cannot run {command[0]!r}: {exc.strerror or exc}", err=True)
        raise typer.Exit(127 if isinstance(exc, FileNotFoundError) else 126) from None
    started = time.monotonic()
    recorder = WatchRecorder(csv_path, started, resolve_root(root), interval)
    previous = _forward_signals(child)
    try:
        while True:
            now = time.monotonic()
            recorder.sample(child.pid, now)
            try:  # at least as long as the round took: the reads never take more than half a core
                child.wait(timeout=max(recorder.tick, time.monotonic() - now))
                break
            except subprocess.TimeoutExpired:
                continue
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        recorder.close()
    code = child.returncode if child.returncode >= 0 else 128 - child.returncode
    elapsed = time.monotonic() - started

    def say(text: str) -> None:
        typer.echo(f"shmcache watch: {text}", err=True)

    fast = f" (every {recorder.tick:g} s in its first {WARMUP_S:g} s)" if recorder.tick < interval else ""
    say(f"{' '.join(command)} exited with {code} after {elapsed:.1f} s; "
        f"{len(recorder.series)} processes, each sampled every {interval:g} s{fast}")
    copying = own_heap = 0
    for series, verdict in sorted(recorder.verdicts(), key=lambda sv: sv[0].pid):
        role = "main" if series.pid == child.pid else f"child of {series.ppid}"
        peak = max(m.uss for m in series.memories)
        say(f"pid {series.pid} ({role}, peak USS {human_bytes(peak)}): {verdict.describe()}")
        if verdict.state in ("growing", "stepped"):
            if verdict.forked or verdict.workers_copied:
                copying += 1
            else:
                own_heap += 1
    if copying:
        say(f"{copying} growing or grown: private memory that rises while a DataLoader iterates is usually "
            f"copy-on-write of Python objects in the Dataset. Fix: {_README_FIX}")
    if own_heap:
        say(f"{own_heap} growing on {'its' if own_heap == 1 else 'their'} own heap, with no forked worker "
            f"copying from {'it' if own_heap == 1 else 'them'}: a leak in the program, not copy-on-write. "
            f"{_TRACEMALLOC_HINT}")
    say(f"csv: {csv_path}")
    if recorder.plot(png_path, " ".join(command)):
        say(f"plot: {png_path}")
    else:
        say(f"plot skipped: matplotlib is not installed ({_PLOT_INSTALL})")
    say(f"(thresholds: growing = slope >= {SLOPE_MIN_BYTES_PER_MIN >> 20} MiB/min and >= "
        f"{GROWTH_MIN_BYTES >> 20} MiB after a {WARMUP_S:g} s warm-up, on private anonymous memory)")
    raise typer.Exit(code)


def _forward_signals(child: subprocess.Popen[bytes]) -> dict[int, Any]:
    """SIGINT/SIGTERM to watch go to the child (which decides how to stop); a Ctrl+C typed
    in the terminal already reached it (same foreground process group), so it is not sent
    twice."""

    def forward(signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and _terminal_delivers_to_us():
            return
        try:
            child.send_signal(signum)
        except OSError:
            pass

    previous: dict[int, Any] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, forward)
    return previous


def _terminal_delivers_to_us() -> bool:
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def _entries_cell(keys: list[str]) -> str:
    shown = ", ".join(keys[:3])
    return f"{len(keys)}: {shown}" + (", …" if len(keys) > 3 else "")

