"""``create_app(settings)``: the FastAPI application of the daemon.

The lifespan cleans what dead writers left in the root, preloads the config file's
``[[datasets]]`` and, on shutdown, cancels running loads (nothing partial is
published) and with ``cleanup_on_exit`` evicts every entry.

Request bodies are capped (``MAX_BODY_BYTES``; the largest valid one is a few KiB), and
every error body and log line carries at most a shortened copy of what a client sent.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import tempfile
import threading
import time
import traceback
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shmcache import __version__
from shmcache._error_table import HTTP, reword
from shmcache.errors import CorruptEntryError, LockTimeoutError, ShmCacheError

from .docs import install_docs
from .errors import short, status_of
from .preloads import start_preloads
from .routes import metrics_router, v1
from .settings import Settings, load_settings, normal_host
from .state import Service

__all__ = ["MAX_BODY_BYTES", "create_app", "openapi_schema"]

logger = logging.getLogger(__name__)
_CANCEL_WAIT_S = 3.0
"""On stop, how long cancelled loads get to notice (each checks between 2 MiB chunks)."""

MAX_BODY_BYTES = 64 << 10
"""Largest request body read: a load request is a few KiB (its ``source`` at most 4096 characters)."""

_HTTP_ERROR_NAMES = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    403: "ForbiddenError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    406: "NotAcceptableError",
    413: "PayloadTooLargeError",
    415: "UnsupportedMediaTypeError",
}

DESCRIPTION = """\
Control plane of a shmcache root: load datasets into shared memory, evict, clean up,
list, stats, metrics. Reads never go through the daemon: processes open entries
directly with `shmcache.open_array(key)`.

Errors are `{"error": <exception type>, "detail": <message>}`.
"""


def create_app(settings: Settings, *, service: Service | None = None) -> FastAPI:
    """The daemon's ASGI app over ``settings.root`` (prepares the root if needed)."""
    service = service or Service(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(_start, service)
        try:
            yield
        finally:
            await asyncio.to_thread(_stop, service)

    app = FastAPI(
        title="shmcache daemon",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,  # install_docs serves /docs and /redoc without a CDN
        redoc_url=None,
    )
    app.state.service = service
    app.include_router(v1)
    app.include_router(metrics_router)
    install_docs(app)
    _install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, limit=MAX_BODY_BYTES)  # type: ignore[arg-type]
    app.add_middleware(
        ControlMiddleware,  # type: ignore[arg-type]
        service=service,
        token=settings.token,
        hosts=settings.host_names,
        unix_socket=str(settings.socket_path),
    )
    _document_guards(app, settings)
    return app


def openapi_schema() -> dict[str, Any]:
    """The schema a daemon with default settings serves at ``/openapi.json``, built without
    running one (``shmcache api-docs``): on a throwaway root, ignoring ``SHMCACHE_*``."""
    with tempfile.TemporaryDirectory(prefix="shmcache-api-docs-") as root:
        app = create_app(load_settings({"root": root}, env={}))
        try:
            return app.openapi()
        finally:
            app.state.service.close()


def _start(service: Service) -> None:
    """Clean up, say the budget, preload; then serve at once. The entry view (every entry's
    ``meta.json``: about 10 s for 100,000 entries on a loaded machine) is read in the
    background; a listing that comes first waits for that read and shares it, so listings
    and stats stay exact while ``/v1/health`` and loads answer from the first moment."""
    freed = service.store.cleanup()
    logger.info(
        "serving %s: budget %s; cleanup freed %d bytes",
        service.store.root,
        "none" if (budget := service.store.budget) is None else f"{budget} bytes",
        freed,
    )
    if (warning := service.budget_warning()) is not None:
        logger.warning("%s", warning)  # accepted (the tmpfs may be enlarged later), but said at start
    threading.Thread(target=_read_entries, args=(service,), name="shmcache-entries", daemon=True).start()
    start_preloads(service)


