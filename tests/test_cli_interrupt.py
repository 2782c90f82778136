"""Ctrl+C on ``shmcache put`` through the daemon says what happened, at any moment.

A load interrupted near its end may be published anyway (the daemon was already
publishing when the cancel came): the command asks the daemon, and its message and exit
status must match what ``shmcache ls`` then lists, wherever the interrupt lands.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import cli, cli_process
from service_helpers import Daemon, unique, write_big_npy
from shmcache.client import Client

pytest.importorskip("fastapi")

POINTS = 20
SIZE = 96 << 20
"""About 1.5 s at the test daemon's --max-load-rate: long enough to land inside the load."""
HANG_S = 60.0


def _listed(root: Path, key: str) -> bool:
    code, out, err = cli("ls", key, "--json", "--root", str(root))
    assert code == 0, err
    return key in {entry["key"] for entry in json.loads(out)}


def _before_the_command(err: str) -> bool:
    """Whether a Ctrl+C landed before ``shmcache.cli`` was even loaded (the interpreter
    importing the package, on a loaded machine): Python's own KeyboardInterrupt, which no
    code of the command can catch."""
    return err.rstrip().endswith("KeyboardInterrupt") and "shmcache/cli.py" not in err and "_cli" not in err


def _lost_by_python(err: str) -> bool:
    """Whether the Ctrl+C landed where Python cannot raise it (an import lock's weakref
    callback: Python prints "Exception ignored in: <function _get_module_lock..." and goes
    on), so the command never saw it and ran to its end."""
    text = err.strip()
    return (
        text.startswith("Exception ignored in: <function _get_module_lock")
        and text.endswith(("KeyboardInterrupt", "KeyboardInterrupt:"))
        and text.count("Traceback") == 1
    )


def _startup_s() -> float:
    """How long the interpreter takes to reach ``shmcache.cli.main`` (before then, Ctrl+C
    is Python's; from there on the command's own imports are covered): the slowest of three."""
    times = []
    for _ in range(3):
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", "import shmcache.cli"], check=True)
        times.append(time.monotonic() - started)
    return max(times)


def test_ctrl_c_anywhere_in_a_daemon_put_reports_what_ls_shows(daemon: Daemon, data_dir: Path) -> None:
    source = write_big_npy(data_dir / f"{unique('interrupted')}.npy", SIZE)
    root = str(daemon.root)
    key = unique("whole")
    started = time.monotonic()
    baseline = cli_process("put", str(source), "--key", key, "--root", root)
    baseline.communicate(timeout=HANG_S)
    whole = time.monotonic() - started
    assert baseline.returncode == 0 and _listed(daemon.root, key)
    first = 1.5 * _startup_s()  # (noisy machines: well past the imports)
    outcomes = []
    for point in range(POINTS):  # from the end of the imports to past the end of the load
        delay = first + (whole * 1.1 - first) * point / (POINTS - 1)
        key = unique(f"at{point}")
        process = cli_process("put", str(source), "--key", key, "--root", root)
        try:
            time.sleep(delay)
            sent = process.poll() is None
            if sent:
                process.send_signal(signal.SIGINT)
            out, err = process.communicate(timeout=HANG_S)
        finally:
            if process.poll() is None:
                process.kill()
        listed = _listed(daemon.root, key)
        context = (point, round(delay, 2), process.returncode, out, err)
        if _before_the_command(err):  # the startup took longer than measured: Python's Ctrl+C
            assert not listed and out == "", context
            outcomes.append("before the command")
            continue
        if _lost_by_python(err):  # Python swallowed the Ctrl+C: the command went on, whole
            assert process.returncode == 0 and listed and out.split() == [key], context
            outcomes.append("lost by Python")
            continue
        assert "Traceback" not in err, context
        if process.returncode == -signal.SIGINT:  # the put had finished: SIGINT found Python exiting
            assert listed and out.split() == [key] and err == "", context
            outcomes.append("published")
        elif process.returncode == 0:
            assert listed and out.split() == [key], context
            if sent:
                assert err.strip().endswith("interrupted: published (the load had finished)"), context
            outcomes.append("published")
        else:
            assert process.returncode == 130 and not listed and out == "", context
            said = (err.strip().splitlines() or ["(nothing)"])[-1]
            assert said in ("interrupted: cancelled, nothing published",  # the daemon's answer
                            "interrupted: nothing partial was published (see `shmcache ls`)",
                            "interrupted: nothing done"), context  # before the command started
            outcomes.append("cancelled")
        with Client(daemon.root) as client:  # whatever it said, nothing is left running
            assert not [job for job in client.jobs() if job.key == key and job.active], context
    assert "cancelled" in outcomes, outcomes  # the points did span the load


@pytest.mark.parametrize("fraction", [0.3, 1.0])
def test_an_interrupted_client_put_file_says_how_the_load_ended(
    daemon: Daemon, data_dir: Path, fraction: float
) -> None:
    source = write_big_npy(data_dir / f"{unique('client')}.npy", SIZE)
    key = unique("client")

    def interrupt(done: int, total: int) -> None:
        if done >= fraction * total:
            raise KeyboardInterrupt

    with Client(daemon.root) as client, pytest.raises(KeyboardInterrupt) as raised:
        client.put_file(key, source, progress=interrupt)
    (note,) = getattr(raised.value, "__notes__", ["(no note)"])
    if _listed(daemon.root, key):
        assert note == f"the load of {key!r} had finished: published {key}", note
    else:
        assert note == f"the load of {key!r} ended cancelled: nothing published", note
    if fraction < 1.0:
        assert "nothing published" in note


SLOW_IMPORT = """
import importlib.abc, sys, time
class Slow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "shmcache._cli.app":
            print("importing", flush=True)
            time.sleep(30)
        return None
sys.meta_path.insert(0, Slow())
from shmcache.cli import main
sys.argv = ["shmcache", "ls"]
main()
"""


def test_ctrl_c_while_the_command_loads_its_modules_says_nothing_was_done(tmp_path: Path) -> None:
    """A Ctrl+C that lands while the command imports Typer, rich and the store (slow on a
    loaded machine) is the command's, not a traceback from inside an import."""
    env = {**os.environ, "SHMCACHE_ROOT": str(tmp_path / "root")}
    process = subprocess.Popen([sys.executable, "-c", SLOW_IMPORT], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "importing"
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=HANG_S)
    finally:
        if process.poll() is None:
            process.kill()
    assert (process.returncode, err) == (130, "interrupted: nothing done\n"), (out, err)
