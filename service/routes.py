"""The ``/v1`` HTTP API and ``/metrics``.

Handlers that may block (locks, ``/proc`` scans, reading source headers) are plain
``def``: FastAPI runs them in its thread pool. Cheap cached views are ``async``, and go
to a thread for anything that touches the disk: one request blocking the event loop
delays every other.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from shmcache import __version__, validate_key
from shmcache._control import Job
from shmcache._disk.procmaps import MappingScan
from shmcache._store.budget import read_budget

from .errors import short
from .protocol import PEER_UID
from .schemas import (
    Budget,
    BudgetRequest,
    CleanupResult,
    Entry,
    EntryDetail,
    ErrorBody,
    Evicted,
    Health,
    LoadRequest,
    Stats,
)
from .sources import check_loadable, resolve_source
from .state import EntryView, Service, entry_model

__all__ = ["metrics_router", "v1"]


def _query_names(dependant: Any) -> set[str]:
    """The query parameters a route (its function and its dependencies) takes."""
    names = {field.alias for field in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


async def _known_query_only(request: Request) -> None:
    """Refuse query parameters the route does not take (422): ``?prefx=a`` must not list
    every entry as if no prefix had been given."""
    route = request.scope.get("route")
    known = _query_names(route.dependant) if route is not None else set()
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        takes = f"it takes {', '.join(sorted(known))}" if known else "it takes none"
        raise RequestValidationError(
            [
                {
                    "type": "extra_forbidden",
                    "loc": ("query", name),
                    "msg": f"unknown query parameter ({takes})",
                    "input": short(request.query_params[name]),
                }
                for name in unknown
            ]
        )


v1 = APIRouter(prefix="/v1", dependencies=[Depends(_known_query_only)])
metrics_router = APIRouter()


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorBody} for code in (*codes, 422)}


async def get_service(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


ServiceDep = Annotated[Service, Depends(get_service)]


def peer_uid(request: Request) -> int | None:
    """The uid of the Unix-socket peer that sent ``request`` (None: TCP, where the token decides)."""
    uid = getattr(request.state, PEER_UID, None)
    return uid if isinstance(uid, int) and uid >= 0 else None
KeyPath = Annotated[str, "a key: segments of [A-Za-z0-9._-] joined by '/'"]


async def _entry_view(service: Service) -> EntryView:
    """The entry view: cached, caught up here when few keys changed, else in a thread."""
    view = service.view_now()
    return view if view is not None else await asyncio.to_thread(service.entry_view)


@v1.get("/health", response_model=Health, responses=_errors(), summary="Liveness: the daemon answers")
async def health(service: ServiceDep) -> Health:
    return Health(
        version=__version__,
        pid=os.getpid(),
        root=str(service.store.root),
        uptime_s=round(max(0.0, time.time() - service.started), 3),
    )


@v1.get(
    "/stats",
    response_model=Stats,
    responses=_errors(),
    summary="Capacity, use, budget, entries, bytes held by readers",
)
async def stats(service: ServiceDep) -> Stats:
    space = await asyncio.to_thread(service.space, await _entry_view(service))  # walks tmp/: off the loop
    scan = service.readers.latest()  # else a new scan (shared), in a thread: the loop stays free
    if scan is None:
        scan = await asyncio.to_thread(service.readers.recent)
    unseen = 0
    if service.settings.team is not None:
        unseen = len(await asyncio.to_thread(_members_unseen, service, scan))
    counts = service.jobs.counts()
    return Stats(
        root=str(service.store.root),
        capacity=space.capacity,
        used=space.used,
        free=space.free,
        budget=space.budget,
        over_budget=space.over_budget,
        entries=space.entries,
        packed_held=space.packed_held,
        partial_bytes=space.partial_bytes,
        held_by_readers_bytes=scan.deleted_bytes,
        held_by_readers_unseen=unseen,
        jobs_queued=counts["queued"],
        jobs_running=counts["running"],
    )


def _members_unseen(service: Service, scan: MappingScan) -> list[int]:
    """A team root's members' processes whose maps the daemon (its owner) may not read."""
    st = os.stat(service.store.root)
    return scan.hidden_members(st.st_uid, st.st_gid)


@v1.get("/budget", response_model=Budget, responses=_errors(), summary="The root's byte budget and its use")
async def get_budget(service: ServiceDep) -> Budget:
    return await _budget(service)


@v1.put(
    "/budget",
    response_model=Budget,
    responses=_errors(400),
    summary="Record the root's byte budget (null: none); kept by every writer from now on",
)
async def set_budget(body: BudgetRequest, service: ServiceDep, request: Request) -> Budget:
    service.policy.check_admin(peer_uid(request), "set the root's budget")
    await asyncio.to_thread(service.store.set_budget, body.max_bytes, set_by="PUT /v1/budget")
    return await _budget(service)


async def _budget(service: Service) -> Budget:
    record = read_budget(service.store.layout)
    space = await asyncio.to_thread(service.space, await _entry_view(service))  # walks tmp/: off the loop
    return Budget(
        max_bytes=None if record is None else record.max_bytes,
        set_by=None if record is None else record.set_by,
        set_at=None if record is None else record.set_at,
        used=space.used,
        over_budget=record is not None and space.used > record.max_bytes,
    )


@v1.get(
    "/entries",
    response_model=list[Entry],
    responses=_errors(),
    summary="List entries (optionally under a prefix)",
)
async def list_entries(
    service: ServiceDep,
    prefix: Annotated[
        str | None, Query(description="Only `prefix` itself and keys under `prefix/`.", max_length=400)
    ] = None,
) -> Response:
    if prefix:
        prefix = validate_key(prefix.rstrip("/") or prefix)
    view = await _entry_view(service)
    return Response(view.json_under(prefix), media_type="application/json")


@v1.get(
    "/entries/{key:path}",
    response_model=EntryDetail,
    responses=_errors(404, 409),
    summary="One entry's metadata and the PIDs mapping it",
)
def get_entry(key: KeyPath, service: ServiceDep) -> EntryDetail:
    info = service.store.info(key)
    pids = service.readers.fresh().pids_of(info.version)
    return EntryDetail(**entry_model(info).model_dump(), mapped_by=sorted(pids))


@v1.put(
    "/entries/{key:path}",
    response_model=Job,
    status_code=202,
    responses=_errors(400, 404, 409, 415, 507),
    summary="Load a file or directory under the key in the background (answers with a job)",
)
def load_entry(
    key: KeyPath, body: LoadRequest, service: ServiceDep, response: Response, request: Request
) -> Job:
    validate_key(key)
    uid = peer_uid(request)
    service.policy.check_source(body.source, service.settings.allow_source)
    source = resolve_source(body.source, service.settings.allow_source)
    current = service.jobs.active_for(key)
    if current is None or current.source != source:
        allowed = service.settings.allow_source
        keys = check_loadable(service.store, key, source, body.overwrite, allowed, body.as_, body.dtype)
        if uid is not None:
            service.policy.check_load(uid, service.store, key, keys, body.overwrite, source)
    job, _ = service.jobs.submit(
        key, source, pin=body.pin, overwrite=body.overwrite, as_=body.as_, dtype=body.dtype, owner=uid
    )
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return job.snapshot()


@v1.delete(
    "/entries/{key:path}",
    response_model=Evicted,
    responses=_errors(404, 503),
    summary="Evict an entry (processes that map it keep reading their version)",
)
def evict_entry(key: KeyPath, service: ServiceDep, request: Request) -> Evicted:
    uid = peer_uid(request)
    if uid is None or service.policy.is_admin(uid):
        freed = service.store.evict(key)  # the generation it bumps makes the next list catch up
    else:
        freed = service.policy.evict_own(uid, service.store, key)  # counted by the store's on_evict
    return Evicted(key=key, freed_bytes=freed)


@v1.post(
    "/cleanup",
    response_model=CleanupResult,
    responses=_errors(503),
    summary="Remove partial writes and orphans of dead writers",
)
def cleanup(service: ServiceDep) -> CleanupResult:
    freed = service.store.cleanup()
    service.metrics.cleanups.inc()
    service.metrics.cleanup_freed_bytes.inc(freed)
    return CleanupResult(freed_bytes=freed)


@v1.get(
    "/jobs",
    response_model=list[Job],
    responses=_errors(),
    summary="Recent load jobs (queued, running, last 1000 finished)",
)
async def list_jobs(service: ServiceDep) -> list[Job]:
    return [job.snapshot() for job in service.jobs.list()]


@v1.get(
    "/jobs/{job_id}", response_model=Job, responses=_errors(404), summary="A load job's state and progress"
)
async def get_job(job_id: str, service: ServiceDep) -> Job:
    return service.jobs.get(job_id).snapshot()


@v1.delete(
    "/jobs/{job_id}",
    response_model=Job,
    responses={202: {"model": Job}, **_errors(404, 409)},
    summary="Cancel a queued or running load (nothing partial is published)",
)
def cancel_job(job_id: str, service: ServiceDep, response: Response) -> Job:
    job = service.jobs.cancel(job_id)
    if job.active:  # asked to stop, not stopped yet
        response.status_code = 202
    return job.snapshot()


@metrics_router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus metrics (text format)",
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
)
def metrics(service: ServiceDep) -> Response:
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
