"""The one dispatch over kinds of sources (``_sources/dispatch``): which kind a path or URL
is, and whether what a key holds was loaded from a directory of array files as it is now
(what the daemon's preload asks before it loads again)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from shmcache.service.sources import is_up_to_date

import shmcache
from shmcache import InvalidSourceError, SourceKindError, Store
from shmcache._sources.dispatch import classify_source, plan_source
from tests.source_times import age


def test_each_kind_of_source_is_told_apart(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(3))
    (tmp_path / "t.jsonl").write_text('{"x": 1}\n')
    images = tmp_path / "images"
    images.mkdir()
    (images / "0.png").write_bytes(b"png")
    assert classify_source("s3://bucket/a.npy").kind == "remote"
    assert classify_source(f"file://{tmp_path}/a.npy").location == f"{tmp_path}/a.npy"
    assert classify_source(tmp_path / "a.npy").kind == "arrays"
    assert classify_source(tmp_path / "t.jsonl").kind == "table"
    assert classify_source(tmp_path / "t.jsonl", as_="blobs").kind == "blobs"
    assert classify_source(images).kind == "blobs"  # a directory without array files
    with pytest.raises(ValueError, match="no kind put_file makes"):
        classify_source(tmp_path / "a.npy", as_="tables")


@pytest.mark.parametrize("as_", ["table", "tables", "", None, "AUTO"])
def test_an_unknown_as_is_a_typed_error_naming_the_source_and_the_kinds(
    store: Store, tmp_path: Path, as_: object
) -> None:
    """``put_file(path, as_="table")`` raised a bare ValueError: now a SourceKindError (an
    InvalidSourceError, still a ValueError) naming the source and the kinds, from
    put_file, plan_file and shmcache.put_file alike; nothing published."""
    (tmp_path / "t.jsonl").write_text('{"x": 1}\n')
    for source in (tmp_path / "t.jsonl", tmp_path, [tmp_path / "a.tar"], "s3://bucket/t.parquet"):
        for put in (
            store.put_file,
            store.plan_file,
            lambda k, p, **kw: shmcache.put_file(k, p, root=store.root, **kw),
        ):
            with pytest.raises(SourceKindError) as info:
                put("k", source, as_=as_)
            message = str(info.value)
            assert isinstance(info.value, ValueError) and isinstance(info.value, InvalidSourceError)
            shown = str(source[0]) if isinstance(source, list) else str(source)
            assert shown in message and all(repr(kind) in message for kind in ("auto", "arrays", "blobs"))
    assert store.list() == []


def test_plan_file_is_the_dispatch_s_plan(store: Store, tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(3))
    np.savez(tmp_path / "b.npz", x=np.zeros(2), y=np.ones(4))
    planned = store.plan_file("k", tmp_path)
    assert planned == plan_source("k", tmp_path)
    assert [p.key for p in planned] == ["k/a", "k/b/x", "k/b/y"]
    assert store.list() == []  # a dry run writes nothing


def test_a_directory_of_array_files_is_current_until_a_file_is_added_or_changed(
    store: Store, tmp_path: Path
) -> None:
    top = tmp_path / "feats"
    (top / "sub").mkdir(parents=True)
    np.save(top / "a.npy", np.arange(3))
    np.savez(top / "sub" / "b.npz", x=np.zeros(2))
    (top / "notes.txt").write_text("not an array file: never loaded, never compared")
    age(top)  # else racily clean: never current
    store.put_file("feats", top, as_="arrays")
    assert is_up_to_date(store, "feats", top)
    np.save(top / "sub" / "c.npy", np.arange(4))  # a file the entries do not hold yet
    assert not is_up_to_date(store, "feats", top)
    age(top)
    store.put_file("feats", top, as_="arrays", overwrite=True)
    assert is_up_to_date(store, "feats", top)
    os.utime(top / "a.npy", ns=(1, 1))
    assert not is_up_to_date(store, "feats", top)
    assert not is_up_to_date(store, "other", top)  # nothing loaded under that key
