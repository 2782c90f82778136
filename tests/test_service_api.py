"""The daemon's HTTP API, driven in this process: ``TestClient(create_app(settings))`` with the
app's lifespan, over a real root on the tmpfs. Readers are real other processes.

What needs a real ``shmcache serve`` (the Unix socket, signals, restarts, TCP) is in
test_service_daemon.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient
from service_helpers import app_client, load, temporary_root, unique, wait_for, write_big_npy

from shmcache._disk.layout import Layout

RATE = 256 << 20  # bytes/s per load: slow enough to catch a load while it runs


@pytest.fixture(scope="module")
def api_root() -> Iterator[Path]:
    with temporary_root() as path:
        yield path


@pytest.fixture(scope="module")
def client(api_root: Path, data_dir: Path) -> Iterator[TestClient]:
    with app_client(api_root, allow_source=[data_dir], max_load_rate=RATE) as http:
        yield http


def error_of(response: httpx.Response) -> tuple[int, str]:
    body = response.json()
    assert set(body) == {"error", "detail"}, body
    assert body["detail"], body
    return response.status_code, body["error"]


def test_health_stats_and_docs(client: httpx.Client, api_root: Path) -> None:
    health = client.get("/v1/health").json()
    assert health["status"] == "ok" and health["pid"] == os.getpid() and health["root"] == str(api_root)
    stats = client.get("/v1/stats").json()
    assert stats["capacity"] > 0 and stats["free"] > 0 and stats["budget"] is None
    assert {"used", "entries", "held_by_readers_bytes", "jobs_queued", "jobs_running"} <= set(stats)
    assert client.get("/docs").status_code == 200
    schema = client.get("/openapi.json").json()
    assert "/v1/entries/{key}" in schema["paths"] and "/metrics" in schema["paths"]


def test_docs_pages_load_only_assets_the_daemon_serves(client: httpx.Client) -> None:
    """/docs and /redoc work offline and through the Unix socket: no CDN, every asset answers."""
    for page in ("/docs", "/redoc"):
        response = client.get(page)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
        urls = re.findall(r"""(?:src|href|url)\s*[=:]\s*['"]([^'"]+)['"]""", response.text)
        assert urls, response.text
        for url in urls:
            assert url.startswith("/"), f"{page} loads {url} from elsewhere"
            assert client.get(url).status_code == 200, url
    assets = re.findall(r"/docs-assets/[\w.-]+", client.get("/docs").text)
    assert {"/docs-assets/swagger-ui-bundle.js", "/docs-assets/swagger-ui.css"} <= set(assets)
    assert "/docs-assets/redoc.standalone.js" in client.get("/redoc").text


def test_load_a_file_and_open_it_from_another_process(
    client: httpx.Client, api_root: Path, data_dir: Path
) -> None:
    key = unique("labels")
    array = np.arange(1000, dtype=np.int64).reshape(100, 10)
    np.save(data_dir / f"{key}.npy", array)
    job = load(client, key, data_dir / f"{key}.npy", pin=True)
    assert job["state"] == "done", job
    assert job["keys"] == [key] and job["bytes_done"] == job["bytes_total"] > array.nbytes
    assert job["error"] is None and job["finished"] >= job["started"] >= job["created"]

    code = (
        "import sys, shmcache; a = shmcache.open_array(sys.argv[1], root=sys.argv[2]); "
        "print(a.shape, a.dtype, int(a.sum()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, key, str(api_root)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"(100, 10) int64 {int(array.sum())}"

    entry = client.get(f"/v1/entries/{key}").json()
    assert entry["key"] == key and entry["shape"] == [100, 10] and entry["dtype"] == "int64"
    assert entry["pinned"] is True and entry["source"] == str(data_dir / f"{key}.npy")
    assert entry["mapped_by"] == []


def test_load_a_directory(client: httpx.Client, data_dir: Path) -> None:
    key = unique("feats")
    src = data_dir / key
    (src / "sub").mkdir(parents=True)
    np.save(src / "a.npy", np.ones(5, dtype=np.float32))
    np.save(src / "sub" / "b.npy", np.zeros((2, 3), dtype=np.uint8))
    np.savez(src / "c.npz", x=np.arange(3), y=np.arange(4.0))
    (src / "notes.txt").write_text("ignored")
    job = load(client, key, src, **{"as": "arrays"})  # auto would ask: arrays or blobs?
    assert job["state"] == "done", job
    expected = sorted(f"{key}/{name}" for name in ("a", "sub/b", "c/x", "c/y"))
    assert sorted(job["keys"]) == expected
    listed = client.get("/v1/entries", params={"prefix": key}).json()
    assert [e["key"] for e in listed] == expected
    assert client.get("/v1/entries", params={"prefix": f"{key}/sub"}).json()[0]["shape"] == [2, 3]
    assert len(client.get("/v1/entries").json()) >= 4


def test_evict_while_a_reader_keeps_reading(client: TestClient, api_root: Path, data_dir: Path) -> None:
    client.app.state.service.readers.max_age = 0.0  # rescan /proc on every stats call, not every 2 s
    key = unique("evicted")
    array = np.arange(1 << 20, dtype=np.int64)  # 8 MiB
    np.save(data_dir / f"{key}.npy", array)
    assert load(client, key, data_dir / f"{key}.npy")["state"] == "done"
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, shmcache; a = shmcache.open_array(sys.argv[1], root=sys.argv[2])\n"
                "print('ready', flush=True)\n"
                "for line in sys.stdin: print(int(a.sum()), flush=True)"
            ),
            key,
            str(api_root),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert reader.stdin is not None and reader.stdout is not None
    try:
        assert reader.stdout.readline().strip() == "ready"
        assert client.get(f"/v1/entries/{key}").json()["mapped_by"] == [reader.pid]
        evicted = client.delete(f"/v1/entries/{key}")
        assert evicted.status_code == 200 and evicted.json()["freed_bytes"] >= array.nbytes
        assert error_of(client.get(f"/v1/entries/{key}")) == (404, "KeyNotFoundError")
        reader.stdin.write("sum\n")
        reader.stdin.flush()
        assert int(reader.stdout.readline()) == int(array.sum())  # still reading its version
        wait_for(
            lambda: client.get("/v1/stats").json()["held_by_readers_bytes"] >= array.nbytes,
            timeout=10,
            what="held_by_readers_bytes to count the evicted mapping",
        )
    finally:
        reader.stdin.close()
        reader.wait(10)
    wait_for(
        lambda: client.get("/v1/stats").json()["held_by_readers_bytes"] < array.nbytes,
        timeout=10,
        what="held_by_readers_bytes to drop once the reader exited",
    )


def test_errors_have_status_and_json_body(client: httpx.Client, data_dir: Path, tmp_path: Path) -> None:
    key = unique("err")
    np.save(data_dir / f"{key}.npy", np.arange(3))
    assert load(client, key, data_dir / f"{key}.npy")["state"] == "done"
    put = lambda k, body: client.put(f"/v1/entries/{k}", json=body)  # noqa: E731

    assert error_of(put("bad key!", {"source": str(data_dir)})) == (422, "InvalidKeyError")
    assert error_of(client.get("/v1/entries/a//b")) == (422, "InvalidKeyError")
    assert error_of(client.get("/v1/entries", params={"prefix": "../x"})) == (422, "InvalidKeyError")
    assert error_of(client.get("/v1/entries/no/such/key")) == (404, "KeyNotFoundError")
    assert error_of(client.delete("/v1/entries/no/such/key")) == (404, "KeyNotFoundError")
    assert error_of(put(key, {"source": str(data_dir / f"{key}.npy")})) == (409, "KeyExistsError")
    assert error_of(put(unique("k"), {"source": str(data_dir / "missing.npy")})) == (
        400,
        "SourceNotFoundError",
    )
    assert error_of(put(unique("k"), {"source": "relative/path.npy"})) == (400, "InvalidSourceError")
    assert error_of(put(unique("k"), {"source": "/a\x00b"})) == (400, "InvalidSourceError")

    corrupt = data_dir / f"{unique('corrupt')}.npy"
    corrupt.write_bytes(np.lib.format.MAGIC_PREFIX + b"garbage")
    assert error_of(put(unique("k"), {"source": str(corrupt)})) == (400, "CorruptSourceError")
    truncated = data_dir / f"{unique('truncated')}.npy"
    truncated.write_bytes((data_dir / f"{key}.npy").read_bytes()[:-5])
    assert error_of(put(unique("k"), {"source": str(truncated)})) == (400, "CorruptSourceError")
    pickled = data_dir / f"{unique('objects')}.npy"
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert error_of(put(unique("k"), {"source": str(pickled)})) == (415, "UnsupportedDataError")

    outside = tmp_path / "outside.npy"
    np.save(outside, np.arange(3))
    assert error_of(put(unique("k"), {"source": str(outside)})) == (400, "SourceNotAllowedError")
    assert error_of(put(unique("k"), {"source": "/no/such/file.npy"})) == (400, "SourceNotAllowedError")
    escape = data_dir / f"{unique('link')}.npy"
    escape.symlink_to(outside)  # inside the allowed directory, pointing out of it
    assert error_of(put(unique("k"), {"source": str(escape)})) == (400, "SourceNotAllowedError")
    sneaky = data_dir / unique("sneaky")
    sneaky.mkdir()
    np.save(sneaky / "fine.npy", np.arange(3))
    (sneaky / "secret.npy").symlink_to(outside)  # a directory source with a link out
    assert error_of(put(unique("k"), {"source": str(sneaky)})) == (400, "SourceNotAllowedError")
    dotdot = f"{data_dir}/{'../' * (len(data_dir.parts) - 1)}{outside.relative_to('/')}"
    assert error_of(put(unique("k"), {"source": dotdot})) == (400, "SourceNotAllowedError")

    assert error_of(put(unique("k"), {})) == (422, "InvalidRequestError")
    assert error_of(put(unique("k"), {"source": str(outside), "pinned": True})) == (
        422,
        "InvalidRequestError",
    )
    assert error_of(client.put(f"/v1/entries/{unique('k')}", content=b"{not json")) == (
        422,
        "InvalidRequestError",
    )
    assert error_of(client.get("/v1/jobs/nope")) == (404, "JobNotFoundError")
    assert error_of(client.delete("/v1/jobs/nope")) == (404, "JobNotFoundError")
    assert error_of(client.get("/v1/nothing-here")) == (404, "NotFoundError")
    assert error_of(client.post("/v1/health")) == (405, "MethodNotAllowedError")


def test_same_key_loads_once_and_cancel_publishes_nothing(
    client: httpx.Client, api_root: Path, data_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key = unique("big")
    source = write_big_npy(data_dir / f"{key}.npy", 512 << 20)  # 2 s at RATE
    first = client.put(f"/v1/entries/{key}", json={"source": str(source)})
    second = client.put(f"/v1/entries/{key}", json={"source": str(source)})
    assert first.status_code == second.status_code == 202
    job_id = first.json()["id"]
    assert second.json()["id"] == job_id and first.headers["location"] == f"/v1/jobs/{job_id}"
    other = data_dir / f"{unique('other')}.npy"
    np.save(other, np.arange(3))
    assert error_of(client.put(f"/v1/entries/{key}", json={"source": str(other)})) == (
        409,
        "JobConflictError",
    )

    wait_for(lambda: client.get(f"/v1/jobs/{job_id}").json()["bytes_done"] > 0, what="the load to start")
    cancelled = client.delete(f"/v1/jobs/{job_id}")
    assert cancelled.status_code == 200, cancelled.text
    job = cancelled.json()
    assert job["state"] == "cancelled" and job["error"]["type"] == "JobCancelledError"
    assert 0 < job["bytes_done"] < job["bytes_total"]
    assert error_of(client.get(f"/v1/entries/{key}")) == (404, "KeyNotFoundError")
    assert os.listdir(Layout(api_root).tmp) == []  # the partial copy is gone
    assert error_of(client.delete(f"/v1/jobs/{job_id}")) == (409, "JobFinishedError")
    assert job_id in [j["id"] for j in client.get("/v1/jobs").json()]
    cancelled_logs = [r for r in caplog.records if "cancelled" in r.getMessage() and job_id in r.getMessage()]
    assert [r.levelname for r in cancelled_logs] == ["WARNING"]  # as the README's Lifecycle says


def test_cleanup_and_metrics(client: httpx.Client, api_root: Path, data_dir: Path) -> None:
    dead = Layout(api_root).tmp / "1-999999999-deadbeef.1"  # a dead writer's partial version
    dead.mkdir()
    (dead / "data.npy").write_bytes(b"x" * 4096)
    assert client.post("/v1/cleanup").json()["freed_bytes"] >= 4096
    assert not dead.exists()

    key = unique("metered")
    np.save(data_dir / f"{key}.npy", np.arange(10))
    load(client, key, data_dir / f"{key}.npy")
    client.delete(f"/v1/entries/{key}")
    assert client.get("/v1/stats").status_code == 200  # a timed request of its own
    text = client.get("/metrics").text
    for line in (
        'shmcache_loads_total{outcome="done"}',
        "shmcache_evictions_total",
        "shmcache_entries ",
        "shmcache_used_bytes ",
        'shmcache_jobs{state="running"}',
        "shmcache_cleanup_freed_bytes_total",
        'shmcache_request_duration_seconds_bucket{le="0.01",method="GET",route="/v1/stats",status="200"}',
    ):
        assert line in text, line
    assert _sample(text, 'shmcache_loads_total{outcome="done"}') >= 1


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in metrics")


def test_a_load_that_cannot_fit_is_507(client: httpx.Client, data_dir: Path) -> None:
    free = os.statvfs(data_dir).f_bavail * os.statvfs(data_dir).f_frsize
    huge = write_big_npy(data_dir / f"{unique('huge')}.npy", free + (1 << 30))  # sparse
    try:
        assert error_of(client.put(f"/v1/entries/{unique('huge')}", json={"source": str(huge)})) == (
            507,
            "CacheFullError",
        )
    finally:
        huge.unlink()


def test_a_refused_source_does_not_say_where_a_link_points(client: httpx.Client, data_dir: Path) -> None:
    """SourceNotAllowedError says only that the source is outside the allowed directories: a
    link to /proc/self/cwd (or anywhere) must not tell a TCP client the daemon's file system."""
    for target in ("/proc/self/cwd", "/proc/self/fd/0", "/etc/hostname"):
        link = data_dir / unique("link")
        link.symlink_to(target)
        for source in (link, link / "x.npy"):
            response = client.put(f"/v1/entries/{unique('k')}", json={"source": str(source)})
            assert error_of(response) == (400, "SourceNotAllowedError")
            detail = response.json()["detail"]
            assert str(source) in detail and "outside the directories" in detail
            resolved = os.path.realpath(source)
            assert resolved not in detail and "resolves to" not in detail, detail


