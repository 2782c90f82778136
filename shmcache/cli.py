"""The ``shmcache`` command: put, list, inspect, evict and clean up a cache root.

Every command takes ``--root`` (default: ``$SHMCACHE_ROOT`` or ``/dev/shm/shmcache-<uid>``).
Exit codes: 0 ok, 1 the operation failed (message, no traceback unless ``--debug``),
2 usage error.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ._cli_options import RootOption
from ._disk.keys import validate_key
from ._disk.layout import default_root
from ._store import Store, StoreStats
from ._units import human_bytes
from .errors import (
    CorruptEntryError,
    InvalidKeyError,
    KeyExistsError,
    KeyNotFoundError,
    ShmCacheError,
    SourceNotFoundError,
)

if TYPE_CHECKING:
    from rich.progress import Progress

    from .client import Client, Job

__all__ = ["app", "main"]

app = typer.Typer(
    name="shmcache",
    help="Shared-memory dataset cache for PyTorch: load once into /dev/shm, open everywhere.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


_state: dict[str, bool] = {"debug": False}
_ENV_SOCKET = "SHMCACHE_SOCKET"
_DAEMON_TIMEOUT_S = 30.0


@app.callback()
def _options(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
) -> None:
    _state["debug"] = debug


def _fail(exc: BaseException) -> typer.Exit:
    if _state["debug"]:
        raise exc
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(1)


# ---------------------------------------------------------------------- the daemon, when one runs


def _daemon(root: Path | None) -> Client | None:
    """A client of the daemon serving this root, or None when none answers there.

    The socket is ``$SHMCACHE_SOCKET`` or ``<root>/daemon.sock``,
    as for ``shmcache serve``; a daemon there that serves another root does not count.
    """
    resolved = Path(os.path.abspath(root if root is not None else default_root()))
    socket_path = os.environ.get(_ENV_SOCKET) or str(resolved / "daemon.sock")
    client = None
    if os.path.exists(socket_path):  # cheap test first: no httpx import, no connection
        try:
            from .client import Client
        except ImportError:  # pragma: no cover - httpx is a dependency; a --no-deps install
            typer.echo(f"notice: httpx is not installed, so not talking to the daemon on {resolved}",
                       err=True)
        else:
            client = Client(resolved, timeout=_DAEMON_TIMEOUT_S)
            try:
                served: str | None = client.health().root
            except ShmCacheError:
                served = None
            if served is None or os.path.abspath(served) != str(resolved):
                client.close()
                client = None
    return client


@contextmanager
def _failures_exit_1() -> Iterator[None]:
    """Turn an operation's error into a one-line message and exit status 1."""
    try:
        yield
    except (ShmCacheError, OSError) as exc:
        raise _fail(exc) from None


# ---------------------------------------------------------------------- put


def _sources(path: str, key: str) -> list[tuple[str, Path]]:
    """``(key, source)`` pairs for PATH: itself if it exists, else the matches of a glob,
    each under ``key/<name without .npy/.npz>``."""
    validate_key(key)
    literal = Path(path).expanduser()
    if literal.exists() or not glob.has_magic(path):
        return [(key, literal)]
    matches = sorted(glob.glob(os.path.expanduser(path)))
    if not matches:
        raise SourceNotFoundError(f"no file or directory matches {path!r}")
    pairs: dict[str, Path] = {}
    for match in matches:
        name = Path(match).name
        stem = name.rsplit(".", 1)[0] if Path(match).suffix in (".npy", ".npz") else name
        child = validate_key(f"{key}/{stem}")
        if child in pairs:
            raise InvalidKeyError(
                f"{pairs[child]} and {match} would both be put as {child!r}; narrow the pattern"
            )
        pairs[child] = Path(match)
    return list(pairs.items())


