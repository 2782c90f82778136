"""Damage inside one's own root is named (issue 18, item 13): an edited or deleted
``meta.json``, a trimmed checksum list, an entry link swapped to another key's data, a
missing or truncated file. Every read raises ``CorruptEntryError`` naming the key and the
fix, and ``verify`` (library and CLI) reports each, even those ``ls`` cannot show.

The damage is done to the real files of a real root, as a user's stray ``rm`` or editor
would."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_helpers import cli

from shmcache import CorruptEntryError, Store
from shmcache._disk.layout import encode_key
from shmcache._disk.manifest import encode_manifest, read_manifest_entry, read_manifest_keys

KINDS: dict[str, Callable[[Store, str], None]] = {
    "array": lambda store, key: store.put_array(key, np.arange(12, dtype=np.float32).reshape(3, 4)),
    "strings": lambda store, key: store.put_strings(key, ["x", "yy", "zzz"]),
    "records": lambda store, key: store.put_records(key, [{"a": 1}, {"b": [2, 3]}]),
    "table": lambda store, key: store.put_table(key, {"x": [1, 2, 3], "y": ["a", "b", "c"]}),
}


def _version_dir(store: Store, key: str) -> Path:
    return store.layout.version_dir(os.readlink(store.layout.entry_link(key)).rpartition("/")[2])


def _edit_meta(store: Store, key: str, edit: Callable[[dict[str, Any]], object]) -> None:
    path = _version_dir(store, key) / "meta.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.chmod(0o600)
    path.write_text(json.dumps(meta))


def _data_files(store: Store, key: str) -> list[Path]:
    return sorted(_version_dir(store, key).glob("*.npy"))


def _swap_link(store: Store, key: str) -> None:
    link = store.layout.entry_link(key)
    target = os.readlink(store.layout.entry_link("other"))
    os.unlink(link)
    os.symlink(target, link)


DAMAGE: dict[str, Callable[[Store, str], object]] = {
    "meta.json deleted": lambda store, key: (_version_dir(store, key) / "meta.json").unlink(),
    "meta.json not JSON": lambda store, key: (_version_dir(store, key) / "meta.json").write_text("{oops"),
    "meta.json not an object": lambda store, key: (_version_dir(store, key) / "meta.json").write_text("[1]"),
    "meta.json without its files": lambda store, key: _edit_meta(store, key, lambda m: m.pop("files")),
    "link swapped to another key's data": _swap_link,
    "a file deleted": lambda store, key: _data_files(store, key)[0].unlink(),
    "a file truncated": lambda store, key: os.truncate(_data_files(store, key)[-1], 20),
    "its whole data directory removed": lambda store, key: shutil.rmtree(_version_dir(store, key)),
}
ONLY_META = {d for d in DAMAGE if d.startswith("meta.json")} | {"link swapped to another key's data"}
"""Damage that ``open_array`` cannot see: it reads the data file alone (its cold path
reads no meta.json, and the data is intact); ``open``, ``info`` and ``verify`` name it."""
CASES = [
    (kind, damage)
    for kind in KINDS
    for damage in DAMAGE
    if (kind, damage) != ("array", "meta.json without its files")  # an array's file list may be left out
]


@pytest.fixture
def damaged_store(store: Store, request: pytest.FixtureRequest) -> tuple[Store, str, str]:
    kind, damage = request.param
    store.put_array("other", np.arange(5))
    KINDS[kind](store, "k")
    DAMAGE[damage](store, "k")
    return store, kind, damage


def _names_key_and_fix(error: BaseException, key: str = "k") -> None:
    text = str(error)
    assert f"entry {key!r} is damaged" in text, text
    assert "`shmcache verify`" in text and f"`shmcache evict {key}`" in text, text


@pytest.mark.parametrize("damaged_store", CASES, indirect=True, ids=str)
def test_every_read_of_a_damaged_entry_names_it(damaged_store: tuple[Store, str, str]) -> None:
    store, kind, damage = damaged_store
    fresh = Store(store.root)  # nothing warm
    reads: list[Callable[[], object]] = [lambda: fresh.open("k"), lambda: store.verify("k")]
    if kind == "array" and damage not in ONLY_META:
        reads.append(lambda: Store(store.root).open_array("k"))
    if (damage.startswith("meta.json") and damage != "meta.json without its files") or "link" in damage:
        reads.append(lambda: store.info("k"))
    for read in reads:
        with pytest.raises(CorruptEntryError) as caught:
            opened = read()
            if kind != "array":
                list(opened)  # type: ignore[call-overload]
        _names_key_and_fix(caught.value)
    assert store.open_array("other").tolist() == list(range(5))  # the rest of the root is fine


def _meta_edits() -> dict[str, Callable[[dict[str, Any]], object]]:
    return {
        "dtype": lambda m: m.update(dtype="int8"),
        "shape": lambda m: m.update(shape=[99]),
        "nbytes": lambda m: m.update(nbytes=1),
        "size": lambda m: m.update(size=10),
        "version": lambda m: m.update(version="elsewhere.1"),
        "checksum list trimmed": lambda m: m.update(checksum=m["checksum"].split(",")[0]),
        "a file left out": lambda m: m.update(files=m["files"][1:]),
    }


@pytest.mark.parametrize("edit", list(_meta_edits()))
def test_verify_checks_meta_json_against_the_data(store: Store, edit: str) -> None:
    kind = "array" if edit in ("dtype", "shape", "size", "version") else "strings"
    KINDS[kind](store, "k")
    assert store.verify("k") is True
    _edit_meta(store, "k", _meta_edits()[edit])
    with pytest.raises(CorruptEntryError) as caught:
        store.verify("k")
    _names_key_and_fix(caught.value)


def test_verify_checks_each_link_against_its_key(store: Store) -> None:
    store.put_array("a", np.arange(3))
    store.put_array("other", np.arange(5))
    _swap_link(store, "a")
    with pytest.raises(CorruptEntryError, match=r"its link points at the data of entry 'other'"):
        store.verify("a")
    assert store.verify("other") is True


def test_old_entries_without_a_recorded_key_still_open_and_verify(store: Store) -> None:
    store.put_array("a", np.arange(3))
    store.put_strings("s", ["x"])
    for key in ("a", "s"):
        _edit_meta(store, key, lambda m: m.pop("key"))
        assert store.verify(key) is True
    assert Store(store.root).open("s")[0] == "x"
    assert Store(store.root).open("a").tolist() == [0, 1, 2]


def test_evict_removes_a_damaged_entry_and_leaves_the_data_of_another(store: Store) -> None:
    store.put_array("other", np.arange(5))
    store.put_strings("s", ["x"])
    store.put_array("a", np.arange(3))
    (_version_dir(store, "s") / "meta.json").unlink()
    _swap_link(store, "a")
    store.evict("s")
    store.evict("a")
    assert [e.key for e in store.list()] == ["other"]
    assert store.verify("other") is True
    assert Store(store.root).open_array("other").tolist() == list(range(5))


def test_cli_verify_reports_entries_that_ls_cannot_show(store: Store) -> None:
    store.put_array("good", np.arange(10))
    store.put_strings("no-meta", ["x"])
    store.put_array("swapped", np.arange(3))
    store.put_strings("trimmed", ["x", "y"])
    (_version_dir(store, "no-meta") / "meta.json").unlink()
    link = store.layout.entry_link("swapped")
    os.unlink(link)
    os.symlink(os.readlink(store.layout.entry_link("good")), link)
    _edit_meta(store, "trimmed", lambda m: m.update(checksum=m["checksum"].split(",")[0]))
    assert encode_key("no-meta") in os.listdir(store.layout.entries)
    code, out, err = cli("verify", "--root", str(store.root))
    found = {m[2]: m[1] for m in re.finditer(r"^(ok|no checksum|CORRUPT)\s+([^\s:]+)", out, re.M)}
    assert found == {"good": "ok", "no-meta": "CORRUPT", "swapped": "CORRUPT", "trimmed": "CORRUPT"}, out
    assert code == 1 and "3 corrupt entries" in err
    assert "meta.json is missing" in out and "checksum list covers" in out


@pytest.mark.parametrize("shape", ["(True,)", "(" + "1, " * 70 + ")"], ids=["bool", "70 dimensions"])
def test_a_data_header_no_reader_can_open_is_named(store: Store, shape: str) -> None:
    store.put_array("k", np.zeros(1, dtype=np.uint8))
    data = _data_files(store, "k")[0]
    fields = f"{{'descr': '|u1', 'fortran_order': False, 'shape': {shape}, }}".encode()
    header = fields + b" " * (-(10 + len(fields) + 1) % 64) + b"\n"
    data.chmod(0o600)
    data.write_bytes(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + b"\0")
    for read in (
        lambda: Store(store.root).open_array("k"),
        lambda: Store(store.root).open("k"),
        lambda: store.verify("k"),
    ):
        with pytest.raises(CorruptEntryError) as caught:
            read()
        _names_key_and_fix(caught.value)


def test_the_daemon_answers_a_damaged_entry_with_409_naming_the_fix(store: Store) -> None:
    """A damaged entry is the entry's state, not a fault of the daemon: 409 (not 500), the
    error type a client re-raises, and the fix; evicting it and loading again works."""
    pytest.importorskip("fastapi")
    from service_helpers import app_client

    store.put_array("k", np.arange(3))
    DAMAGE["meta.json not JSON"](store, "k")
    with app_client(store.root) as client:
        response = client.get("/v1/entries/k")
        assert response.status_code == 409, response.text
        body = response.json()
        assert body["error"] == "CorruptEntryError", body
        assert "entry 'k' is damaged" in body["detail"] and "DELETE /v1/entries/k" in body["detail"], body
        assert client.delete("/v1/entries/k").status_code == 200
    store.put_array("k", np.arange(3))
    assert store.info("k").shape == (3,)


def _point_link(store: Store, key: str, at: str) -> None:
    """Re-point ``key``'s link at the version ``at``'s link points at (a stray ``ln -sf``)."""
    link = store.layout.entry_link(key)
    version = store.layout.entry_version(at)
    assert version is not None
    os.unlink(link)
    os.symlink(store.layout.link_target(version, key), link)


def _folder(path: Path, first: int) -> Path:
    path.mkdir()
    for i in range(2):
        np.save(path / f"f{i}.npy", np.full(4, first + i, dtype=np.int64))
    return path


@pytest.mark.parametrize("victim", ["an entry of its own", "an entry of a directory put"])
@pytest.mark.parametrize("reput", ["the key alone", "its directory"])
def test_a_reput_over_a_link_to_another_entry_leaves_that_entry(
    store: Store, tmp_path: Path, victim: str, reput: str
) -> None:
    """Replacing a key whose link was damaged to point at another key's version removes
    what it replaced only if that version records the key: the other entry keeps its data."""
    store.put_file("d", _folder(tmp_path / "d1", 10))
    if victim == "an entry of its own":
        other = "b"
        store.put_array(other, np.arange(5))
    else:
        other = "e/f1"
        store.put_file("e", _folder(tmp_path / "e", 20))
    expected = store.open_array(other).tolist()
    _point_link(store, "d/f0", other)
    if reput == "the key alone":
        store.put_array("d/f0", np.full(4, 30), overwrite=True)
        new = {"d/f0": 30, "d/f1": 11}
    else:
        store.put_file("d", _folder(tmp_path / "d2", 30), overwrite=True)
        new = {"d/f0": 30, "d/f1": 31}
    for reader in (store, Store(store.root)):
        assert reader.open_array(other).tolist() == expected
        assert reader.verify(other) is True
        for key, value in new.items():
            assert reader.open_array(key).tolist() == [value] * 4
    store.cleanup()
    keys = sorted([*new, other] + (["e/f0"] if other == "e/f1" else []))
    assert [e.key for e in store.list()] == keys
    assert all(store.verify(key) for key in keys)
    assert Store(store.root).open_array(other).tolist() == expected


def test_the_keys_a_manifest_records_are_read_as_its_readers_read_them(root: Path) -> None:
    """``read_manifest_keys`` (what a replace checks before removing a directory put's
    entries) agrees with ``read_manifest_entry`` for every way an entry records its key,
    and refuses a damaged manifest as it does."""
    lines = [
        b'{"key":"d/a","dtype":"int64"}\n',  # as array_line writes it
        json.dumps({"format": 1, "key": "d/b", "kind": "strings"}).encode() + b"\n",  # a container's
        b'{"dtype":"int64"}\n',  # an older entry: no key
    ]
    batch = root / "objects" / "batch"
    batch.mkdir(parents=True)
    manifest = batch / "manifest"
    manifest.write_bytes(b"".join(encode_manifest({"kind": "array"}, lines)))
    keys = read_manifest_keys(str(root), "batch", [0, 1, 2, 3])
    assert keys == {0: "d/a", 1: "d/b", 2: None}
    for index, key in keys.items():
        assert read_manifest_entry(str(root), f"batch/{index}").get("key") == key  # type: ignore[union-attr]
    assert read_manifest_keys(str(root), "gone", [0]) == {}
    os.truncate(manifest, manifest.stat().st_size - 5)
    with pytest.raises(ValueError, match="truncated or its offsets are wrong"):
        read_manifest_keys(str(root), "batch", [2])
    with pytest.raises(ValueError, match="truncated or its offsets are wrong"):
        read_manifest_entry(str(root), "batch/2")
