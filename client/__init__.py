"""Thin client of the shmcache daemon (HTTP control plane) and torch helpers.

Installed as ``shmcache.client``; needs the ``client`` extra. Not implemented yet:
reads never need it (``shmcache.open_array`` talks to the file system directly).
"""

__all__: list[str] = []
