"""Layering: the core loads numpy alone; the design's public names exist (``__all__`` against
the public names, both ways, is test_exported_members.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shmcache

HEAVY = ["fastapi", "uvicorn", "httpx", "torch", "typer", "rich"]


def test_import_shmcache_loads_no_service_client_or_torch() -> None:
    code = (
        "import json, sys, shmcache; "
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_opening_an_array_loads_no_heavy_module(root: object) -> None:
    code = (
        "import json, sys, numpy as np, shmcache; "
        "shmcache.put_array('k', np.arange(3)); shmcache.open_array('k'); "
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


WRITE_SIDE = [
    "shmcache._store.store", "shmcache._store.writing", "shmcache._store.sources", "shmcache._store.planned",
    "shmcache._store.loading", "shmcache._store.remote", "shmcache._store.blobs", "shmcache._store.tables",
    "shmcache._store.hdf5", "shmcache._store.array_files", "shmcache._store.space", "shmcache._store.budget",
    "shmcache._store.locks", "shmcache._store.maintenance", "shmcache._store.catalog",
    "shmcache._store.putting", "shmcache._store.putting_files",
    "shmcache._disk.writer", "shmcache._disk.fs", "shmcache._disk.checksum", "shmcache._disk.source_files",
    "shmcache._disk.urls", "shmcache._disk.entry_tree", "shmcache._disk.procmaps",
    "shmcache._disk.safetensors",
    "shmcache._disk.torch_zip", "shmcache._containers.encode", "shmcache._containers.table_encode",
    "shmcache._containers.table_pack", "shmcache._containers.table_arrow",
    "hashlib", "zipfile", "shutil", "fcntl", "filelock", "orjson",
    "shmcache._store.lock_table", "shmcache._store.lock_batches", "shmcache._store.key_slots",
    # nor what only other calls need
    "logging", "shmcache._containers.group", "shmcache._store.records",
]


@pytest.mark.parametrize(
    ("opener", "key"), [("open_array", "a"), ("open", "a"), ("open_strings", "s"), ("open_table", "t")]
)
def test_opening_an_entry_in_a_fresh_process_loads_no_write_side(root: Path, opener: str, key: str) -> None:
    """Issue 22: a fresh process that opens one entry imports what reading needs and no
    more (the store's write side, sources, remote loads, encoders, locks)."""
    shmcache.put_array("a", np.arange(3))
    shmcache.put_strings("s", ["x", "y"])
    shmcache.put_table("t", {"n": [1, 2]})
    code = (
        "import json, sys, shmcache; "
        f"got = shmcache.{opener}({key!r}); assert len(got) in (2, 3), got; "
        f"print(json.dumps(sorted(m for m in {WRITE_SIDE!r} if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert json.loads(out.stdout) == []


def test_the_store_shares_the_module_functions_attachments(root: Path) -> None:
    """The Store-less open path and every Store of the root share one reader: the same
    array object, one mapping per entry per process."""
    shmcache.put_array("a", np.arange(3))
    code = (
        "import shmcache; a = shmcache.open_array('a'); s = shmcache.get_store(); "
        "assert s.open_array('a') is a and shmcache.get_store(s.root).open_array('a') is a; "
        "assert shmcache.Store(s.root).open_array('a') is not a; print('ok')"  # a Store of its own
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "ok"


DEFERRED = ["filelock", "json", "zipfile", "logging", "tempfile", "dataclasses", "uuid", "hashlib", "secrets"]


def test_a_plain_import_loads_no_submodule_and_nothing_deferred() -> None:
    """``import shmcache`` binds its public names lazily (PEP 562): a spawned worker loads
    the store's modules only when it first uses one (issue 11's import-time target)."""
    code = (
        "import sys, numpy; before = set(sys.modules); import shmcache; "
        "print(' '.join(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    loaded = out.stdout.split()
    assert loaded == ["shmcache"]
    assert not [name for name in DEFERRED if name in loaded]


def test_lazy_names_resolve_and_stay_bound() -> None:
    code = (
        "import json, sys, shmcache; from shmcache import Store, open_array, KeyNotFoundError; "
        "assert shmcache.open_array is open_array and 'open_array' in vars(shmcache); "
        "assert set(shmcache.__all__) <= set(dir(shmcache)); "
        "print(json.dumps([m for m in ['filelock'] if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert json.loads(out.stdout) == []  # no lock library at all: locks are plain flock


def test_public_api_names_from_design() -> None:
    for name in [
        "open_array", "put_array", "put_file", "cache", "Store", "ShmCacheError", "KeyNotFoundError",
        "KeyExistsError", "InvalidKeyError", "UnsupportedDataError", "CacheFullError",
        "LockTimeoutError", "DaemonUnavailableError",
    ]:
        assert name in shmcache.__all__, name


def test_service_and_client_install_under_shmcache() -> None:
    import shmcache.client
    import shmcache.service

    assert shmcache.service.__name__ == "shmcache.service"
    assert shmcache.client.__name__ == "shmcache.client"
    # From outside the checkout, no generic top-level name leaks into site-packages.
    for name in ("service", "client"):
        probe = subprocess.run(
            [sys.executable, "-c", f"import {name}"], cwd="/", capture_output=True, text=True
        )
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr


def test_shmcache_torch_without_torch_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # what Python does for a missing package
        "import shmcache\n"
        "try:\n    import shmcache.torch\n"
        "except ModuleNotFoundError as exc:\n    print(exc.name, '|', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    name, message = out.stdout.split(" | ", 1)
    assert name == "torch" and "pip install torch" in message and "shmcache.torch needs PyTorch" in message