def _progress_bar(enabled: bool | None) -> Progress:
    """A byte progress bar on stderr (shown on a terminal, or always with --progress)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    console = Console(stderr=True, force_terminal=True if enabled else None)
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=enabled is False or not console.is_terminal,
        transient=False,
    )


@app.command()
def put(
    path: Annotated[
        str,
        typer.Argument(
            help="A .npy or .npz file, a directory of them, or a quoted glob ('data/*.npy'): each "
            "match goes under KEY/<name without .npy/.npz>.",
            show_default=False,
            metavar="PATH",
        ),
    ],
    key: Annotated[
        str,
        typer.Option("--key", "-k", help="Key (a directory puts KEY/<relative path>).", show_default=False),
    ],
    root: RootOption = None,
    pin: Annotated[bool, typer.Option("--pin", help="Never evict it to stay within a budget.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace existing entries.")] = False,
    progress: Annotated[
        bool | None,
        typer.Option("--progress/--no-progress", help="Byte progress bar on stderr (default: on a terminal).",
                     show_default=False),
    ] = None,
) -> None:
    """Load PATH into the cache under KEY and print the keys published.

    Through the daemon when one serves the root (its budget applies;
    Ctrl+C cancels the load), else in this process, with a notice.
    Nothing partial is ever published.
    """
    from .client import JobCancelledError, error_from_body

    with _failures_exit_1():
        sources = _sources(path, key)
    bar, title = _progress_bar(progress), f"put {key}"
    client = _daemon(root)
    try:
        if client is None:
            with _failures_exit_1():
                published = _put_here(Store(root), sources, pin, overwrite, bar, title)
        else:
            with client, _failures_exit_1():
                jobs = _put_through(client, sources, pin, overwrite, bar, title)
            published = [published_key for job in jobs for published_key in job.keys]
            failed = [job for job in jobs if job.state != "done"]
            for published_key in published:
                typer.echo(published_key)
            for job in failed:
                if job.state == "cancelled" or job.error is None:
                    error: ShmCacheError = JobCancelledError(f"load of {job.key!r} was cancelled")
                else:
                    error = error_from_body(job.error.type, job.error.detail)
                if _state["debug"]:
                    raise error
                typer.echo(f"error: {error}" if len(jobs) == 1 else f"error: {job.key}: {error}", err=True)
            if failed:
                raise typer.Exit(1)
            return
    except KeyboardInterrupt:
        typer.echo("interrupted: the load was cancelled; nothing partial was published", err=True)
        raise typer.Exit(130) from None
    for published_key in published:
        typer.echo(published_key)


def _put_through(
    client: Client, sources: list[tuple[str, Path]], pin: bool, overwrite: bool, bar: Progress, title: str
) -> list[Job]:
    """Submit one load per source, follow them on the bar; Ctrl+C (or a refused source)
    cancels those already submitted. Returns the finished jobs."""
    jobs: list[Job] = []
    try:
        for key, source in sources:
            jobs.append(client.load(key, source, pin=pin, overwrite=overwrite))
        with bar:
            task = bar.add_task(title, total=None)
            delay = 0.01
            while True:
                jobs = [client.job(job.id) if job.active else job for job in jobs]
                totals = [job.bytes_total for job in jobs]
                known = all(t is not None for t in totals)
                bar.update(task, completed=sum(job.bytes_done for job in jobs),
                           total=sum(t or 0 for t in totals) if known else None)
                if not any(job.active for job in jobs):
                    return jobs
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
    except BaseException:
        _cancel(client, jobs, sources)
        raise


def _cancel(client: Client, jobs: Sequence[Job], sources: Sequence[tuple[str, Path]]) -> None:
    """Cancel our loads: those submitted, and any still active for our keys and sources
    (Ctrl+C may land after the daemon queued a load but before we read its answer)."""
    try:  # an interrupted request may have left the connection half-read: start afresh
        client.close()
    except Exception:
        pass
    ours = {
        (key, path) for key, source in sources for path in (os.path.abspath(source), os.path.realpath(source))
    }
    try:
        active = [job for job in client.jobs() if job.active and (job.key, job.source) in ours]
    except ShmCacheError:
        active = []
    for job_id in dict.fromkeys([job.id for job in jobs if job.active] + [job.id for job in active]):
        try:
            client.cancel(job_id)
        except ShmCacheError:
            pass  # finished meanwhile, or the daemon is gone: nothing left to stop


def _put_here(
    store: Store, sources: list[tuple[str, Path]], pin: bool, overwrite: bool, bar: Progress, title: str
) -> list[str]:
    """Validate every source first (nothing is copied if one is bad), then put them."""
    plans = [(key, source, store.plan_file(key, source)) for key, source in sources]
    if not overwrite:
        for _, _, plan in plans:
            for entry in plan:
                if store.exists(entry.key):
                    raise KeyExistsError(
                        f"entry {entry.key!r} already exists; pass --overwrite to replace it, "
                        "or evict it first"
                    )
    typer.echo(f"notice: no daemon on {store.root}; loading in this process", err=True)
    published: list[str] = []
    with bar:
        task = bar.add_task(title, total=sum(entry.size for _, _, plan in plans for entry in plan))
        offset = 0
        for key, source, plan in plans:
            def advance(done: int, _total: int, base: int = offset) -> None:
                bar.update(task, completed=base + done)

            published += store.put_file(key, source, overwrite=overwrite, pin=pin, progress=advance)
            offset += sum(entry.size for entry in plan)
    return published


# ---------------------------------------------------------------------- inspect


def _mapped_by(root: Path | None) -> dict[str, list[int]]:
    """Version -> PIDs of live processes mapping it (one /proc scan, in this process)."""
    try:
        scan = Store(root).scan_mappings()
    except OSError:
        return {}
    return {version: sorted(pids) for version, pids in scan.pids_by_version.items()}


def _show_pids(pids: Sequence[int]) -> str:
    if len(pids) > 3:
        return f"{len(pids)} pids"
    return ",".join(map(str, pids))


@app.command("ls")
def list_command(
    prefix: Annotated[
        str | None, typer.Argument(help="Only PREFIX and keys under PREFIX/.", metavar="PREFIX")
    ] = None,
    root: RootOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List entries: key, kind, dtype, shape, size, pinned, mapped by (PIDs), age."""
    client = _daemon(root)
    with _failures_exit_1():
        if client is not None:
            with client:
                entries = client.list(prefix)
        else:
            entries = Store(root).list(prefix)
    mapped = _mapped_by(root)
    if as_json:
        typer.echo(json.dumps([{**asdict(e), "mapped_by": mapped.get(e.version, [])} for e in entries],
                              indent=1))
        return
    now = time.time()
    rows = [
        (e.key, e.kind, e.dtype or "", "x".join(map(str, e.shape or ())) or "()", human_bytes(e.size),
         "yes" if e.pinned else "", _show_pids(mapped.get(e.version, [])), _age(now - e.created))
        for e in entries
    ]
    _print_table(("KEY", "KIND", "DTYPE", "SHAPE", "SIZE", "PINNED", "MAPPED BY", "AGE"), rows)


