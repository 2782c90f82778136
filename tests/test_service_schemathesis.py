"""Property-based API test: schemathesis generates requests from the daemon's OpenAPI schema
(valid and invalid ones) against a live ``shmcache serve`` over TCP with a token; the
daemon must never answer 5xx, and every answer must match the schema it publishes."""

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
from service_helpers import running_daemon, temporary_root  # noqa: E402

TOKEN = "schemathesis-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_EXAMPLES = 50  # per operation and mode: bounded so CI stays well under 2 minutes
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def api_schema() -> Iterator[Any]:
    with temporary_root() as root, temporary_root() as data:
        data.mkdir()
        np.save(data / "small.npy", np.arange(10))
        with running_daemon(
            Path(root),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--allow-source",
            str(data),
            env={"SHMCACHE_TOKEN": TOKEN},
        ) as daemon:
            assert daemon.tcp_url is not None
            yield schemathesis.openapi.from_url(f"{daemon.tcp_url}/openapi.json", headers=AUTH)


def _operations(api_schema: Any) -> list[Any]:
    return [result.ok() for result in api_schema.get_all_operations()]


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_no_5xx_and_answers_match_the_schema(api_schema: Any, mode: Any) -> None:
    operations = _operations(api_schema)
    assert len(operations) >= 10
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def check(case: Any) -> None:
            response = case.call(headers=AUTH, timeout=10)
            case.validate_response(response, checks=CHECKS)

        check()
