"""The ``shmcache`` command against a real temporary root (in-process, no daemon)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import CLI, cli, save
from service_helpers import disk_usage, fresh_root, wait_for

import shmcache
from shmcache._disk.layout import Layout
from shmcache._units import human_bytes


def test_put_ls_info_stats_evict_round_trip(root: Path, tmp_path: Path) -> None:
    data = np.arange(12, dtype=np.int32).reshape(3, 4)
    np.save(tmp_path / "a.npy", data)
    code, out, _ = cli("put", str(tmp_path / "a.npy"), "--key", "feats/a", "--root", str(root))
    assert code == 0 and out.split() == ["feats/a"]
    np.testing.assert_array_equal(shmcache.open_array("feats/a", root=root), data)

    code, out, _ = cli("ls", "--json", "--root", str(root))
    listed = json.loads(out)
    assert code == 0 and [e["key"] for e in listed] == ["feats/a"]
    assert listed[0]["shape"] == [3, 4] and listed[0]["dtype"] == "int32"

    code, out, _ = cli("ls", "--root", str(root))
    assert code == 0 and "feats/a" in out and "3x4" in out

    code, out, _ = cli("info", "feats/a", "--root", str(root))
    assert code == 0 and json.loads(out)["source"] == str(tmp_path / "a.npy")

    code, out, _ = cli("stats", "--json", "--root", str(root))
    assert code == 0 and json.loads(out)["entries"] == 1

    code, out, _ = cli("evict", "feats/a", "--root", str(root))
    assert code == 0 and "evicted feats/a" in out
    assert shmcache.Store(root).list() == []


def test_put_a_directory_of_files_as_blobs(root: Path, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.jpg").write_bytes(b"\xff\xd8 jpeg")
    (tmp_path / "sub" / "b.png").write_bytes(b"\x89PNG")
    code, out, err = cli("put", str(tmp_path), "--key", "imgs", "--root", str(root))
    assert code == 0, err
    assert out.split() == ["imgs"]  # no array files: one blobs entry
    save(tmp_path / "x.npy", np.arange(3))
    code, out, err = cli("put", str(tmp_path), "--key", "mixed", "--root", str(root))
    assert code == 1 and "--as arrays" in err and "--as blobs" in err
    code, out, err = cli("put", str(tmp_path), "--key", "all", "--as", "blobs", "--root", str(root))
    assert code == 0 and out.split() == ["all"], err
    assert list(shmcache.open_blobs("all", root=root).names) == ["a.jpg", "sub/b.png", "x.npy"]
    code, out, err = cli("put", str(tmp_path), "--key", "arr", "--as", "arrays", "--root", str(root))
    assert code == 0 and out.split() == ["arr/x"], err
    code, out, _ = cli("ls", "--root", str(root))
    assert code == 0 and "bytes" in out
    code, out, _ = cli("put", "--help")
    assert code == 0 and "--as" in out and "blobs" in out
    for kind in (".parquet", ".jsonl", "save_to_disk", "token", "Megatron", "Tar"):  # what PATH may be
        assert kind in out, kind


def test_root_comes_from_the_environment(root: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "b.npy", np.ones(3))
    code, _, _ = cli("put", str(tmp_path / "b.npy"), "--key", "b")
    assert code == 0
    assert [e.key for e in shmcache.Store(root).list()] == ["b"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["put", "/does/not/exist", "--key", "x"], "does not exist"),
        (["put", "{src}", "--key", "bad key"], "invalid key"),
        (["evict", "missing"], "no entry 'missing'"),
        (["info", "missing"], "no entry 'missing'"),
    ],
)
def test_failures_exit_1_with_a_one_line_message(
    root: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    np.save(tmp_path / "src.npy", np.ones(2))
    argv = [a.replace("{src}", str(tmp_path / "src.npy")) for a in args]
    code, out, err = cli(*argv)
    assert code == 1
    assert message in err and "Traceback" not in err + out
    assert len(err.strip().splitlines()) == 1


def test_existing_key_needs_overwrite(root: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "c.npy", np.ones(2))
    assert cli("put", str(tmp_path / "c.npy"), "--key", "c")[0] == 0
    code, _, err = cli("put", str(tmp_path / "c.npy"), "--key", "c")
    assert code == 1 and "already exists" in err
    assert cli("put", str(tmp_path / "c.npy"), "--key", "c", "--overwrite")[0] == 0


def test_usage_errors_exit_2(root: Path) -> None:
    assert cli("ls", "--no-such-option")[0] == 2
    assert cli("put")[0] == 2


# A writer killed (SIGKILL: no cleanup runs) while it copies a put_file: its flock is gone,
# its lock file and partial version stay in tmp/.
DEAD_WRITER = textwrap.dedent("""
    import os, signal, sys
    import shmcache

    def die(done, total):
        if done:
            os.kill(os.getpid(), signal.SIGKILL)

    shmcache.Store(sys.argv[1]).put_file("big", sys.argv[2], progress=die)
