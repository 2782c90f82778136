"""Writing through tensors: ``torch.from_numpy(open_array(key))`` sits on the read-only
shared mapping and dies with SIGSEGV on its first write, so the docs say so plainly and
show ``shmcache.torch`` instead, whose tensors are writable and private to the process."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
from service_helpers import clean_env

import shmcache
import shmcache.torch
from shmcache._disk.layout import ENV_ROOT

README = Path(__file__).resolve().parents[1] / "README.md"


def _run(root: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=clean_env({ENV_ROOT: str(root)}),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_writing_through_from_numpy_of_open_array_kills_the_process(store: shmcache.Store) -> None:
    """What the docs warn about, as it is: a signal, not an exception."""
    store.put_array("k", np.arange(1024, dtype=np.float32))
    done = _run(
        store.root,
        """
        import warnings, torch, shmcache
        warnings.simplefilter("ignore")  # torch only warns that the array is not writable
        torch.from_numpy(shmcache.open_array("k")).add_(1)
        print("survived")
        """,
    )
    assert done.returncode == -signal.SIGSEGV, (done.returncode, done.stderr[-2000:])
    assert "survived" not in done.stdout
    assert store.open_array("k")[:3].tolist() == [0.0, 1.0, 2.0]


def test_the_tensors_of_shmcache_torch_are_writable_and_private(store: shmcache.Store) -> None:
    store.put_array("k", np.arange(1024, dtype=np.float32))
    done = _run(
        store.root,
        """
        import warnings, shmcache.torch
        warnings.simplefilter("error")  # no "not writable" warning either
        t = shmcache.torch.as_tensor("k")
        t.add_(1)
        print(t[:3].tolist())
        """,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[1.0, 2.0, 3.0]"
    tensor = shmcache.torch.as_tensor("k", root=store.root)
    tensor[0] = 100
    assert store.open_array("k")[:3].tolist() == [0.0, 1.0, 2.0]  # the cache never changes


def _section(text: str, title: str) -> str:
    start = text.index(f"\n### {title}")
    return text[start : text.index("\n#", start + 1)]


def test_the_docs_say_it_plainly_and_show_shmcache_torch() -> None:
    section = _section(README.read_text(), "PyTorch helpers")
    assert "torch.from_numpy(shmcache.open_array(key))" in section
    assert re.search(r"segmentation\s+fault\s+\(SIGSEGV\)", section)
    assert "shmcache.torch.as_tensor(key)" in section and "CachedDataset" in section
    for doc in (shmcache.open_array.__doc__, shmcache.Store.open_array.__doc__):
        assert doc is not None and "SIGSEGV" in doc and "shmcache.torch.as_tensor" in doc
