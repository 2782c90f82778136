"""``shmcache serve``: run the daemon (the service extra is imported only when it runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import ShmCacheError

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Add the ``serve`` command to ``app``."""
    app.command()(serve)


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
    from ..cli import _fail, _state  # temporary: the shared CLI helpers move to _cli/app.py

    try:  # lazily: the rest of the CLI never loads FastAPI or uvicorn
        from ..service import SettingsError, load_settings
        from ..service import serve as run_daemon
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
