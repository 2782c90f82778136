"""Errors in the caller's words, from one table: a Python caller of the daemon is told
``overwrite=True``, the CLI ``--overwrite``, and only raw HTTP callers ``"overwrite": true``
or ``DELETE /v1/...``; each error's HTTP status and exit status come from the same table.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cli_helpers import cli, save
from service_helpers import Daemon, unique, write_big_npy
from shmcache.client import Client

from shmcache import errors
from shmcache._error_table import CLI, ERRORS, HTTP, PYTHON, exit_status, fix, http_status, reword
from shmcache.errors import JobConflictError, KeyExistsError

pytest.importorskip("fastapi")

HTTP_WORDS = ('"overwrite": true', "DELETE /v1/", "PUT /v1/", "/v1/")


def _no_http(message: str) -> None:
    assert not [word for word in HTTP_WORDS if word in message], message


@pytest.fixture(scope="module")
def existing(daemon: Daemon, data_dir: Path) -> tuple[str, Path]:
    key = unique("there")
    source = save(data_dir / f"{key}.npy", np.arange(5))
    with Client(daemon.root) as client:
        client.load(key, source, wait=True)
    return key, source


def test_python_callers_are_told_python_arguments(daemon: Daemon, existing: tuple[str, Path]) -> None:
    key, source = existing
    with Client(daemon.root) as client, pytest.raises(KeyExistsError) as raised:
        client.load(key, source)
    message = str(raised.value)
    assert "pass overwrite=True to replace it" in message and f"client.evict('{key}')" in message
    _no_http(message)


def test_cli_users_are_told_flags(daemon: Daemon, existing: tuple[str, Path]) -> None:
    key, source = existing
    code, _, err = cli("put", str(source), "--key", key, "--root", str(daemon.root))
    assert code == exit_status(KeyExistsError("")) == 1
    assert "pass --overwrite to replace it" in err and f"`shmcache evict {key}`" in err, err
    _no_http(err)


def test_raw_http_callers_are_told_http_fields(daemon: Daemon, existing: tuple[str, Path]) -> None:
    key, source = existing
    with daemon.client() as http:
        response = http.put(f"/v1/entries/{key}", json={"source": str(source)})
    body = response.json()
    assert response.status_code == http_status(KeyExistsError("")) == 409
    assert body["error"] == "KeyExistsError"
    assert '"overwrite": true' in body["detail"] and f"DELETE /v1/entries/{key}" in body["detail"]


def test_a_conflicting_load_names_the_cancel_of_each_caller(daemon: Daemon, data_dir: Path) -> None:
    key = unique("busy")
    first = write_big_npy(data_dir / f"{key}-a.npy", 1 << 30)  # ~16 s at the daemon's load rate
    other = save(data_dir / f"{key}-b.npy", np.arange(3))
    with Client(daemon.root) as client:
        job = client.load(key, first)
        try:
            with pytest.raises(JobConflictError) as raised:
                client.load(key, other)
            code, _, err = cli("put", str(other), "--key", key, "--root", str(daemon.root))
            with daemon.client() as http:
                detail = http.put(f"/v1/entries/{key}", json={"source": str(other)}).json()["detail"]
        finally:
            client.cancel(job.id)
    assert f"client.cancel('{job.id}')" in str(raised.value)
    _no_http(str(raised.value))
    assert code == 1 and "Ctrl+C in the `shmcache put` that started it" in err, err
    _no_http(err)
    assert f"DELETE /v1/jobs/{job.id}" in detail


def test_the_table_covers_every_error_and_rewording_is_exact() -> None:
    every = [getattr(errors, name) for name in errors.__all__]
    for cls in every:
        status, code = http_status(cls("x")), exit_status(cls("x"))
        assert 400 <= status <= 599 and code == 1, cls
    assert len({row.error for row in ERRORS}) == len(ERRORS)
    for name, key in (("overwrite", {}), ("evict", {"key": "a/b-1.c"}), ("cancel", {"job": "0f3a"})):
        for source in (PYTHON, CLI, HTTP):
            for target in (PYTHON, HTTP):
                said = f"x; {fix(name, source, **key)} then"
                if (source, name) == (CLI, "cancel"):  # the CLI's words carry no job id: kept as they are
                    assert reword(said, target) == said
                else:
                    assert reword(said, target) == f"x; {fix(name, target, **key)} then"
            assert reword(f"x; {fix(name, source, **key)}", CLI) == f"x; {fix(name, CLI, **key)}"
    core = "entry 'k' already exists in /r; pass overwrite=True (--overwrite) to replace it"
    assert reword(core, CLI).endswith("pass --overwrite to replace it")
    plain = "keys like overwrite or /v1 in a path stay"
    assert reword(plain, PYTHON) == plain
