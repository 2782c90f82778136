"""Thin client of the shmcache daemon (the HTTP control plane), installed as ``shmcache.client``.

```python
from shmcache.client import Client
with Client() as daemon:                       # <root>/daemon.sock of $SHMCACHE_ROOT / the default root
    daemon.load("feats", "/data/features", pin=True, wait=True)
    daemon.list("feats"); daemon.info("feats/a").mapped_by; daemon.evict("feats/a")
```

``Client`` satisfies :class:`shmcache._control.CacheControl` (``list``, ``info``, ``evict``,
``cleanup``, ``stats``, ``mapped_by``, ``put_file``) as a local ``shmcache.Store`` does, so
code written for one runs against the other. Reads never need it: ``shmcache.open_array``
& co. open the files directly. Needs httpx (a dependency of shmcache); never imports the
daemon, FastAPI or torch.
"""

from __future__ import annotations

from ._client import DEFAULT_TIMEOUT, ENV_SOCKET, ENV_TOKEN, Client
from ._errors import (
    ERROR_TYPES,
    InvalidRequestError,
    JobCancelledError,
    JobConflictError,
    JobFinishedError,
    JobNotFoundError,
    SourceNotAllowedError,
    error_from_body,
)
from ._records import ACTIVE_STATES, BudgetState, EntryDetail, Health, Job, JobError, ServiceStats

__all__ = [
    "ACTIVE_STATES",
    "DEFAULT_TIMEOUT",
    "ENV_SOCKET",
    "ENV_TOKEN",
    "ERROR_TYPES",
    "BudgetState",
    "Client",
    "EntryDetail",
    "Health",
    "InvalidRequestError",
    "Job",
    "JobCancelledError",
    "JobConflictError",
    "JobError",
    "JobFinishedError",
    "JobNotFoundError",
    "ServiceStats",
    "SourceNotAllowedError",
    "error_from_body",
]
