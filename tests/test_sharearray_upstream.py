"""python-sharearray's own tests and README examples, against ``shmcache.compat.sharearray``.

Written from what the original's ``test.py``, README and docstrings document (public
repository bshillingford/python-sharearray): the same calls with only the import changed,
each test in a temporary ``shm_path`` rather than ``/dev/shm``. Where the compat differs on
purpose, ``tests/test_compat_sharearray.py`` says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

from shmcache.compat import sharearray


@pytest.fixture
def shm_path(root: Path) -> str:
    """Stands for ``/dev/shm``: a fresh directory on the real tmpfs, removed afterwards."""
    return str(root)


def _absent(path: str) -> bool:
    return not os.path.exists(path)


# test.py


def test_simple(shm_path: str) -> None:
    """Creating from an array, then opening the same id again, gives the array both times."""
    array = np.random.default_rng(0).normal(size=(5, 6))
    first = sharearray.cache("testcache_simple", array_or_callback=array, shm_path=shm_path, timeout=-1)
    assert (first == array).all()
    second = sharearray.cache("testcache_simple", array_or_callback=array, shm_path=shm_path, timeout=-1)
    assert (second == array).all()
    del first, second
    sharearray.free("testcache_simple", shm_path=shm_path)


def test_callback(shm_path: str) -> None:
    """The file appears at the original's path once created, outlives the view, goes on free."""
    sharearray.free("testcache_callback", shm_path=shm_path)
    path, lock = sharearray._build_path("testcache_callback", shm_path=shm_path, prefix="sharearray_")
    assert path == os.path.join(shm_path, "sharearray_testcache_callback.npy")
    assert _absent(path) and _absent(lock)

    view = sharearray.cache("testcache_callback", lambda: np.ones((5, 6)), shm_path=shm_path, timeout=-1)
    assert os.path.exists(path) and _absent(lock)
    del view
    assert os.path.exists(path) and _absent(lock)

    sharearray.free("testcache_callback", shm_path=shm_path)
    assert _absent(path) and _absent(lock)


def test_decorator(shm_path: str) -> None:
    @sharearray.decorator("testcache_decorator", shm_path=shm_path, verbose=False)
    def data() -> np.ndarray:
        return np.ones((5, 6))

    sharearray.free("testcache_decorator", shm_path=shm_path)
    path, lock = sharearray._build_path("testcache_decorator", shm_path=shm_path, prefix="sharearray_")
    assert _absent(path) and _absent(lock)

    assert (data() == 1).all()  # the first call creates it
    assert os.path.exists(path) and _absent(lock)
    assert (data() == 1).all()  # the second one views it
    assert os.path.exists(path) and _absent(lock)

    sharearray.free("testcache_decorator", shm_path=shm_path)
    assert _absent(path) and _absent(lock)


# README


def test_readme_decorator_returns_read_only_views(shm_path: str) -> None:
    my_array = np.arange(12.0).reshape(3, 4)

    @sharearray.decorator("some_unique_id", shm_path=shm_path, verbose=False)
    def get_training_data() -> np.ndarray:
        return my_array

    arr_view = get_training_data()
    arr_view_2 = get_training_data()
    assert get_training_data.__name__ == "get_training_data"
    for view in (arr_view, arr_view_2):
        assert isinstance(view, np.ndarray) and np.array_equal(view, my_array)
        with pytest.raises(ValueError):
            view[0, 0] = -1


def test_readme_cache_function_and_where_the_file_is(shm_path: str) -> None:
    def create_large_array() -> np.ndarray:
        return np.linspace(0, 1, 1000, dtype=np.float32)

    arr = sharearray.cache("my_global_id", lambda: create_large_array(), shm_path=shm_path)
    assert np.array_equal(arr, create_large_array())
    on_disk = np.load(os.path.join(shm_path, "sharearray_my_global_id.npy"), mmap_mode="r")
    assert np.array_equal(on_disk, arr) and on_disk.dtype == np.float32


