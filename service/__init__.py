"""The shmcache daemon (``shmcache serve``): FastAPI control plane over the core store.

Installed as ``shmcache.service``; needs the ``service`` extra. Not implemented yet.
"""

__all__: list[str] = []
