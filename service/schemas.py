"""Request and response bodies of the HTTP API (pydantic models; they make the OpenAPI schema).

Jobs are answered as :class:`shmcache._control.Job`, the record the client parses back.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

__all__ = [
    "MAX_SOURCE_LENGTH",
    "Budget",
    "BudgetRequest",
    "CleanupResult",
    "Entry",
    "EntryDetail",
    "ErrorBody",
    "Evicted",
    "Health",
    "LoadRequest",
    "Stats",
]

MAX_SOURCE_LENGTH = 4096
"""PATH_MAX: no longer path can name a file; a longer ``source`` is refused before it is used."""

class ErrorBody(BaseModel):
    """Every error response: the exception's type and a message that says what to do."""

    error: str = Field(description="Exception class name, e.g. KeyNotFoundError, InvalidRequestError.")
    detail: str


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    version: str
    pid: int
    root: str
    uptime_s: float


class Stats(BaseModel):
    root: str
    capacity: int = Field(description="Size of the file system holding the root (bytes).")
    used: int = Field(description="Bytes held by published entries and packed batches (see `packed_held`).")
    free: int = Field(description="Bytes still free on that file system.")
    budget: int | None = Field(
        description="The root's byte budget, kept by every writer (`PUT /v1/budget`), or null for none."
    )
    over_budget: bool = Field(
        description="Entries use more than the budget (it was lowered below them): the next load "
        "evicts to fit."
    )
    entries: int
    packed_held: int = Field(
        default=0,
        description="Of `used`: bytes directory puts' manifests hold beyond their linked packed "
        "entries (mostly evicted ones: freed when the rest of that directory put is evicted or re-put).",
    )
    partial_bytes: int = Field(
        default=0,
        description="Bytes in the root's tmp/, not in `used`: writes in progress and partial writes of "
        "dead writers (`POST /v1/cleanup` frees those; a load short of room removes them first).",
    )
    held_by_readers_bytes: int = Field(
        description="Bytes of evicted or replaced entries that live processes still map "
        "(returned to the system when they let go); from a `/proc` scan begun at most 2 s before the request."
    )
    held_by_readers_unseen: int = Field(
        default=0,
        description="In a team's root: members' processes whose mappings the daemon may not read "
        "(another user's /proc/PID/maps); what they hold is not in held_by_readers_bytes.",
    )
    jobs_queued: int
    jobs_running: int


class Entry(BaseModel):
    key: str
    kind: str
    dtype: str | None
    shape: list[int] | None
    nbytes: int = Field(description="Bytes of data (array.nbytes).")
    size: int = Field(description="Bytes the entry occupies in the cache.")
    created: float
    last_used: float
    pinned: bool
    source: str | None
    version: str
    source_fingerprint: dict[str, int] | None = None
    checksum: str | None = None
    owner_uid: int | None = Field(default=None, description="The uid of the user who loaded it.")


class EntryDetail(Entry):
    mapped_by: list[int] = Field(description="PIDs of live processes that map this entry.")


class LoadRequest(BaseModel):
    """Load a ``.npy``; an ``.npz``, ``.safetensors``, torch ``.pt``/``.pth`` or ``.h5``/``.hdf5``
    (as key/<member, tensor or dataset>); or a directory of them (key/<relative path>).

    Strict: ``"pin": "yes"`` or ``1`` is refused (422), not taken as true, and no field is
    coerced from another JSON type; unknown fields are refused too (a typo is not ignored)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    source: str = Field(
        min_length=1,
        max_length=MAX_SOURCE_LENGTH,
        description=f"Absolute path on the daemon's machine, or a URL (s3://, gs://, az://, hf://, "
        "https://) under one of the daemon's --allow-source URL prefixes, loaded with the daemon's "
        f"own credentials (at most {MAX_SOURCE_LENGTH} characters).",
    )
    pin: bool = Field(default=False, description="Never evict it to stay within the budget.")
    overwrite: bool = Field(default=False, description="Replace existing entries.")
    as_: Literal["auto", "arrays", "blobs"] = Field(
        default="auto",
        alias="as",
        description="What a directory becomes: arrays (key/<name> per .npy/.npz), blobs (one entry "
        "holding every file's bytes) or auto (blobs when it holds no array files).",
    )
    dtype: str | None = Field(
        default=None,
        min_length=1,
        max_length=32,
        pattern=r"^[A-Za-z0-9<>=|]+$",
        description="The token dtype of a raw token file (e.g. uint16 for nanoGPT's train.bin): the "
        "file becomes one 1-D array. A Megatron .bin/.idx pair needs none (its index says it).",
    )


class BudgetRequest(BaseModel):
    """``PUT /v1/budget``: the root's new budget."""

    model_config = ConfigDict(extra="forbid")

    max_bytes: StrictInt | None = Field(
        ge=0, description="Bytes every writer of the root keeps to (null removes the budget)."
    )


class Budget(BaseModel):
    """The root's budget, recorded in the root (``<root>/budget.json``), and its use."""

    max_bytes: int | None = Field(description="The budget in bytes, or null for none.")
    set_by: str | None = Field(description="What recorded it (`shmcache serve --max-bytes`, ...).")
    set_at: float | None = Field(description="When, in seconds since the epoch.")
    used: int = Field(description="Bytes held by published entries and packed batches (see `packed_held`).")
    over_budget: bool


class Evicted(BaseModel):
    key: str
    freed_bytes: int


class CleanupResult(BaseModel):
    freed_bytes: int
