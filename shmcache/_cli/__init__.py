"""The ``shmcache`` command, one module per job: ``app`` (the Typer app, ``--debug``,
``main``), ``common`` (failing with one line, tables), ``options`` (shared options),
``backend`` (the daemon or this process, chosen once per command), ``entries``
(put/ls/info/evict/cleanup/stats/verify), ``demo``, ``serve`` (the daemon), ``api_docs``
(its OpenAPI schema), ``diagnose`` (doctor/top/watch) and ``root`` (the root, for scripts).
The public entry point is :mod:`shmcache.cli`."""

from __future__ import annotations

__all__: list[str] = []
