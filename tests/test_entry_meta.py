"""``meta.json`` read through one typed record (``_disk/meta.EntryMeta``): keys it does not
know are kept, keys older entries lack read as their defaults, and a value of the wrong
type is a damaged entry (named, with the fix), never a crash deep in a reader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmcache import CorruptEntryError, Store
from shmcache._disk.meta import EntryMeta, read_meta


def _meta_path(store: Store, key: str) -> Path:
    return store.layout.objects / store.info(key).version / "meta.json"


def _rewrite(store: Store, key: str, **changes: Any) -> None:
    path = _meta_path(store, key)
    meta = json.loads(path.read_text())
    meta.update(changes)
    for name in [name for name, value in changes.items() if value is ...]:
        del meta[name]
    path.chmod(0o600)
    path.write_text(json.dumps(meta))


def test_unknown_keys_are_kept_and_an_owner_is_read(store: Store) -> None:
    store.put_array("a", np.arange(4))
    _rewrite(store, "a", owner_uid=1234, written_by_a_newer_version={"x": [1, 2]})
    meta = read_meta(store.layout, store.info("a").version)
    assert meta is not None
    assert meta.owner_uid == 1234 and meta.kind == "array" and meta.shape == (4,)
    assert meta.to_json()["written_by_a_newer_version"] == {"x": [1, 2]}
    assert EntryMeta.from_json(meta.to_json()) == meta
    assert store.open_array("a").tolist() == [0, 1, 2, 3] and store.verify("a") is True


def test_keys_an_older_entry_lacks_read_as_their_defaults(store: Store) -> None:
    store.put_array("old", np.ones(3))
    _rewrite(store, "old", files=..., pinned=..., checksum=..., owner_uid=...)
    meta = read_meta(store.layout, store.info("old").version)
    assert meta is not None
    assert (meta.files, meta.pinned, meta.checksum, meta.owner_uid) == (None, False, None, None)
    assert store.info("old").pinned is False
    assert store.verify("old") is False  # no checksums recorded: nothing to compare, still readable


@pytest.mark.parametrize(
    ("field", "value"),
    [("shape", "4"), ("files", [1]), ("owner_uid", "me"), ("pinned", 1), ("size", 1.5)],
)
def test_a_value_of_the_wrong_type_is_a_damaged_entry(store: Store, field: str, value: object) -> None:
    store.put_array("a", np.arange(4))
    _rewrite(store, "a", **{field: value})
    for read in (store.open, store.verify):
        damaged = rf"damaged: its meta.json records {field} = .*`shmcache evict a`"
        with pytest.raises(CorruptEntryError, match=damaged):
            read("a")
    with pytest.raises(ValueError, match=f"records {field} = "):
        EntryMeta.from_json(json.loads(_meta_path_of(store).read_text()))


def _meta_path_of(store: Store) -> Path:
    (version,) = [p.name for p in store.layout.objects.iterdir()]
    return store.layout.objects / version / "meta.json"