def test_oversized_and_unusable_sources_are_4xx_short_and_logged_short(
    client: httpx.Client, data_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No input gets a 5xx, an answer that echoes it whole, or a log line of its size: bodies
    over 64 KiB are 413 before they are read, ``source`` is at most 4096 characters, and paths
    the kernel refuses (ENAMETOOLONG, a lone surrogate) are InvalidSourceError."""
    caplog.set_level(logging.DEBUG)
    put = lambda **request: client.put(f"/v1/entries/{unique('k')}", **request)  # noqa: E731
    huge = "/" + "a" * (4 << 20)

    declared = put(json={"source": huge})  # Content-Length says it all: refused unread
    assert error_of(declared) == (413, "PayloadTooLargeError") and len(declared.content) < 1000
    assert declared.headers["connection"] == "close"
    body = json.dumps({"source": huge}).encode()
    chunked = put(content=(body[i : i + 65536] for i in range(0, len(body), 65536)))  # no length
    assert error_of(chunked) == (413, "PayloadTooLargeError") and len(chunked.content) < 1000

    over_schema = put(json={"source": "/" + "a" * 5000})
    assert error_of(over_schema) == (422, "InvalidRequestError") and len(over_schema.content) < 1000
    assert "4096" in over_schema.json()["detail"]

    base = f"{data_dir}/"
    path_max = base + "d/" * ((4096 - len(base)) // 2) + "d" * ((4096 - len(base)) % 2)
    assert len(path_max) == 4096  # the schema's limit; one byte over PATH_MAX with its NUL
    for source in (str(data_dir / ("x" * 300)), path_max, str(data_dir / ("n" * 300) / "x.npy")):
        response = put(json={"source": source})
        assert error_of(response) == (400, "InvalidSourceError"), response.text
        assert len(response.content) < 1000 and "too long" in response.json()["detail"]
    surrogate = put(content=b'{"source": "/a\\ud800b.npy"}', headers={"content-type": "application/json"})
    assert error_of(surrogate) in {(400, "InvalidSourceError"), (422, "InvalidRequestError")}

    assert max(len(record.getMessage()) for record in caplog.records) < 2000
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[:2000]
