"""The tests and the benchmarks never touch the user's own cache (issue 18 item 6).

A user runs the suite (or ``.ci/run``) on a machine where their daemon serves their default
root. Nothing may go into that root or through that daemon. The test builds exactly that
machine inside a private mount namespace (a fresh tmpfs on ``/dev/shm``, so the real one is
never seen): a daemon on the default root holding one entry of the user's, then a nested
pytest run of the modules that start CLIs, scripts and daemons, and the quick grid search
benchmark, all with a user's environment (no ``SHMCACHE_*``). Afterwards the root holds the
same entries and the daemon answered no request but ours.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent

# Runs as root inside `unshare --mount`: mounts its own /dev/shm, then plays the user.
_INNER = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from pathlib import Path
    import numpy as np
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g", "tmpfs", "/dev/shm"], check=True)
    for name in [name for name in os.environ if name.startswith("SHMCACHE_")]:
        del os.environ[name]  # the user's shell: no SHMCACHE_ROOT (the test's sandbox is not theirs)
    user_env = dict(os.environ)
    import shmcache
    from shmcache.client import Client
    root = shmcache.default_root()
    daemon = subprocess.Popen([sys.executable, "-m", "shmcache", "serve", "--allow-source", "/"],
                              env=user_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import atexit
    atexit.register(daemon.kill)  # whatever fails below, no daemon keeps our pipes open
    client = Client(root, timeout=60)
    for _ in range(600):
        try:
            client.health()
            break
        except Exception:
            time.sleep(0.1)
    source = Path("/dev/shm/user-feats.npy")
    np.save(source, np.arange(1000, dtype=np.float32))
    client.put_file("mine/feats", source)
    import httpx
    raw = httpx.Client(transport=httpx.HTTPTransport(uds=str(client.socket_path)), timeout=60)

    def requests():
        counts = {}
        for line in raw.get("http://daemon/metrics").text.splitlines():
            if line.startswith("shmcache_request_duration_seconds_count{"):
                labels, value = line.rsplit(" ", 1)
                if 'route="/metrics"' not in labels:
                    counts[labels] = float(value)
        return counts

    def entries():
        return sorted((e.key, e.version) for e in shmcache.Store(root).list())

    before = (entries(), requests())
    runs = [
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *sys.argv[1:]],
        [sys.executable, "scripts/bench_all.py", "--quick", "--only", "grid_search",
         "--out", "/dev/shm/bench-out"],
    ]
    codes = [subprocess.run(run, env=user_env, capture_output=True, text=True, timeout=600) for run in runs]
    after = (entries(), requests())
    alive = daemon.poll() is None
    daemon.terminate()
    daemon.wait(timeout=60)
    print(json.dumps({
        "before": before, "after": after, "alive": alive,
        "codes": [c.returncode for c in codes],
        "tails": [(c.stdout + c.stderr)[-3000:] for c in codes],
    }))
    """
)


def test_a_run_beside_a_daemon_on_the_default_root_leaves_both_untouched(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a private /dev/shm needs root and unshare(1)")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.decode().strip()}")
    script = tmp_path / "inner.py"
    script.write_text(_INNER)
    modules = ["tests/test_cli_scripting.py"]  # CLIs in subprocesses given no root, and `shmcache root`
    done = subprocess.run(
        ["unshare", "--mount", sys.executable, str(script), *modules],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["codes"] == [0, 0], report["tails"]
    assert report["alive"], "the user's daemon died during the run"
    entries_before, requests_before = report["before"]
    entries_after, requests_after = report["after"]
    assert [key for key, _ in entries_before] == ["mine/feats"]
    assert entries_after == entries_before  # nothing put, replaced or evicted in the user's root
    assert requests_after == requests_before  # and no request reached the user's daemon
