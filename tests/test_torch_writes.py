"""Writing through tensors of cached arrays: never a SIGSEGV, never a change another process sees.

Every write runs in a subprocess of its own, so that a segmentation fault is a failed
test (its exit code is checked) rather than a dead pytest. Each script asks a second
process, while it still maps the entry, for the entry's bytes; afterwards this process
checks them too, and ``verify`` checks the file against the checksums of the put.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from service_helpers import clean_env

import shmcache
import shmcache.torch
from shmcache._disk.attach import overcommit_is_strict
from shmcache._disk.layout import ENV_ROOT

pytestmark = pytest.mark.skipif(
    overcommit_is_strict(),
    reason="strict overcommit (vm.overcommit_memory=2): entries are mapped shared read-only",
)
PYTORCH_GUIDE = Path(__file__).resolve().parents[1] / "docs" / "pytorch.md"
ORIGINAL = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)

PRELUDE = '''
import subprocess, sys, warnings
import numpy as np
import torch
import shmcache

warnings.simplefilter("ignore", UserWarning)  # torch: "the given NumPy array is not writable"
ORIGINAL = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)


def others_see(key):
    """The entry's bytes as another process sees them while this one maps it."""
    code = "import shmcache, sys; sys.stdout.write(shmcache.open_array(sys.argv[1]).tobytes().hex())"
    out = subprocess.run([sys.executable, "-c", code, key], capture_output=True, text=True, check=True)
    return np.frombuffer(bytes.fromhex(out.stdout), np.float32).reshape(ORIGINAL.shape)


class Rows(torch.utils.data.Dataset):
    """The docs' Dataset: rows of open_array, as views."""

    def __init__(self, key, write_in_worker=False):
        self.x = shmcache.open_array(key)
        self.write_in_worker = write_in_worker

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.write_in_worker:
            return torch.from_numpy(self.x[i]).sub_(0.5)
        return self.x[i]