def test_readme_pytorch_tensor_over_the_view(shm_path: str) -> None:
    torch = pytest.importorskip("torch")
    data_numpy = sharearray.cache("torch_view", np.arange(6, dtype=np.int64), shm_path=shm_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable", as over the original's memmap
        data_torch = torch.from_numpy(data_numpy)
    assert data_torch.tolist() == list(range(6))


# The docstrings' promises


@pytest.mark.parametrize(
    "value",
    [
        [1, 2, 3],
        lambda: [1, 2, 3],
        np.array([1, "a", None], dtype=object),
        lambda: np.array([{}], dtype=object),
    ],
    ids=["list", "callback-returning-list", "object-dtype", "callback-returning-object-dtype"],
)
def test_what_is_not_an_array_of_values_raises_value_error(shm_path: str, value: object) -> None:
    with pytest.raises(ValueError):
        sharearray.cache("not_values", value, shm_path=shm_path, verbose=False)
    assert _absent(sharearray._build_path("not_values", "sharearray_", shm_path)[0])


@pytest.mark.parametrize("bad_id", ["a/b", "", "with space", "ü"])
def test_invalid_ids_raise_value_error(shm_path: str, bad_id: str) -> None:
    assert not sharearray.valid_id(bad_id)
    with pytest.raises(ValueError):
        sharearray.cache(bad_id, np.zeros(1), shm_path=shm_path, verbose=False)
    with pytest.raises(ValueError):
        sharearray.decorator(bad_id)


def test_valid_ids() -> None:
    assert all(sharearray.valid_id(i) for i in ["abc", "A-Z_0.9", "a=b+c", "..", "-"])


def test_timeout_exception_while_another_caller_creates(shm_path: str) -> None:
    started, release = threading.Event(), threading.Event()

    def slow() -> np.ndarray:
        started.set()
        release.wait(10)
        return np.zeros(3)

    creator = threading.Thread(target=lambda: sharearray.cache("busy", slow, shm_path, verbose=False))
    creator.start()
    try:
        assert started.wait(10)
        with pytest.raises(sharearray.TimeoutException):
            sharearray.cache("busy", np.ones(3), shm_path=shm_path, timeout=0, verbose=False)
    finally:
        release.set()
        creator.join()
    assert np.array_equal(sharearray.cache("busy", np.ones(3), shm_path=shm_path, verbose=False), np.zeros(3))


def test_another_process_gets_the_same_array(shm_path: str) -> None:
    sharearray.cache("across", np.arange(5), shm_path=shm_path, verbose=False)
    script = (
        "import sys\n"
        "from shmcache.compat import sharearray\n"
        "def fail():\n"
        "    raise SystemExit('the callback ran again')\n"
        "print(sharearray.cache('across', fail, shm_path=sys.argv[1], verbose=False).tolist())\n"
    )
    command = [sys.executable, "-c", script, shm_path]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0, 1, 2, 3, 4]"


@pytest.mark.parametrize("verbose", [True, False])
def test_verbose_and_log_func(shm_path: str, capsys: pytest.CaptureFixture[str], verbose: bool) -> None:
    lines: list[str] = []
    sharearray.cache("logged", np.zeros(1), shm_path=shm_path, verbose=verbose, log_func=lines.append)
    assert bool(lines) is verbose and all("logged" in line for line in lines)
    sharearray.cache("printed", np.zeros(1), shm_path=shm_path, verbose=verbose)
    assert ("printed" in capsys.readouterr().out) is verbose


def test_prefix_and_shm_path_place_the_file(root: Path) -> None:
    shm_path = str(root / "shm")
    sharearray.cache("x", lambda: np.ones(2), shm_path=shm_path, prefix="myprog_", verbose=False)
    assert os.path.exists(os.path.join(shm_path, "myprog_x.npy"))
    sharearray.free("x", shm_path=shm_path, prefix="myprog_")
    assert _absent(os.path.join(shm_path, "myprog_x.npy"))