""")


def test_cleanup_frees_what_a_killed_writer_left(root: Path, tmp_path: Path) -> None:
    source = save(tmp_path / "big.npy", np.arange(1 << 18, dtype=np.int64))  # 2 MiB
    killed = subprocess.run([sys.executable, "-c", DEAD_WRITER, str(root), str(source)], check=False)
    assert killed.returncode == -signal.SIGKILL
    tmp = Layout(root).tmp
    left = disk_usage(tmp)
    assert left >= source.stat().st_size  # the partial copy is still there
    assert any(p.suffix == ".lock" for p in tmp.iterdir())
    code, out, _ = cli("cleanup", "--root", str(root))
    assert code == 0 and out.strip() == f"freed {human_bytes(left)}"
    assert list(tmp.iterdir()) == [] and shmcache.Store(root).list() == []
    code, out, _ = cli("cleanup", "--root", str(root))
    assert code == 0 and out.strip() == "freed 0 B"  # nothing left the second time


def test_demo_runs_end_to_end_in_a_subprocess(root: Path) -> None:
    done = subprocess.run([*CLI, "demo", "--rows", "1000"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ok: workers saw the same data" in done.stdout
    assert shmcache.Store(root).info("demo/features").shape == (1000, 64)


@pytest.mark.slow
def test_demo_names_the_command_as_it_was_run(root: Path, tmp_path: Path) -> None:
    """The README runs ``.venv/bin/shmcache`` without activating the venv: ``next:`` says
    that path, not a bare ``shmcache`` the shell cannot find."""
    script = Path(sys.executable).parent / "shmcache"
    if not script.exists():
        pytest.skip("no shmcache console script beside this interpreter")
    link = tmp_path / "bin" / "shmcache"
    link.parent.mkdir()
    link.symlink_to(script)
    env = {**os.environ, "PATH": "/usr/bin:/bin", "SHMCACHE_ROOT": str(root)}
    done = subprocess.run(["bin/shmcache", "demo", "--rows", "1000"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "next: bin/shmcache ls; bin/shmcache stats; bin/shmcache evict demo/features" in done.stdout


def test_help_lists_every_command() -> None:
    code, out, _ = cli("--help")
    assert code == 0
    for command in ("put", "ls", "info", "evict", "cleanup", "stats", "verify", "serve", "demo"):
        assert command in out


def test_help_shows_flags_without_a_value() -> None:
    """Typer 0.29 printed ``--json <bool>``: ``ls --json true`` then listed the prefix "true"."""
    import typer

    from shmcache._cli.app import app

    group = typer.main.get_command(app)
    names = [name for name in group.commands]  # type: ignore[attr-defined]
    assert {"put", "ls", "serve", "budget"} <= set(names)
    for name in ["", *names, "budget set"]:
        code, out, _ = cli(*name.split(), "--help")
        assert code == 0 and "--help" in out, name
        assert "<bool>" not in out, f"shmcache {name} --help:\n{out}"
    code, out, _ = cli("ls", "--help")
    assert "<path>" in out  # options that take a value still show it


def test_python_dash_m_runs_the_cli(store: shmcache.Store) -> None:
    store.put_array("m", np.arange(3))
    done = subprocess.run(
        [sys.executable, "-m", "shmcache", "evict", "m", "missing"],
        capture_output=True, text=True, check=False,
    )
    assert done.returncode == 1  # the exit status comes through
    assert done.stdout.startswith("evicted m (") and done.stderr.startswith("error: no entry 'missing'")
    assert not store.exists("m")


@pytest.fixture
def other(tmp_path: Path) -> Iterator[Path]:
    """A second fresh root on /dev/shm."""
    path = fresh_root()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_root_goes_before_the_command_too(root: Path, other: Path, tmp_path: Path) -> None:
    """``shmcache --root R put ...`` was a usage error (exit 2) though ``--team`` works there.
    The global one wins over $SHMCACHE_ROOT (``root`` is that variable here), the command's
    own --root over the global one, as a subcommand's over ``budget --root``."""
    save(tmp_path / "a.npy", np.arange(3))
    code, out, err = cli("--root", str(other), "put", str(tmp_path / "a.npy"), "-k", "a", "--local")
    assert code == 0 and out.split() == ["a"], err
    assert cli("--root", str(other), "ls")[1].splitlines()[1].split()[0] == "a"
    assert shmcache.Store(other).exists("a") and not shmcache.Store(root).exists("a")
    assert cli("--root", str(other), "root")[1].strip() == str(other)
    assert cli("--root", str(other), "root", "--root", str(root))[1].strip() == str(root)
    assert cli("root")[1].strip() == str(root)  # the next command line: no global root left over
    code, out, err = cli("--root", str(other), "budget", "set", "1MiB", "--local")
    assert code == 0 and shmcache.Store(other).budget == 1 << 20, err
    code, _, err = cli("--root", str(other), "--team", "vision", "ls")
    assert code == 2 and "not both" in err, err  # a usage error, as `shmcache --team vision ls --root R`


@pytest.mark.slow
def test_serve_takes_the_global_root(root: Path, other: Path) -> None:
    daemon = subprocess.Popen(
        [*CLI, "--root", str(other), "serve"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(lambda: (other / "daemon.sock").is_socket() or daemon.poll() is not None, 60, "the daemon")
        code, out, err = cli("--root", str(other), "stats")
        assert code == 0 and "daemon:   running" in out, (out, err)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.communicate(timeout=60)
