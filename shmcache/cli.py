"""The ``shmcache`` command: put, list, inspect, evict and clean up a cache root.

Every command takes ``--root`` (default: ``$SHMCACHE_ROOT`` or ``/dev/shm/shmcache-<uid>``).
Exit codes: 0 ok, 1 the operation failed (message, no traceback unless ``--debug``),
2 usage error.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer

from ._root import ENV_ROOT
from ._store import Store
from ._units import human_bytes
from .errors import ShmCacheError

__all__ = ["app", "main"]

app = typer.Typer(
    name="shmcache",
    help="Shared-memory dataset cache for PyTorch: load once into /dev/shm, open everywhere.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

RootOption = Annotated[
    Path | None,
    typer.Option(
        "--root",
        envvar=ENV_ROOT,
        help="Cache root (default: $SHMCACHE_ROOT or /dev/shm/shmcache-<uid>).",
        show_default=False,
    ),
]

_state: dict[str, bool] = {"debug": False}


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


@app.command()
def put(
    path: Annotated[Path, typer.Argument(help="A .npy or .npz file, or a directory of them.")],
    key: Annotated[str, typer.Option("--key", "-k", help="Key (a directory puts key/<relative path>).")],
    root: RootOption = None,
    pin: Annotated[bool, typer.Option(help="Never evict it to stay within a budget.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace existing entries.")] = False,
) -> None:
    """Load PATH into the cache under KEY (in this process; the daemon comes later)."""
    try:
        keys = Store(root).put_file(key, path, overwrite=overwrite, pin=pin)
    except (ShmCacheError, OSError) as exc:
        raise _fail(exc) from None
    for published in keys:
        typer.echo(published)


@app.command("ls")
def list_command(
    prefix: Annotated[str | None, typer.Argument(help="Only keys under this prefix.")] = None,
    root: RootOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List entries: key, kind, dtype, shape, size, pinned, age."""
    try:
        entries = Store(root).list(prefix)
    except ShmCacheError as exc:
        raise _fail(exc) from None
    if as_json:
        typer.echo(json.dumps([asdict(e) for e in entries], indent=1))
        return
    now = time.time()
    rows = [
        (e.key, e.kind, e.dtype or "", "x".join(map(str, e.shape or ())) or "()", human_bytes(e.size),
         "yes" if e.pinned else "", _age(now - e.created))
        for e in entries
    ]
    _print_table(("KEY", "KIND", "DTYPE", "SHAPE", "SIZE", "PINNED", "AGE"), rows)


@app.command()
def info(key: str, root: RootOption = None) -> None:
    """Show one entry's metadata as JSON."""
    try:
        typer.echo(json.dumps(asdict(Store(root).info(key)), indent=1))
    except ShmCacheError as exc:
        raise _fail(exc) from None


@app.command()
def evict(
    keys: Annotated[list[str], typer.Argument(help="Keys to remove.")],
    root: RootOption = None,
) -> None:
    """Remove entries; processes that mapped them keep reading their version."""
    store = Store(root)
    failed = False
    for key in keys:
        try:
            freed = store.evict(key)
            typer.echo(f"evicted {key} ({human_bytes(freed)})")
        except ShmCacheError as exc:
            typer.echo(f"error: {exc}", err=True)
            failed = True
    if failed:
        raise typer.Exit(1)


@app.command()
def cleanup(root: RootOption = None) -> None:
    """Remove partial writes and orphans left by dead writers."""
    try:
        freed = Store(root).cleanup()
    except ShmCacheError as exc:
        raise _fail(exc) from None
    typer.echo(f"freed {human_bytes(freed)}")


