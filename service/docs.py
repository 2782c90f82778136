"""``/docs`` (Swagger UI) and ``/redoc`` with their JavaScript and CSS served by the daemon.

FastAPI's default pages load those assets from a CDN: blank on a machine without internet,
and a page reached through the daemon's Unix socket (``ssh -L``, a proxy) has no CDN either.
The assets come from fastapi-offline, which ships Swagger UI and ReDoc as package data
(only its files are used, not its FastAPI factory), mounted as static files: FastAPI's
documented way to self-host them (``docs_url=None`` plus ``get_swagger_ui_html``).
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["ASSETS_URL", "DOCS_URL", "REDOC_URL", "assets_directory", "install_docs"]

DOCS_URL = "/docs"
REDOC_URL = "/redoc"
ASSETS_URL = "/docs-assets"
_ASSETS_PACKAGE = "fastapi_offline"


def assets_directory() -> str:
    """The folder of Swagger UI and ReDoc files that fastapi-offline installs."""
    return str(files(_ASSETS_PACKAGE).joinpath("static"))


def install_docs(app: FastAPI) -> None:
    """Serve ``/docs``, ``/redoc`` and their assets from ``app`` (made with ``docs_url=None``
    and ``redoc_url=None``, so FastAPI adds no CDN pages of its own)."""
    app.mount(ASSETS_URL, StaticFiles(directory=assets_directory()), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        base = request.scope.get("root_path", "") + ASSETS_URL
        return get_swagger_ui_html(
            openapi_url=request.scope.get("root_path", "") + openapi_url,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{base}/swagger-ui-bundle.js",
            swagger_css_url=f"{base}/swagger-ui.css",
            swagger_favicon_url=f"{base}/favicon.png",
            swagger_ui_parameters=app.swagger_ui_parameters,
        )

    @app.get(REDOC_URL, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        base = request.scope.get("root_path", "") + ASSETS_URL
        return get_redoc_html(
            openapi_url=request.scope.get("root_path", "") + openapi_url,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{base}/redoc.standalone.js",
            redoc_favicon_url=f"{base}/favicon.png",
            with_google_fonts=False,
        )
