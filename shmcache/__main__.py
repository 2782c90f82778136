"""``python -m shmcache``: the ``shmcache`` command."""

from __future__ import annotations

from .cli import main

__all__: list[str] = []

if __name__ == "__main__":
    main()
