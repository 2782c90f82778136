"""Property-based API test: schemathesis generates requests from the daemon's OpenAPI schema
(valid and invalid ones) against the daemon's app in this process (ASGI, lifespan running),
set up as for TCP with a token; it must never answer 5xx, and every answer must match the
schema it publishes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.python import asgi  # noqa: E402
from service_helpers import temporary_root  # noqa: E402
from shmcache.service import create_app, load_settings  # noqa: E402

from shmcache._disk.layout import ENV_TOKEN  # noqa: E402

TOKEN = "schemathesis-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Host": "localhost"}  # a TCP client on this machine
MAX_EXAMPLES = 50  # per operation and mode: bounded so CI stays well under 2 minutes
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def app(data_dir: Path) -> Iterator[Any]:
    """The daemon's app set up as for TCP with a token; schemathesis starts its lifespan (job
    workers, start-up cleanup) on the first request and it is shut down here, before the root goes."""
    np.save(data_dir / "small.npy", np.arange(10))
    with temporary_root() as root:
        settings = load_settings(
            {"root": root, "host": "127.0.0.1", "port": 0, "allow_source": [data_dir]},
            env={ENV_TOKEN: TOKEN},
        )
        yield create_app(settings)
        asgi.shutdown_lifespans()


@pytest.fixture(scope="module")
def api_schema(app: Any) -> Any:
    return schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)


@pytest.fixture(scope="module")
def session(app: Any) -> Iterator[Any]:
    """One in-process client for every call (instead of one per generated case)."""
    with asgi.get_client(app) as client:
        yield client


def _operations(api_schema: Any) -> list[Any]:
    return [result.ok() for result in api_schema.get_all_operations()]


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_no_5xx_and_answers_match_the_schema(api_schema: Any, session: Any, mode: Any) -> None:
    operations = _operations(api_schema)
    assert len(operations) >= 10
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def check(case: Any) -> None:
            response = case.call(session=session, headers=AUTH, timeout=10)
            case.validate_response(response, checks=CHECKS)

        check()