@app.command()
def info(
    key: Annotated[str, typer.Argument(help="The entry's key.", show_default=False, metavar="KEY")],
    root: RootOption = None,
) -> None:
    """Show one entry's metadata as JSON, with mapped_by: PIDs of live processes mapping it."""
    client = _daemon(root)
    with _failures_exit_1():
        if client is not None:
            with client:
                detail: dict[str, Any] = asdict(client.info(key))
                detail["mapped_by"] = list(detail["mapped_by"])
        else:
            store = Store(root)
            entry = store.info(key)
            pids = store.scan_mappings().pids_by_version.get(entry.version, set())
            detail = {**asdict(entry), "mapped_by": sorted(pids)}
    typer.echo(json.dumps(detail, indent=1))


@app.command()
def evict(
    keys: Annotated[list[str], typer.Argument(help="Keys to remove (prefixes with --prefix).",
                                             show_default=False, metavar="KEY")],
    root: RootOption = None,
    prefix: Annotated[
        bool, typer.Option("--prefix", help="Evict every entry that is KEY or lies under KEY/.")
    ] = False,
) -> None:
    """Remove entries; processes that mapped them keep reading their version."""
    client = _daemon(root)
    store = Store(root)
    evict_one = client.evict if client is not None else store.evict
    list_under = client.list if client is not None else store.list
    failed = False
    for key in keys:
        try:
            if prefix:
                targets = [entry.key for entry in list_under(key)]
                if not targets:
                    raise KeyNotFoundError(f"no entry is {key!r} or lies under {key + '/'!r}")
            else:
                targets = [key]
            for target in targets:
                freed = evict_one(target)
                typer.echo(f"evicted {target} ({human_bytes(freed)})")
        except ShmCacheError as exc:
            if _state["debug"]:
                raise
            typer.echo(f"error: {exc}", err=True)
            failed = True
    if client is not None:
        client.close()
    if failed:
        raise typer.Exit(1)


@app.command()
def cleanup(root: RootOption = None) -> None:
    """Remove partial writes and orphans left by dead writers."""
    client = _daemon(root)
    with _failures_exit_1():
        if client is not None:
            with client:
                freed = client.cleanup()
        else:
            freed = Store(root).cleanup()
    typer.echo(f"freed {human_bytes(freed)}")