def _read_entries(service: Service) -> None:
    """The first entry view, read off the event loop (see :func:`_start`)."""
    started = time.monotonic()
    try:
        view = service.entry_view()
    except Exception as exc:  # the root removed meanwhile (RootWatch says so), a damaged root
        logger.warning("reading the entries of %s at start: %s", service.store.root, exc)
        return
    logger.info(
        "%d entries, %d bytes (read in %.1f s)", len(view.entries), view.used, time.monotonic() - started
    )


def _stop(service: Service) -> None:
    running = [job for job in service.jobs.list() if job.active]
    if running:
        logger.info("cancelling %d load(s)", len(running))
    service.jobs.shutdown(timeout=_CANCEL_WAIT_S)  # a load stuck on a lock must not hold up the stop
    if service.settings.cleanup_on_exit and service.root_watch.problem() is None:
        evicted = freed = 0
        for entry in service.store.list():
            try:
                freed += service.store.evict(entry.key)
                evicted += 1
            except ShmCacheError as exc:
                logger.warning("cleanup on exit: %s", exc)
        freed += service.store.cleanup()
        logger.info("cleanup on exit: evicted %d entries, freed %d bytes", evicted, freed)
    service.close()


# ---------------------------------------------------------------------- errors


def _error(status: int, error: str, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The JSON error body; ``detail`` shortened, and UTF-8 even where it quotes undecodable bytes."""
    text = short(detail, 1000).encode("utf-8", "backslashreplace").decode("utf-8")
    return JSONResponse({"error": error, "detail": text}, status_code=status, headers=headers)


def _too_large(limit: int) -> StarletteHTTPException:
    return StarletteHTTPException(
        413,
        f"the request body is larger than {limit} bytes, the most this daemon reads",
        headers={"Connection": "close"},  # do not read the rest only to discard it
    )


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ShmCacheError)
    async def shmcache_error(request: Request, exc: ShmCacheError) -> JSONResponse:
        status = status_of(exc)
        if status >= 500 or isinstance(exc, CorruptEntryError):  # damage on disk: the admin's to know
            logger.error(
                "%s %s: %s: %s", request.method, short(request.url.path), type(exc).__name__, short(str(exc))
            )
        headers = {"Retry-After": "1"} if isinstance(exc, LockTimeoutError) else None
        return _error(status, type(exc).__name__, reword(str(exc), HTTP), headers)  # in HTTP words

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, "InvalidRequestError", _describe_validation(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body"
            bad = exc.__cause__
            return _error(
                422,
                "InvalidRequestError",
                f"body: not valid UTF-8 (byte 0x{bad.object[bad.start]:02x} at position {bad.start}): "
                "send JSON encoded as UTF-8",
            )
        name = _HTTP_ERROR_NAMES.get(exc.status_code, "HTTPError")
        return _error(exc.status_code, name, str(exc.detail), dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # The traceback without the exception's own text, which may quote a client's input whole.
        where = "".join(traceback.format_tb(exc.__traceback__))
        message = short(str(exc))
        logger.error(
            "%s %s failed: %s: %s\n%s",
            request.method,
            short(request.url.path),
            type(exc).__name__,
            message,
            where.rstrip(),
        )
        return _error(500, "InternalError", f"{type(exc).__name__}: {message}")


def _describe_validation(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        if error.get("type") == "json_invalid":  # loc is ("body", position)
            position = error.get("loc", ("body", "?"))[-1]
            reason = error.get("ctx", {}).get("error", "invalid")
            parts.append(f"body: not valid JSON at character {position}: {reason}")
            continue
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def _document_guards(app: FastAPI, settings: Settings) -> None:
    """Add to the schema what the middlewares answer before any route: 413 where a body is
    taken, 421 for a foreign Host header and 401 without the token (when those checks run),
    503 once the root is gone."""

    def error(description: str) -> dict[str, Any]:
        schema = {"schema": {"$ref": "#/components/schemas/ErrorBody"}}
        return {"description": description, "content": {"application/json": schema}}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            if settings.token:
                schema.setdefault("components", {})["securitySchemes"] = {
                    "bearer": {"type": "http", "scheme": "bearer"}
                }
                schema["security"] = [{"bearer": []}]
            for path in schema["paths"].values():
                for operation in path.values():
                    responses = operation.setdefault("responses", {})
                    if "requestBody" in operation:
                        responses["413"] = error(f"Request body over {MAX_BODY_BYTES} bytes")
                    if settings.host_names is not None:
                        responses["421"] = error("Host header not a name of this daemon (TCP)")
                    if settings.token:
                        responses["401"] = error("Missing or wrong token")
                    gone = "The cache root was removed while the daemon ran (CacheRootError): it stops"
                    if "503" in responses:
                        responses["503"]["description"] += f"; or: {gone}"
                    else:
                        responses["503"] = error(gone)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# ---------------------------------------------------------------------- middleware


class BodyLimitMiddleware:
    """Refuses request bodies over ``limit`` bytes with 413: one whose Content-Length says so
    before a byte of it is read, a chunked one as soon as it passes the limit. Without it a
    300 MB body is buffered, parsed and echoed in an error (gigabytes of daemon memory)."""

    def __init__(self, app: ASGIApp, *, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _content_length(scope) > self.limit:
            too_large = _too_large(self.limit)
            response = _error(413, "PayloadTooLargeError", too_large.detail, dict(too_large.headers or {}))
            await response(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _too_large(self.limit)  # the route reading the body answers 413
            return message

        await self.app(scope, limited, send)


def _content_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0  # the HTTP parser refuses a malformed one before the app sees it
    return 0


class ControlMiddleware:
    """Host-header and bearer-token checks (TCP only: Unix-socket peers are checked by uid),
    503 for every request once the root is gone (:class:`RootWatch`), and latency metrics.

    The Host check stops DNS rebinding: a web page whose name was re-pointed at 127.0.0.1
    reaches a loopback daemon from the browser of anyone on this machine, but its requests
    still carry the page's name, which is not one of ``hosts``."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        service: Service,
        token: str | None,
        hosts: frozenset[str] | None,
        unix_socket: str,
    ) -> None:
        self.app = app
        self.token = token.encode() if token else None
        self.hosts = hosts
        self.unix_socket = unix_socket
        self.histogram = service.metrics.requests
        self.root_watch = service.root_watch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            tcp = not self._via_unix_socket(scope)
            if tcp and self.hosts is not None and (host := _host_header(scope)) not in self.hosts:
                response = _error(
                    421,
                    "MisdirectedRequestError",
                    f"Host {host!r} is not a name of this daemon: over TCP use localhost, 127.0.0.1 or "
                    "[::1] (or a name the daemon was started with --allow-host for); other names are "
                    "refused so that no web page can reach the daemon by DNS rebinding",
                )
                await response(scope, receive, send_with_status)
                return
            if self.token is not None and tcp and not self._authorized(scope):
                response = _error(
                    401,
                    "UnauthorizedError",
                    "missing or wrong token: send the header 'Authorization: Bearer <token>' with the "
                    "token the daemon was started with",
                    {"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send_with_status)
                return
            if (problem := self.root_watch.problem()) is not None:  # the daemon is stopping: unhealthy
                response = _error(503, "CacheRootError", problem, {"Connection": "close"})
                await response(scope, receive, send_with_status)
                return
            await self.app(scope, receive, send_with_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.histogram.labels(scope["method"], template, str(status)).observe(time.perf_counter() - start)

    def _via_unix_socket(self, scope: Scope) -> bool:
        server = scope.get("server")
        return server is not None and server[1] is None and server[0] == self.unix_socket

    def _authorized(self, scope: Scope) -> bool:
        assert self.token is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self.token)
        return False


def _host_header(scope: Scope) -> str | None:
    """The request's Host as :func:`normal_host` compares it (None: absent or malformed)."""
    for name, value in scope["headers"]:
        if name == b"host":
            return normal_host(value.decode("latin-1"))
    return None
