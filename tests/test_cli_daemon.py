"""The ``shmcache`` command against a real daemon, and the same commands without one."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import cli, cli_process, errors_only, invoke, save, stale_socket
from service_helpers import Daemon, running_daemon, temporary_root, unique, wait_for, write_big_npy
from shmcache.client import Client

import shmcache
from shmcache._disk.layout import ENV_SOCKET, Layout

pytest.importorskip("fastapi")

NO_DAEMON = "no daemon on"


@pytest.fixture(scope="module")
def budget_daemon(data_dir: Path) -> Iterator[Daemon]:
    with temporary_root() as root, running_daemon(
        root, "--allow-source", str(data_dir), "--max-bytes", "1MiB"
    ) as running:
        yield running


@pytest.fixture
def client(daemon: Daemon) -> Iterator[Client]:
    with Client(daemon.root) as connected:
        yield connected


def job_keys(client: Client) -> set[str]:
    return {job.key for job in client.jobs()}


# ---------------------------------------------------------------------- through the daemon


def test_put_goes_through_the_daemon(daemon: Daemon, client: Client, data_dir: Path) -> None:
    key = unique("feats")
    array = np.arange(120, dtype=np.float32).reshape(10, 12)
    code, out, err = cli("put", str(save(data_dir / f"{key}.npy", array)), "--key", key,
                         "--pin", "--root", str(daemon.root))
    assert code == 0, err
    assert out.split() == [key] and NO_DAEMON not in err
    assert key in job_keys(client)  # the daemon did the load
    assert client.info(key).pinned
    np.testing.assert_array_equal(shmcache.open_array(key, root=daemon.root), array)


def test_put_a_glob_puts_each_match_under_key_stem(daemon: Daemon, client: Client, data_dir: Path) -> None:
    folder = data_dir / unique("glob")
    folder.mkdir()
    for name in ("a", "b"):
        save(folder / f"{name}.npy", np.full(4, ord(name)))
    (folder / "notes.txt").write_text("not matched")
    key = unique("g")
    code, out, err = cli("put", str(folder / "*.npy"), "--key", key, "--root", str(daemon.root))
    assert code == 0, err
    assert out.split() == [f"{key}/a", f"{key}/b"]
    assert {f"{key}/a", f"{key}/b"} <= job_keys(client)


def test_put_a_directory_with_a_progress_bar(daemon: Daemon, data_dir: Path) -> None:
    folder = data_dir / unique("dir")
    (folder / "sub").mkdir(parents=True)
    save(folder / "x.npy", np.zeros(1000))
    save(folder / "sub" / "y.npy", np.ones(1000))
    key = unique("d")
    code, out, err = cli("put", str(folder), "--key", key, "--progress", "--root", str(daemon.root))
    assert code == 0, err
    assert sorted(out.split()) == [f"{key}/sub/y", f"{key}/x"]
    assert f"put {key}" in err and "KiB" in err  # rich's bar, in bytes, on stderr


def test_put_as_blobs_goes_through_the_daemon(daemon: Daemon, client: Client, data_dir: Path) -> None:
    folder = data_dir / unique("imgs")
    (folder / "sub").mkdir(parents=True)
    (folder / "a.jpg").write_bytes(b"\xff\xd8 jpeg")
    (folder / "sub" / "b.png").write_bytes(b"\x89PNG")
    save(folder / "x.npy", np.zeros(3))
    key = unique("imgs")
    code, out, err = cli("put", str(folder), "--key", key, "--root", str(daemon.root))
    assert code == 1 and "--as arrays" in err and "--as blobs" in err  # mixed: the daemon asks
    code, out, err = cli("put", str(folder), "--key", key, "--as", "blobs", "--root", str(daemon.root))
    assert code == 0, err
    assert out.split() == [key] and NO_DAEMON not in err and key in job_keys(client)
    blobs = shmcache.open_blobs(key, root=daemon.root)
    assert list(blobs.names) == ["a.jpg", "sub/b.png", "x.npy"]
    assert bytes(blobs["sub/b.png"]) == b"\x89PNG" and client.info(key).kind == "blobs"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["put", "{data}/missing.npy", "--key", "m"], "does not exist"),
        (["put", "{data}/nothing-*.npy", "--key", "m"], "matches"),
        (["put", "{data}/src.npy", "--key", "bad key"], "invalid key"),
        (["info", "missing/key"], "no entry 'missing/key'"),
        (["info", "bad key"], "invalid key"),
        (["evict", "missing/key"], "no entry 'missing/key'"),
        (["evict", "--prefix", "missing"], "no entry is 'missing'"),
        (["ls", "bad key"], "invalid key"),
        (["verify", "missing/key"], "no entry 'missing/key'"),
    ],
)
def test_failures_through_the_daemon_exit_1_with_one_line(
    daemon: Daemon, data_dir: Path, args: list[str], message: str
) -> None:
    save(data_dir / "src.npy", np.ones(2))
    argv = [a.replace("{data}", str(data_dir)) for a in args]
    code, out, err = cli(*argv, "--root", str(daemon.root))
    assert code == 1, (out, err)
    assert message in err and "Traceback" not in out + err
    assert len(errors_only(err)) == 1 and NO_DAEMON not in err


def test_put_existing_key_needs_overwrite(daemon: Daemon, data_dir: Path) -> None:
    key = unique("again")
    source = str(save(data_dir / f"{key}.npy", np.arange(3)))
    assert cli("put", source, "--key", key, "--root", str(daemon.root))[0] == 0
    code, _, err = cli("put", source, "--key", key, "--root", str(daemon.root))
    assert code == 1 and "already exists" in err
    assert cli("put", source, "--key", key, "--overwrite", "--root", str(daemon.root))[0] == 0


def test_put_beyond_the_budget_is_cache_full(budget_daemon: Daemon, data_dir: Path) -> None:
    key = unique("huge")
    source = write_big_npy(data_dir / f"{key}.npy", 2 << 20)
    code, out, err = cli("put", str(source), "--key", key, "--root", str(budget_daemon.root))
    assert code == 1 and out == ""
    assert "budget" in err or "room" in err or "full" in err, err
    assert not shmcache.Store(budget_daemon.root).exists(key)


def test_ctrl_c_cancels_the_daemon_load_and_exits_130(daemon: Daemon, client: Client, data_dir: Path) -> None:
    key = unique("slow")
    source = write_big_npy(data_dir / f"{key}.npy", 256 << 20)  # ~4 s at the daemon's LOAD_RATE
    process = cli_process("put", str(source), "--key", key, "--root", str(daemon.root))
    try:
        wait_for(lambda: any(j.key == key and j.state == "running" for j in client.jobs()), 30, "a load")
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, err
    assert "cancelled" in err and "Traceback" not in err
    (job,) = [j for j in client.jobs() if j.key == key]
    wait_for(lambda: client.job(job.id).state == "cancelled", 10, "job cancelled")
    assert not shmcache.Store(daemon.root).exists(key)


def test_ls_info_json_with_mapped_by(daemon: Daemon, client: Client, data_dir: Path) -> None:
    prefix = unique("list")
    for name in ("a", "b"):
        client.load(f"{prefix}/{name}", save(data_dir / f"{prefix}-{name}.npy", np.ones((2, 3))), wait=True)
    mapped = shmcache.open_array(f"{prefix}/a", root=daemon.root)  # this process maps it
    code, out, err = cli("ls", prefix, "--json", "--root", str(daemon.root))
    assert code == 0, err
    listed = json.loads(out)
    assert [e["key"] for e in listed] == [f"{prefix}/a", f"{prefix}/b"]
    assert listed[0]["shape"] == [2, 3] and listed[0]["dtype"] == "float64"
    assert os.getpid() in listed[0]["mapped_by"] and listed[1]["mapped_by"] == []

    code, out, _ = cli("ls", prefix, "--root", str(daemon.root))
    header, first, second = out.splitlines()
    assert header.split()[:5] == ["KEY", "KIND", "DTYPE", "SHAPE", "SIZE"] and "MAPPED BY" in header
    assert "2x3" in first and str(os.getpid()) in first and str(os.getpid()) not in second

    code, out, _ = cli("info", f"{prefix}/a", "--root", str(daemon.root))
    detail = json.loads(out)
    assert code == 0 and os.getpid() in detail["mapped_by"] and detail["checksum"].startswith("crc32:")
    del mapped


def test_evict_keys_and_prefixes(daemon: Daemon, client: Client, data_dir: Path) -> None:
    prefix = unique("ev")
    for name in ("a", "b", "c"):
        client.load(f"{prefix}/{name}", save(data_dir / f"{prefix}-{name}.npy", np.ones(3)), wait=True)
    code, out, _ = cli("evict", f"{prefix}/a", "--root", str(daemon.root))
    assert code == 0 and out.startswith(f"evicted {prefix}/a (")
    code, out, _ = cli("evict", "--prefix", prefix, "--root", str(daemon.root))
    assert code == 0 and re.findall(r"evicted (\S+)", out) == [f"{prefix}/b", f"{prefix}/c"]
    assert client.list(prefix) == []
    code, _, err = cli("evict", "missing/one", f"{prefix}/none", "--root", str(daemon.root))
    assert code == 1 and len(errors_only(err)) == 2


def test_stats_cleanup_verify_through_the_daemon(daemon: Daemon, client: Client, data_dir: Path) -> None:
    key = unique("st")
    client.load(key, save(data_dir / f"{key}.npy", np.arange(10)), wait=True)
    code, out, _ = cli("stats", "--json", "--root", str(daemon.root))
    stats = json.loads(out)
    assert code == 0 and stats["daemon"] is True and stats["root"] == str(daemon.root)
    assert stats["entries"] >= 1 and "jobs_running" in stats and "held_by_readers_bytes" in stats
    code, out, _ = cli("stats", "--root", str(daemon.root))
    assert code == 0 and "daemon:   running" in out and "jobs:" in out
    code, out, _ = cli("cleanup", "--root", str(daemon.root))
    assert code == 0 and out.startswith("freed ")
    code, out, _ = cli("verify", key, "--root", str(daemon.root))
    assert code == 0 and out.split() == ["ok", key]


# ---------------------------------------------------------------------- without a daemon


def test_put_without_a_daemon_loads_in_process_with_a_notice(root: Path, tmp_path: Path) -> None:
    code, out, err = cli("put", str(save(tmp_path / "a.npy", np.arange(5))), "--key", "a", "--progress")
    assert code == 0 and out.split() == ["a"]
    assert f"notice: no daemon on {root}; loading in this process" in err
    assert "/168 bytes" in err.split("loading in this process", 1)[1]  # the progress bar follows
    # speed in the sizes' binary units, never rich's decimal GB/s beside GiB
    assert re.search(r"\d (B|KiB|MiB|GiB)/s", err) and not re.search(r"\d ?[kMG]B/s", err)
    assert shmcache.Store(root).info("a").shape == (5,)


def test_a_stale_socket_is_no_daemon(root: Path, tmp_path: Path) -> None:
    stale_socket(Layout(root).socket)
    code, out, err = cli("put", str(save(tmp_path / "a.npy", np.arange(5))), "--key", "a")
    assert code == 0 and out.split() == ["a"] and NO_DAEMON in err
    code, out, _ = cli("stats", "--json")
    assert code == 0 and json.loads(out)["daemon"] is False


def test_a_daemon_of_another_root_is_not_used(root: Path, daemon: Daemon, tmp_path: Path) -> None:
    code, _, err = cli(
        "put", str(save(tmp_path / "a.npy", np.arange(5))), "--key", "mine",
        env={ENV_SOCKET: str(daemon.socket_path)},
    )
    assert code == 0 and NO_DAEMON in err
    assert shmcache.Store(root).exists("mine") and not shmcache.Store(daemon.root).exists("mine")


def test_glob_in_process_and_its_failures(root: Path, tmp_path: Path) -> None:
    save(tmp_path / "x.npy", np.zeros(2))
    np.savez(tmp_path / "y.npz", m=np.ones(2))
    code, out, err = cli("put", str(tmp_path / "*"), "--key", "g")
    assert code == 0, err
    assert out.split() == ["g/x", "g/y/m"]
    save(tmp_path / "x2.npy", np.zeros(2))
    np.savez(tmp_path / "x2.npz", m=np.ones(2))
    code, _, err = cli("put", str(tmp_path / "x2.*"), "--key", "h")
    assert code == 1 and "both be put as 'h/x2'" in err
    code, _, err = cli("put", str(tmp_path / "nothing*.npy"), "--key", "h")
    assert code == 1 and "no file or directory matches" in err
    (tmp_path / "bad.npy").write_bytes(b"garbage")
    code, out, err = cli("put", str(tmp_path / "*.npy"), "--key", "k")
    assert code == 1 and out == "" and shmcache.Store(root).list("k") == []  # validated before copying


def test_ls_and_info_show_mappers_without_a_daemon(store: shmcache.Store) -> None:
    store.put_array("m", np.arange(4))
    mapped = store.open_array("m")
    code, out, _ = cli("ls", "--json")
    assert code == 0 and json.loads(out)[0]["mapped_by"] == [os.getpid()]
    code, out, _ = cli("ls")
    assert str(os.getpid()) in out.splitlines()[1]
    code, out, _ = cli("info", "m")
    assert code == 0 and json.loads(out)["mapped_by"] == [os.getpid()]
    del mapped


def test_evict_prefix_in_process(store: shmcache.Store) -> None:
    for key in ("p/a", "p/b", "pq"):
        store.put_array(key, np.arange(2))
    code, out, _ = cli("evict", "--prefix", "p")
    assert code == 0 and re.findall(r"evicted (\S+)", out) == ["p/a", "p/b"]
    assert [e.key for e in store.list()] == ["pq"]


def test_verify_ok_no_checksum_and_corrupt(store: shmcache.Store) -> None:
    store.put_array("good", np.arange(1000))
    store.put_array("bad", np.arange(1000))
    store.put_array("old", np.arange(10))
    old = store.layout.objects / store.info("old").version / "meta.json"
    meta = json.loads(old.read_text())
    del meta["checksum"]
    old.write_text(json.dumps(meta))
    code, out, _ = cli("verify", "good")
    assert code == 0 and out.split() == ["ok", "good"]
    data = store.layout.objects / store.info("bad").version / "data.npy"
    data.chmod(0o600)
    with open(data, "r+b") as fp:
        fp.seek(-8, os.SEEK_END)
        fp.write(b"\xff" * 8)
    code, out, err = cli("verify")
    found = dict(
        (m.group(2), m.group(1)) for m in re.finditer(r"^(ok|no checksum|CORRUPT)\s+([^\s:]+)", out, re.M)
    )
    assert code == 1 and found == {"good": "ok", "old": "no checksum", "bad": "CORRUPT"}
    assert "checksum" in out.split("CORRUPT", 1)[1]  # the reason follows
    assert "1 corrupt entry" in err


def test_ctrl_c_in_process_exits_130(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: object, **kwargs: object) -> list[str]:
        raise KeyboardInterrupt

    monkeypatch.setattr(shmcache.Store, "put_file", interrupted)
    code, out, err = cli("put", str(save(tmp_path / "a.npy", np.arange(5))), "--key", "a")
    assert code == 130 and out == "" and "interrupted" in err


def test_debug_shows_the_traceback(root: Path) -> None:
    plain = invoke("info", "missing")
    assert plain.exit_code == 1 and plain.stderr.startswith("error: no entry 'missing'")
    assert isinstance(plain.exception, SystemExit)  # a clean exit, no exception escaped
    debug = invoke("--debug", "info", "missing")
    assert isinstance(debug.exception, shmcache.KeyNotFoundError)  # it propagates, with its traceback
    assert debug.exc_info is not None and debug.exc_info[2] is not None
    assert "error:" not in debug.stderr  # instead of the one-line message


def test_debug_shows_the_traceback_of_a_failed_daemon_load(daemon: Daemon, data_dir: Path) -> None:
    key = unique("dbg")
    source = str(save(data_dir / f"{key}.npy", np.arange(3)))
    assert cli("put", source, "--key", key, "--root", str(daemon.root))[0] == 0
    debug = invoke("--debug", "put", source, "--key", key, "--root", str(daemon.root))
    assert isinstance(debug.exception, shmcache.KeyExistsError) and "error:" not in debug.stderr


# ---------------------------------------------------------------------- help and docs/command-line.md agree


def test_help_and_readme_list_the_same_commands() -> None:
    from shmcache.cli import app

    code, out, _ = cli("--help")
    assert code == 0
    names = sorted(
        [
            command.name or (command.callback.__name__ if command.callback else "")
            for command in app.registered_commands
        ]
        + [group.name or "" for group in app.registered_groups]  # commands with subcommands: budget
    )
    section = (Path(__file__).parent.parent / "docs" / "command-line.md").read_text()  # the command guide
    for name in names:
        assert re.search(rf"`shmcache {name}\b", section), f"docs/command-line.md lacks {name}"
        assert re.search(rf"^\s*│?\s*{name}\b", out, re.MULTILINE), f"--help lacks {name}"
    for documented in set(re.findall(r"`shmcache ([a-z][a-z-]*)", section)):
        assert documented in names, f"the guide documents shmcache {documented}, which does not exist"
