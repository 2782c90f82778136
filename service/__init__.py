"""The shmcache daemon (``shmcache serve``): the HTTP control plane over a cache root.

Installed as ``shmcache.service``; needs the ``service`` extra
(``pip install 'shmcache[service]'``). Reads never go through the daemon: processes
open entries directly from the file system.
"""

from __future__ import annotations

from .app import create_app
from .server import serve
from .settings import DatasetSpec, Settings, SettingsError, load_settings

__all__ = ["DatasetSpec", "Settings", "SettingsError", "create_app", "load_settings", "serve"]