'''


def _run_script(tmp_path: Path, root: Path, body: str) -> subprocess.CompletedProcess[str]:
    """Run ``PRELUDE + body`` as a script file (spawn workers re-import it) in a fresh
    process on ``root``; the body prints "ok" once it has checked what it must."""
    script = tmp_path / "writer.py"
    main = textwrap.indent(textwrap.dedent(body), "    ")
    script.write_text(f"{PRELUDE}\n\nif __name__ == '__main__':\n{main}")
    return subprocess.run(
        [sys.executable, str(script)],
        env=clean_env({ENV_ROOT: str(root)}),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _assert_survived_and_cache_unchanged(
    done: subprocess.CompletedProcess[str], store: shmcache.Store
) -> None:
    assert done.returncode == 0, f"exit code {done.returncode} (-11 is SIGSEGV)\n{done.stderr[-3000:]}"
    assert done.stdout.strip().endswith("ok"), done.stdout[-2000:]
    np.testing.assert_array_equal(store.open_array("k"), ORIGINAL)  # this process: the cache's bytes
    assert store.verify("k")  # the file itself, against the checksums of the put


WRITES = {
    # the README repro: a Dataset of open_array rows, no workers, no batching, an in-place op
    "readme_dataloader_num_workers_0_batch_size_none": """
        loader = torch.utils.data.DataLoader(Rows("k"), num_workers=0, batch_size=None)
        for b in loader:
            b.sub_(0.5)
        assert float(b[0]) == ORIGINAL[-1, 0] - 0.5  # the write landed (in this process)
    """,
    "from_numpy_item_assignment": """
        torch.from_numpy(shmcache.open_array("k"))[0] = 0
        assert not shmcache.open_array("k")[0].any()  # this process's copy of the page
    """,
    "as_tensor_mul_": """
        torch.as_tensor(shmcache.open_array("k")).mul_(2)
    """,
    "optimizer_step_on_a_parameter_over_the_entry": """
        weight = torch.nn.Parameter(torch.from_numpy(shmcache.open_array("k")))
        weight.sum().backward()
        torch.optim.SGD([weight], lr=0.1).step()
    """,
    "numpy_setflags_write_true": """
        view = shmcache.open_array("k")[3:5]
        view.setflags(write=True)
        view[...] = -1
    """,
}


@pytest.mark.parametrize("write", list(WRITES))
def test_an_in_place_write_stays_in_the_writing_process(
    write: str, store: shmcache.Store, tmp_path: Path
) -> None:
    store.put_array("k", ORIGINAL)
    body = (
        WRITES[write]
        + """
        assert np.array_equal(others_see("k"), ORIGINAL)  # while this process still maps it
        print("ok")
    """
    )
    _assert_survived_and_cache_unchanged(_run_script(tmp_path, store.root, body), store)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_writes_in_workers_and_on_their_batches(context: str, store: shmcache.Store, tmp_path: Path) -> None:
    """Workers write into the rows they read; the main process writes into the batches."""
    store.put_array("k", ORIGINAL)
    body = f"""
        for batch_size in (None, 4):
            loader = torch.utils.data.DataLoader(
                Rows("k", write_in_worker=True), num_workers=1, batch_size=batch_size,
                multiprocessing_context="{context}",
            )
            seen = torch.cat([b.reshape(-1, 256).mul_(2) for b in loader])
            assert torch.equal(seen, (torch.from_numpy(ORIGINAL) - 0.5) * 2)
        assert np.array_equal(others_see("k"), ORIGINAL)
        print("ok")
    """
    _assert_survived_and_cache_unchanged(_run_script(tmp_path, store.root, body), store)


def test_shmcache_torch_tensors_are_writable_and_private_to_the_tensor(
    store: shmcache.Store, tmp_path: Path
) -> None:
    store.put_array("k", ORIGINAL)
    body = """
        import shmcache.torch
        warnings.simplefilter("error")  # no "not writable" warning from these
        by_key = shmcache.torch.as_tensor("k")
        by_array = shmcache.torch.as_tensor(shmcache.open_array("k")[2:])
        by_key.add_(1)
        by_array.mul_(0)
        assert float(by_key[0, 1]) == 2.0 and not by_array.any()
        assert np.array_equal(shmcache.open_array("k"), ORIGINAL)  # not even this process's arrays
        assert np.array_equal(others_see("k"), ORIGINAL)
        print("ok")
    """
    _assert_survived_and_cache_unchanged(_run_script(tmp_path, store.root, body), store)


@pytest.mark.parametrize(("num_workers", "batch_size"), [(0, None), (0, 4), (1, None), (1, 4)])
def test_cached_dataset_batches_take_in_place_writes(
    num_workers: int, batch_size: int | None, store: shmcache.Store, tmp_path: Path
) -> None:
    store.put_array("k", ORIGINAL)
    collate = "shmcache.torch.collate" if batch_size else "None"  # None: torch's default_convert
    body = f"""
        import shmcache.torch
        ds = shmcache.torch.CachedDataset("k")
        loader = torch.utils.data.DataLoader(
            ds, num_workers={num_workers}, batch_size={batch_size}, collate_fn={collate}
        )
        for _epoch in range(2):
            for b in loader:
                b.sub_(0.5)
        assert np.array_equal(shmcache.open_array("k"), ORIGINAL)
        assert np.array_equal(others_see("k"), ORIGINAL)
        print("ok")
    """
    _assert_survived_and_cache_unchanged(_run_script(tmp_path, store.root, body), store)


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}")
    return text[start : text.index("\n#", start + 1)]


def test_the_docs_say_what_a_write_through_torch_does() -> None:
    section = " ".join(_section(PYTORCH_GUIDE.read_text(), "PyTorch helpers").split())
    assert "torch.from_numpy(shmcache.open_array(key))" in section
    assert "copy-on-write" in section and "never the cache" in section
    assert "shmcache.torch.as_tensor(key)" in section and "CachedDataset" in section
    assert "vm.overcommit_memory=2" in section  # where the promise does not hold
    for doc in (shmcache.open_array.__doc__, shmcache.Store.open_array.__doc__):
        assert doc is not None and "SIGSEGV" not in doc and "shmcache.torch.as_tensor" in doc
