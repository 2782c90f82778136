"""The ``shmcache`` command's public entry point (``shmcache.cli:main``); the commands
live in :mod:`shmcache._cli`."""

from __future__ import annotations

from ._cli.app import app, main

__all__ = ["app", "main"]