@app.command()
def stats(
    root: RootOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Capacity, use, budget and entry count of the cache root (and the daemon's jobs)."""
    client = _daemon(root)
    with _failures_exit_1():
        if client is not None:
            with client:
                result: StoreStats = client.stats()
        else:
            result = Store(root).stats()
    if as_json:
        typer.echo(json.dumps({**asdict(result), "daemon": client is not None}, indent=1))
        return
    budget = human_bytes(result.budget) if result.budget is not None else "none"
    typer.echo(f"root:     {result.root}")
    typer.echo(f"daemon:   {'running' if client is not None else 'not running'}")
    typer.echo(f"entries:  {result.entries}")
    typer.echo(f"used:     {human_bytes(result.used)}  (budget {budget})")
    typer.echo(f"free:     {human_bytes(result.free)} of {human_bytes(result.capacity)}")
    held = getattr(result, "held_by_readers_bytes", None)
    if held is not None:
        typer.echo(f"held:     {human_bytes(held)} of evicted/replaced entries still mapped by readers")
        typer.echo(f"jobs:     {getattr(result, 'jobs_running', 0)} running, "
                   f"{getattr(result, 'jobs_queued', 0)} queued")


@app.command()
def verify(
    key: Annotated[
        str | None, typer.Argument(help="One entry (default: every entry).", metavar="KEY")
    ] = None,
    root: RootOption = None,
) -> None:
    """Check entries against the checksums recorded when they were put.

    One line per entry: ok, no checksum, or CORRUPT (then exit status 1:
    evict the entry and put it again). Reads every byte, in this process.
    """
    store = Store(root)
    with _failures_exit_1():
        keys = [key] if key is not None else [entry.key for entry in store.list()]
    corrupt = 0
    for name in keys:
        try:
            status = "ok" if store.verify(name) else "no checksum"
        except CorruptEntryError as exc:
            corrupt += 1
            typer.echo(f"CORRUPT      {name}: {exc}")
            continue
        except KeyNotFoundError as exc:
            if key is not None:
                raise _fail(exc) from None
            continue  # evicted while we went through the list
        except (ShmCacheError, OSError) as exc:
            raise _fail(exc) from None
        typer.echo(f"{status:<12} {name}")
    if corrupt:
        typer.echo(f"error: {corrupt} corrupt entr{'y' if corrupt == 1 else 'ies'}", err=True)
        raise typer.Exit(1)


@app.command()
def demo(
    root: RootOption = None,
    rows: Annotated[int, typer.Option(help="Rows of the demo feature matrix.")] = 100_000,
) -> None:
    """Put a demo dataset into the cache and read it from 2 spawned workers.

    The workers receive a pickled reference to the shared entry, not a copy.
    """
    import multiprocessing as mp

    import numpy as np

    store = Store(root)
    features = np.random.default_rng(0).standard_normal((rows, 64), dtype=np.float32)
    info = store.put_array("demo/features", features, overwrite=True)
    typer.echo(f"put demo/features: {info.shape} {info.dtype}, {human_bytes(info.nbytes)} in {store.root}")
    shared = store.open_array("demo/features")
    start = time.perf_counter()
    with mp.get_context("spawn").Pool(2) as pool:
        sums = pool.map(_row_sum, [(shared, i) for i in (0, rows // 2, rows - 1)])
    elapsed = time.perf_counter() - start
    expected = [float(features[i].sum()) for i in (0, rows // 2, rows - 1)]
    typer.echo(f"2 spawn workers read rows through a pickled reference in {elapsed:.2f} s")
    if not np.allclose(sums, expected):
        raise _fail(ShmCacheError(f"demo read back {sums}, expected {expected}"))
    typer.echo("ok: workers saw the same data.")
    typer.echo("next: shmcache ls; shmcache stats; shmcache evict demo/features")


def _row_sum(args: tuple[Any, int]) -> float:
    array, row = args
    return float(array[row].sum())


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def _print_table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    for line in (header, *rows):
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=False)).rstrip())


def main() -> None:
    """Console entry point."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
from ._cli.serve import register as _register_serve  # noqa: E402
from ._cli_diagnose import register as _register_diagnostics  # noqa: E402

_register_serve(app)
_register_diagnostics(app)
