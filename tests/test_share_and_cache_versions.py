"""share() and cache() never hand back a stale value or replace another's silently (issue 18
item 5): cache() records a version and reloads when it differs; share() refuses other content
under a key unless told to replace it, and takes what Datasets really hold (label lists,
config dicts of mixed values)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shmcache


def _counting_loader(calls: list[int]) -> object:
    def load() -> np.ndarray:
        calls.append(1)
        return np.full(3, len(calls))

    return load


def test_cache_reloads_when_the_version_changes(store: shmcache.Store) -> None:
    calls: list[int] = []
    load = _counting_loader(calls)
    assert store.cache("vocab", load, version=1).tolist() == [1, 1, 1]
    assert store.cache("vocab", load, version=1).tolist() == [1, 1, 1]  # same version: no reload
    assert store.cache("vocab", load).tolist() == [1, 1, 1]  # no version: whatever is there
    assert len(calls) == 1
    assert store.cache("vocab", load, version=2).tolist() == [2, 2, 2]  # the loader changed
    assert store.cache("vocab", load, version="2").tolist() == [3, 3, 3]  # "2" is not 2
    assert store.cache("vocab", load, version=("2", 7)).tolist() == [4, 4, 4]
    assert store.cache("vocab", load, version=("2", 7)).tolist() == [4, 4, 4]
    assert len(calls) == 4


def test_cache_reloads_when_a_versioned_input_file_changes(store: shmcache.Store, tmp_path: Path) -> None:
    source = tmp_path / "vocab.txt"
    source.write_text("a b")
    load = lambda: np.array(source.read_text().split())  # noqa: E731
    assert store.cache("words", load, version=source).tolist() == ["a", "b"]
    source.write_text("a b c")
    assert store.cache("words", load, version=source).tolist() == ["a", "b", "c"]
    with pytest.raises(shmcache.SourceNotFoundError, match="cannot be read"):
        store.cache("words", load, version=tmp_path / "missing.txt")


def test_a_versioned_cache_replaces_an_unversioned_entry(store: shmcache.Store) -> None:
    store.put_array("emb", np.zeros(2))
    assert store.cache("emb", lambda: np.ones(2), version="v2").tolist() == [1.0, 1.0]
    assert store.cache("emb", lambda: np.zeros(2)).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("bad", [True, 1.5, object(), None.__class__, ["a", {"b": 1}]])
def test_cache_refuses_what_is_not_a_version(store: shmcache.Store, bad: object) -> None:
    with pytest.raises(shmcache.UnsupportedDataError, match="is not a version"):
        store.cache("k", lambda: np.zeros(1), version=bad)
    assert not store.exists("k")


def test_cache_version_holds_across_processes(root: Path) -> None:
    """Two experiment processes asking for one version load once; a third with another loads again."""
    script = (
        "import sys, numpy as np, shmcache\n"
        "a = shmcache.cache('feats', lambda: np.array([int(sys.argv[1])]), version=sys.argv[1])\n"
        "print(int(a[0]))\n"
    )

    def run(version: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", script, version],
            capture_output=True,
            text=True,
            check=True,
            env=os.environ | {"SHMCACHE_ROOT": str(root)},
        )
        return int(done.stdout)

    assert run("1") == 1
    before = shmcache.Store(root).info("feats").version
    assert run("1") == 1
    assert shmcache.Store(root).info("feats").version == before  # not written again
    assert run("2") == 2


def test_share_of_labels_and_scores_gives_arrays(store: shmcache.Store) -> None:
    labels = store.share("labels", [3, 1, 2])
    assert isinstance(labels, np.ndarray) and labels.dtype == np.int64 and labels.tolist() == [3, 1, 2]
    big = store.share("ids", [1, 2**40, -(2**62)])
    assert big.dtype == np.int64 and big.tolist() == [1, 2**40, -(2**62)]
    scores = store.share("scores", [0.5, 1, 2])
    assert scores.dtype == np.float64 and scores.tolist() == [0.5, 1.0, 2.0]
    flags = store.share("flags", [True, False])
    assert flags.dtype == np.bool_ and flags.tolist() == [True, False]
    numpy_scalars = store.share("np", [np.float32(1.5), np.float32(2)])
    assert numpy_scalars.dtype == np.float32
    assert not labels.flags.writeable


@pytest.mark.parametrize(
    ("values", "why"),
    [
        ([True, 1], "bools with numbers"),
        ([1, 2**70], "beyond int64"),
        ([0.5, 2**60 + 1], "would round"),
    ],
)
def test_share_refuses_number_lists_it_would_change(
    store: shmcache.Store, values: list[object], why: str
) -> None:
    with pytest.raises(shmcache.UnsupportedDataError, match=why):
        store.share("n", values)
    assert not store.exists("n")


def test_share_of_a_dict_of_mixed_values(store: shmcache.Store) -> None:
    config = {"lr": 0.1, "name": "resnet", "layers": [64, 128], "extra": {"a": None}, "on": True}
    shared = store.share("cfg", config)
    assert dict(shared) == config
    assert type(shared["lr"]) is float and type(shared["on"]) is bool
    with pytest.raises(shmcache.UnsupportedDataError, match="arrays may not be mixed"):
        store.share("bad", {"a": np.zeros(2), "b": "x"})