@app.command()
def stats(
    root: RootOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Capacity, use and entry count of the cache root."""
    try:
        result = Store(root).stats()
    except ShmCacheError as exc:
        raise _fail(exc) from None
    if as_json:
        typer.echo(json.dumps(asdict(result), indent=1))
        return
    budget = human_bytes(result.budget) if result.budget is not None else "none"
    typer.echo(f"root:     {result.root}")
    typer.echo(f"entries:  {result.entries}")
    typer.echo(f"used:     {human_bytes(result.used)}  (budget {budget})")
    typer.echo(f"free:     {human_bytes(result.free)} of {human_bytes(result.capacity)}")


@app.command()
def serve(
    root: Annotated[
        Path | None,
        typer.Option("--root", help="Cache root (env: SHMCACHE_ROOT; default /dev/shm/shmcache-<uid>).",
                     show_default=False),
    ] = None,
    socket_path: Annotated[
        Path | None,
        typer.Option("--socket", help="Unix socket path (env: SHMCACHE_SOCKET; default <root>/daemon.sock).",
                     show_default=False),
    ] = None,
    max_bytes: Annotated[
        str | None,
        typer.Option("--max-bytes", help="Budget, e.g. 32GiB: loads evict least-recently-used unpinned, "
                     "unmapped entries to stay within it (env: SHMCACHE_MAX_BYTES).", show_default=False),
    ] = None,
    max_fraction: Annotated[
        float | None,
        typer.Option("--max-fraction", help="Budget as a fraction of the root's file system, e.g. 0.5 "
                     "(env: SHMCACHE_MAX_FRACTION).", show_default=False),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", show_default=False,
                     help="TOML config file: root, max_bytes, allow_source, datasets to preload... "
                     "(env: SHMCACHE_CONFIG)."),
    ] = None,
    host: Annotated[
        str | None,
        typer.Option("--host", help="Also listen on TCP at this address (needs --port and --allow-source; "
                     "a non-loopback address needs --token) (env: SHMCACHE_HOST).", show_default=False),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option("--port", help="TCP port (0 picks a free one) (env: SHMCACHE_PORT).",
                     show_default=False),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option("--token", help="Bearer token TCP clients must send; prefer SHMCACHE_TOKEN (a flag is "
                     "visible in ps).", show_default=False),
    ] = None,
    allow_source: Annotated[
        list[Path] | None,
        typer.Option("--allow-source", help="Directory the API may load from (repeatable; symlinks and .. "
                     "are resolved first) (env: SHMCACHE_ALLOW_SOURCE, ':'-separated).",
                     show_default=False),
    ] = None,
    cleanup_on_exit: Annotated[
        bool,
        typer.Option("--cleanup-on-exit",
                     help="Evict every entry when stopping (env: SHMCACHE_CLEANUP_ON_EXIT)."),
    ] = False,
    load_workers: Annotated[
        int | None,
        typer.Option("--load-workers", show_default=False,
                     help="Loads that run at once (default 2) (env: SHMCACHE_LOAD_WORKERS)."),
    ] = None,
    max_load_rate: Annotated[
        str | None,
        typer.Option("--max-load-rate", help="Bytes per second per load, e.g. 500MiB, to leave memory "
                     "bandwidth to training (default: unlimited) (env: SHMCACHE_MAX_LOAD_RATE).",
                     show_default=False),
    ] = None,
    log_level: Annotated[
        str | None,
        typer.Option("--log-level", help="debug, info (default), warning or error (env: SHMCACHE_LOG_LEVEL).",
                     show_default=False),
    ] = None,
) -> None:
    """Run the daemon: the HTTP control API of the cache, on <root>/daemon.sock (mode 0600).

    Only processes of the daemon's user (or root) may use the socket. TCP (--host/--port)
    is opt-in and needs --allow-source; a non-loopback address also needs a token.

    Settings: flags > SHMCACHE_* environment > config file > defaults. Stops on SIGTERM or
    SIGINT: running loads are cancelled (nothing partial is published), the socket and
    pid file are removed. Needs the service extra: pip install 'shmcache\\[service]'.
    """
    try:  # lazily: the rest of the CLI never loads FastAPI or uvicorn
        from .service import SettingsError, load_settings
        from .service import serve as run_daemon
    except ImportError as exc:
        raise _fail(ShmCacheError(
            f"shmcache serve needs the service extra ({exc.name} is missing): pip install 'shmcache[service]'"
        )) from None
    cli_values = {
        "root": root, "socket": socket_path, "max_bytes": max_bytes, "max_fraction": max_fraction,
        "host": host, "port": port, "token": token, "allow_source": allow_source,
        "cleanup_on_exit": cleanup_on_exit, "load_workers": load_workers, "max_load_rate": max_load_rate,
        "log_level": log_level,
    }
    try:
        settings = load_settings(cli_values, config_file=config)
    except SettingsError as exc:
        if _state["debug"]:
            raise
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        status = run_daemon(settings)
    except (ShmCacheError, OSError) as exc:
        raise _fail(exc) from None
    raise typer.Exit(status)


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
