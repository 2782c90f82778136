"""The budget belongs to the root (issue 18, item 2): recorded in it by ``shmcache serve
--max-bytes``, ``shmcache budget`` or ``set_budget``, and kept by every writer: library calls,
the CLI with or without a daemon, the daemon and its preloads. ``stats`` and ``doctor`` say
when the entries use more than it."""

from __future__ import annotations

import json
import logging
import multiprocessing
from collections.abc import Callable
from multiprocessing.synchronize import Barrier
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import cli, invoke, save
from service_helpers import app_client, running_daemon, scratch_dir, temporary_root, wait_for

import shmcache
from shmcache import CacheFullError, CacheRootError, InvalidRequestError, Store
from shmcache._disk.layout import Layout
from shmcache._store.budget import read_budget
from shmcache._store.catalog import iter_infos, used_bytes

MiB = 1 << 20
CTX = multiprocessing.get_context("fork")


def _stats_json(root: Path) -> dict[str, object]:
    code, out, err = cli("stats", "--root", str(root), "--json")
    assert code == 0, err
    report: dict[str, object] = json.loads(out)
    return report


def _doctor(root: Path) -> tuple[int, dict[str, object]]:
    result = invoke("doctor", "--root", str(root), "--json")
    checks = {check["name"]: check for check in json.loads(result.stdout)["checks"]}
    return result.exit_code, checks["budget"]


# ---------------------------------------------------------------------- the sequence


