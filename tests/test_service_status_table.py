"""docs/http-api.md's table of HTTP error statuses is the API's: every status a route declares in the
OpenAPI schema, every status an error type maps to and every status the HTTP edge answers
has a row, every row is one of those, and each error type a row names maps to that status."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from service_helpers import app_client
from shmcache.service.errors import status_of

from shmcache import errors

HTTP_API = Path(__file__).resolve().parent.parent / "docs" / "http-api.md"  # the status table
EDGE = {
    400: "InvalidRequestError",  # malformed HTTP (service/protocol.py)
    405: "MethodNotAllowedError",  # a route's other methods
    431: "RequestHeadTooLargeError",  # service/protocol.py
    503: "CacheRootError",  # the root is gone (service/app.py)
}
"""Statuses the HTTP edge answers before any route, and the error type it names."""
ANSWERED_BY_THE_APP = {
    *EDGE.items(),
    (401, "UnauthorizedError"),  # the token check (service/app.py)
    (422, "InvalidRequestError"),  # request validation (service/app.py)
}
"""Error types the daemon answers itself rather than through ``status_of``."""


def readme_table() -> dict[int, str]:
    """Status -> its row's text, from the table under ``| status | error |``."""
    lines = HTTP_API.read_text().splitlines()
    start = lines.index("| status | error |") + 2
    rows: dict[int, str] = {}
    for line in lines[start:]:
        match = re.fullmatch(r"\| (\d{3}) \| (.+) \|", line)
        if match is None:
            break
        rows[int(match.group(1))] = match.group(2)
    return rows


def error_classes() -> dict[str, type[errors.ShmCacheError]]:
    return {
        name: cls
        for name in errors.__all__
        if isinstance(cls := getattr(errors, name), type) and issubclass(cls, errors.ShmCacheError)
    }


def test_the_readme_lists_every_status_the_api_returns(root: Path) -> None:
    table = readme_table()
    assert table, "no status table in docs/http-api.md"
    # TCP with a token: 401 and 421 are in the schema.
    flags = {"host": "127.0.0.1", "port": 0, "allow_source": [root.parent]}
    with app_client(root, env={"SHMCACHE_TOKEN": "t" * 32}, **flags) as client:
        schema = client.get("/openapi.json", headers={"Authorization": "Bearer " + "t" * 32}).json()
        assert client.patch("/v1/health", headers={"Authorization": "Bearer " + "t" * 32}).status_code == 405
    declared = {
        int(status)
        for path in schema["paths"].values()
        for operation in path.values()
        for status in operation["responses"]
        if int(status) >= 400
    }
    mapped = {status_of(cls("x")) for cls in error_classes().values()}
    returned = declared | mapped | set(EDGE)
    assert sorted(returned - set(table)) == [], "statuses the API returns missing from the table"
    assert sorted(set(table) - returned) == [], "docs/http-api.md lists statuses the API never returns"
    for status, name in EDGE.items():
        assert f"`{name}`" in table[status], (status, name)


def test_each_error_type_the_table_names_has_that_status() -> None:
    classes = error_classes()
    for status, row in readme_table().items():
        for name in re.findall(r"`(\w+Error)`", row):
            cls = classes.get(name)
            if cls is None or (status, name) in ANSWERED_BY_THE_APP:
                continue  # an HTTP-only name (NotFoundError...), or one the daemon answers itself
            assert status_of(cls("x")) == status, f"{name} is listed under {status}"
