"""``shmcache api-docs``: the daemon's OpenAPI schema as JSON, without a daemon.

The schema is what ``GET /openapi.json`` answers; a browser cannot reach the daemon's
Unix socket, and code generators and reviewers want the file anyway. It is built from
the application itself (FastAPI, from the service extra), with default settings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ..errors import ShmCacheError
from .common import fail, failures_exit_1

__all__ = ["register"]

_EXTRA = "pip install 'shmcache[service]'"


def register(app: typer.Typer) -> None:
    app.command("api-docs")(api_docs)


def api_docs(
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Write the schema to this file instead of stdout.", dir_okay=False),
    ] = None,
) -> None:
    """Print the daemon's OpenAPI schema (JSON), as GET /openapi.json serves it; no daemon needed.

    Needs the service extra: pip install 'shmcache\\[service]'.
    """
    try:  # FastAPI only now
        from ..service.app import openapi_schema
    except ImportError as exc:
        raise fail(
            ShmCacheError(f"shmcache api-docs needs the service extra ({exc.name} is missing): {_EXTRA}")
        ) from None
    text = json.dumps(openapi_schema(), indent=2) + "\n"
    if out is None:
        typer.echo(text, nl=False)
        return
    with failures_exit_1():
        out.write_text(text, encoding="utf-8")
    typer.echo(f"wrote {out}", err=True)