@pytest.mark.integration
def test_the_daemon_budget_is_kept_by_every_writer_of_its_root(root: Path) -> None:
    """The issue's sequence: ``serve --max-bytes`` (with a preload), then a CLI put through
    the daemon and every Python writer on the same root. Each stays within the budget by
    evicting least-recently-used entries; pinned and mapped ones make a typed failure that
    names them; a budget lowered below the use makes ``stats`` say so and ``doctor`` fail."""
    budget = 8 * MiB
    with scratch_dir("budget-sources") as data:
        for name in ("preload", "cli", "file", "big"):
            save(data / f"{name}.npy", np.full(2 * MiB if name != "big" else 3 * MiB, 7, np.uint8))
        (data / "blobs").mkdir()
        for name in ("a.bin", "b.bin"):
            (data / "blobs" / name).write_bytes(b"x" * MiB)
        config = data / "serve.toml"
        config.write_text(f'[[datasets]]\nkey = "preload"\nsource = "{data / "preload.npy"}"\n')
        with running_daemon(
            root, "--allow-source", str(data), "--max-bytes", "8MiB", "--config", str(config)
        ) as daemon:
            store = Store(root)  # no max_bytes of its own: the root's budget applies
            wait_for(lambda: store.exists("preload"), 30, "the preload")
            record = read_budget(Layout(root))
            assert record is not None and record.max_bytes == budget and "--max-bytes" in record.set_by
            assert store.budget == budget == shmcache.get_budget(root=root)

            code, _, err = cli("put", str(data / "cli.npy"), "--key", "cli", "--root", str(root))
            assert code == 0 and "no daemon" not in err, err

            writers: list[tuple[str, Callable[[], object]]] = [
                ("py/array", lambda: shmcache.put_array("py/array", np.ones(2 * MiB, np.uint8), root=root)),
                ("py/share", lambda: shmcache.share("py/share", np.full(2 * MiB, 2, np.uint8), root=root)),
                ("py/cache", lambda: shmcache.cache("py/cache", lambda: np.full(2 * MiB, 3, np.uint8),
                                                    root=root)),
                ("py/file", lambda: shmcache.put_file("py/file", data / "file.npy", root=root)),
                ("py/blobs", lambda: shmcache.put_blobs("py/blobs", data / "blobs", root=root)),
                ("py/table", lambda: shmcache.put_table(
                    "py/table", {"x": np.arange(MiB // 4, dtype=np.int64)}, root=root)),
            ]
            for key, put in writers:
                put()
                stats = store.stats()
                assert store.exists(key) and stats.used <= budget and not stats.over_budget, (key, stats)
            assert not store.exists("preload") and not store.exists("cli")  # the least recently used
            for key in [entry.key for entry in store.list()]:
                store.evict(key)

            # What holds the space cannot be evicted: a typed error names it, for Python and the CLI.
            shmcache.put_array("pinned", np.zeros(3 * MiB, np.uint8), pin=True, root=root)
            shmcache.put_array("held", np.zeros(3 * MiB, np.uint8), root=root)
            held = shmcache.open_array("held", root=root)
            with pytest.raises(CacheFullError, match=r"Pinned: pinned; mapped by live processes: held"):
                shmcache.put_array("too-much", np.zeros(3 * MiB, np.uint8), root=root)
            code, _, err = cli("put", str(data / "big.npy"), "--key", "big", "--root", str(root))
            assert code == 1 and "within the budget" in err and "Pinned: pinned" in err, err
            assert "mapped by live processes: held" in err, err
            assert {e.key for e in store.list()} == {"pinned", "held"}

            # The budget lowered below the use (through the daemon): stats say so, doctor fails.
            code, out, err = cli("budget", "set", "4MiB", "--root", str(root))
            assert code == 0 and "4.0 MiB" in out and "over the budget" in err, (out, err)
            report = _stats_json(root)
            assert report["daemon"] and report["budget"] == 4 * MiB and report["over_budget"] is True
            assert "OVER BUDGET" in cli("stats", "--root", str(root))[1]
            with daemon.client() as http:
                over = http.get("/v1/stats").json()
                assert over["budget"] == 4 * MiB and over["over_budget"] is True
                assert http.get("/v1/budget").json()["set_by"] == "PUT /v1/budget"
            assert shmcache.stats(root=root).over_budget
            code, check = _doctor(root)
            assert code == 1 and check["status"] == "fail" and "shmcache budget set" in str(check["fix"])

            # Once "held" is let go, the next put evicts it to fit: within the budget again.
            del held
            shmcache.put_array("small", np.zeros(MiB // 2, np.uint8), root=root)
            assert {e.key for e in store.list()} == {"pinned", "small"}
            assert _stats_json(root)["over_budget"] is False
            assert _doctor(root)[1]["status"] == "ok"


# ---------------------------------------------------------------------- the daemon and the record


def test_the_daemon_flag_replaces_a_recorded_budget_and_says_so(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    Store(root).set_budget("5MiB")
    with app_client(root, max_bytes="3MiB") as client:
        assert client.get("/v1/stats").json()["budget"] == 3 * MiB
    assert "replaces it" in caplog.text and "5242880" in caplog.text
    record = read_budget(Layout(root))
    assert record is not None and (record.max_bytes, record.set_by) == (3 * MiB, "shmcache serve --max-bytes")

    caplog.clear()
    with app_client(root) as client:  # no budget given: the root's stays
        assert client.get("/v1/budget").json()["max_bytes"] == 3 * MiB
        changed = client.put("/v1/budget", json={"max_bytes": 6 * MiB})
        assert changed.status_code == 200 and changed.json()["max_bytes"] == 6 * MiB
        for bad in ({"max_bytes": -1}, {"max_bytes": "6MiB"}, {"max_bytes": True}, {"bytes": 5}):
            assert client.put("/v1/budget", json=bad).status_code == 422, bad
        assert client.put("/v1/budget", json={"max_bytes": None}).json()["max_bytes"] is None
    assert "recorded in the root" in caplog.text
    assert Store(root).budget is None

    with app_client(root, max_fraction=0.25):  # recorded in bytes, as --max-bytes
        capacity = Store(root).stats().capacity
        record = read_budget(Layout(root))
        assert record is not None and record.set_by == "shmcache serve --max-fraction"
        assert record.max_bytes == int(capacity * 0.25)


def test_every_store_of_the_root_keeps_its_budget(root: Path) -> None:
    """Set in one Store, kept by another (another process sees the same file); a Store's own
    lower max_bytes still applies on top."""
    shmcache.set_budget(3 * MiB, root=root)
    other = Store(root)
    other.put_array("a", np.zeros(MiB, np.uint8))
    other.put_array("b", np.zeros(MiB, np.uint8))
    other.put_array("c", np.zeros(MiB, np.uint8))  # 3 MiB + headers: "a" goes
    assert [e.key for e in other.list()] == ["b", "c"] and other.stats().used <= 3 * MiB
    assert Store(root, max_bytes=MiB).budget == MiB and Store(root, max_bytes=64 * MiB).budget == 3 * MiB
    with pytest.raises(InvalidRequestError, match="max_bytes"):
        shmcache.set_budget(-5, root=root)
    with pytest.raises(InvalidRequestError, match="size such as"):
        shmcache.set_budget("lots", root=root)
    assert other.budget == 3 * MiB  # a refused budget changes nothing


def test_a_damaged_record_is_named_and_cleared(root: Path) -> None:
    store = Store(root)
    store.set_budget(MiB)
    Layout(root).budget.write_text("{not json")
    with pytest.raises(CacheRootError, match=r"budget record .* is damaged.*shmcache budget clear"):
        store.put_array("a", np.zeros(10, np.uint8))
    assert not store.exists("a")
    code, check = _doctor(root)
    assert code == 1 and check["status"] == "fail"
    assert cli("budget", "clear", "--root", str(root))[0] == 0
    store.put_array("a", np.zeros(10, np.uint8))


# ---------------------------------------------------------------------- two writers at once


def _put_pinned(root: Path, key: str, barrier: Barrier) -> None:
    barrier.wait(60)
    try:
        Store(root).put_array(key, np.ones(5 * MiB, np.uint8), pin=True)
    except CacheFullError:
        raise SystemExit(3) from None


def test_two_writers_racing_do_not_both_overshoot(root: Path) -> None:
    """Two processes put 5 MiB at the same instant under an 8 MiB budget: one publishes, the
    other gets CacheFullError (pinned entries cannot be evicted), round after round."""
    store = Store(root)
    store.set_budget(8 * MiB)
    for attempt in range(4):
        barrier = CTX.Barrier(2)
        procs = [CTX.Process(target=_put_pinned, args=(root, f"k{attempt}{i}", barrier)) for i in (0, 1)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(60)
        assert sorted(proc.exitcode or 0 for proc in procs) == [0, 3], [p.exitcode for p in procs]
        stats = store.stats()
        assert stats.entries == 1 and stats.used <= 8 * MiB
        store.evict(store.list()[0].key)


def _change_elsewhere(root: Path, step: int) -> None:
    store = Store(root)
    store.put_array(f"new{step}", np.zeros(1000 * (step + 1), np.uint8))
    store.put_array("replaced", np.zeros(5000 * (step + 1), np.uint8), overwrite=True)
    if step:
        store.evict(f"new{step - 1}")


def test_the_use_a_put_checks_follows_changes_made_by_other_processes(root: Path) -> None:
    """``used_bytes`` (what every put under a budget reads first) keeps the sizes it read and
    re-reads only keys whose generation slot changed: after puts, replacements and evictions
    by another process it equals a full read of every entry, with and without exclusions."""
    store = Store(root)
    for i in range(50):
        store.put_array(f"k{i}", np.zeros(i + 1, np.uint8))
    store.put_array("replaced", np.zeros(10, np.uint8))
    for step in range(4):
        assert used_bytes(store.layout) == sum(e.size for e in iter_infos(store.layout))
        proc = CTX.Process(target=_change_elsewhere, args=(root, step))
        proc.start()
        proc.join(60)
        assert proc.exitcode == 0
        infos = {e.key: e.size for e in iter_infos(store.layout)}
        assert used_bytes(store.layout) == sum(infos.values())
        assert used_bytes(store.layout, {"replaced", "k3", "absent"}) == (
            sum(infos.values()) - infos["replaced"] - infos["k3"]
        )


# ---------------------------------------------------------------------- the command


def test_a_cli_put_without_a_daemon_keeps_the_budget(root: Path, tmp_path: Path) -> None:
    shmcache.set_budget(3 * MiB, root=root)
    shmcache.put_array("old", np.zeros(2 * MiB, np.uint8), root=root)
    source = save(tmp_path / "new.npy", np.ones(2 * MiB, np.uint8))
    code, out, err = cli("put", str(source), "--key", "new", "--root", str(root))
    assert out.split() == ["new"]
    assert code == 0 and "no daemon" in err, err
    assert [e.key for e in Store(root).list()] == ["new"] and Store(root).stats().used <= 3 * MiB


def test_budget_command_without_a_daemon(root: Path) -> None:
    help_text = invoke("budget", "--help").stdout
    assert all(word in help_text for word in ("show", "set", "clear", "--root", "--local"))
    code, out, _ = cli("budget", "--root", str(root))
    assert code == 0 and "budget:   none" in out

    code, out, _ = cli("budget", "set", "1.5MiB", "--root", str(root))
    assert code == 0 and "1.5 MiB" in out and "set by shmcache budget" in out
    assert Store(root).budget == int(1.5 * MiB)
    shown = json.loads(cli("budget", "--root", str(root), "--json")[1])
    assert shown["max_bytes"] == int(1.5 * MiB) and shown["daemon"] is False and shown["over_budget"] is False

    for bad in ("lots", "10XB", "-5"):  # usage errors (exit 2), as serve --max-bytes 10XB
        code, _, err = cli("budget", "set", "--root", str(root), "--", bad)
        assert code == 2 and "SIZE must be" in err, (bad, err)
    assert Store(root).budget == int(1.5 * MiB)
    code, out, err = cli("budget", "set", "0", "--root", str(root))
    assert code == 0 and "a budget of 0 bytes: no put fits until it is raised" in err
    code, out, err = cli("budget", "set", "1.5MiB", "--root", str(root))
    assert code == 0 and Store(root).budget == int(1.5 * MiB)

    Store(root).put_array("a", np.zeros(MiB, np.uint8))
    code, out, err = cli("budget", "set", "100", "--root", str(root))
    assert code == 0 and "over the budget" in err and "shmcache evict" in err
    assert "a" in [e.key for e in Store(root).list()]  # lowering it evicts nothing by itself

    assert cli("budget", "clear", "--root", str(root))[0] == 0
    assert Store(root).budget is None and "budget:   none" in cli("budget", "show", "--root", str(root))[1]
    with temporary_root() as other:  # the group's --root wins over $SHMCACHE_ROOT (the root fixture's)
        assert cli("budget", "--root", str(other), "set", "2MiB")[0] == 0
        assert Store(other).budget == 2 * MiB and Store(root).budget is None
        assert "2.0 MiB" in cli("budget", "--root", str(other))[1]
        assert cli("budget", "--root", str(root), "set", "1MiB", "--root", str(other))[0] == 0  # its own wins
        assert Store(other).budget == MiB and Store(root).budget is None
