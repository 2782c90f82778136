"""The shmcache daemon (``shmcache serve``): the HTTP control plane over a cache root.

Installed as ``shmcache.service``; needs the ``service`` extra
(``pip install 'shmcache[service]'``). Reads never go through the daemon: processes
open entries directly from the file system.

Names are imported on first use, so ``shmcache.service.settings`` (what the CLI needs
to build ``shmcache serve``) loads without FastAPI or uvicorn.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .server import serve
    from .settings import DatasetSpec, Settings, SettingsError, load_settings

__all__ = ["DatasetSpec", "Settings", "SettingsError", "create_app", "load_settings", "serve"]

_HOME = {
    "DatasetSpec": "settings",
    "Settings": "settings",
    "SettingsError": "settings",
    "load_settings": "settings",
    "create_app": "app",
    "serve": "server",
}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
