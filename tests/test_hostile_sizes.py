"""A hostile file costs at most what its size allows: checkpoints, safetensors headers and HDF5
files that declare far more than they hold are refused (or read in slabs) with memory
bounded by the file's real size, and a typed error naming the file; nothing published.

Memory is measured as the peak RSS a fresh process gains while it loads the file
(``table_memory.peak_growth``), against the bytes the file really has."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

import pytest
from service_helpers import Daemon, unique

from shmcache import Store
from shmcache.errors import CorruptSourceError, UnsupportedDataError

sys.path.insert(0, str(Path(__file__).parent))
from table_memory import peak_growth

MiB = 1 << 20


def _nothing_published(store: Store) -> None:
    assert [e.key for e in store.list()] == []


def _growth(path: Path, key: str = "k") -> int:
    """Peak RSS a fresh process gains in a put_file of ``path`` (an error of ours is fine),
    its readers imported beforehand."""
    warm_up = """
        import shutil, tempfile
        import shmcache._sources.safetensors, shmcache._sources.torch_zip
        try:
            import h5py
        except ImportError:
            pass
        from shmcache import Store
        from shmcache.errors import ShmCacheError
        root = tempfile.mkdtemp(dir="/dev/shm", prefix="hostile-")
        store = Store(root)
    """
    load = f"""
try:
    store.put_file({key!r}, {str(path)!r})
except ShmCacheError:
    pass
finally:
    shutil.rmtree(root)
"""
    before, after = peak_growth(warm_up, load)
    return after - before


# ---------------------------------------------------------------------- torch pickles


def _checkpoint(path: Path, pickle: bytes, compress: int = zipfile.ZIP_STORED) -> Path:
    """A .pt zip laid out as torch.save lays it out, with ``pickle`` as its data.pkl."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickle, compress_type=compress)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    return path


def _empty_lists(size: int) -> bytes:
    """PROTO, a list, MARK, ``size`` EMPTY_LISTs, APPENDS, STOP: ~80 bytes of objects a byte."""
    return b"\x80\x02](" + b"]" * (size - 8) + b"e."


def test_torch_compressed_pickle_is_refused(store: Store, tmp_path: Path) -> None:
    """16 MiB of EMPTY_LIST deflates to 17 KB: it grew the put by 1.4 GiB before a refusal."""
    source = _checkpoint(tmp_path / "bomb.pt", _empty_lists(16 * MiB), zipfile.ZIP_DEFLATED)
    assert source.stat().st_size < 64 * 1024
    with pytest.raises(CorruptSourceError, match=r"bomb\.pt: its archive/data\.pkl is compressed"):
        store.put_file("k", source)
    _nothing_published(store)


def test_torch_pickle_of_empty_lists_costs_what_its_size_allows(tmp_path: Path) -> None:
    """Stored raw, 8 MiB of EMPTY_LIST (an 8 MiB file) built ~650 MiB of lists before the
    refusal; now its opcodes are counted first and nothing is built."""
    source = _checkpoint(tmp_path / "lists.pt", _empty_lists(8 * MiB))
    growth = _growth(source)
    assert growth < 4 * source.stat().st_size, f"grew by {growth >> 20} MiB"


def test_torch_pickle_of_empty_lists_is_refused_by_name(store: Store, tmp_path: Path) -> None:
    source = _checkpoint(tmp_path / "lists.pt", _empty_lists(MiB))
    with pytest.raises(CorruptSourceError, match=r"lists\.pt: archive/data\.pkl: unpickling it would build"):
        store.put_file("k", source)
    _nothing_published(store)


def test_torch_pickle_with_a_far_memo_index_is_refused(store: Store, tmp_path: Path) -> None:
    """LONG_BINPUT 2**24 in a 10-byte pickle: the C unpickler allocated (and zeroed) a memo
    table of 2**25 pointers, 256 MiB (2**28: 4 GiB)."""
    source = _checkpoint(tmp_path / "memo.pt", b"\x80\x02]r" + (1 << 24).to_bytes(4, "little") + b".")
    with pytest.raises(CorruptSourceError, match="stores memo entry 16777216 when it has 0"):
        store.put_file("k", source)
    _nothing_published(store)
    assert _growth(source) < 64 * MiB


def test_torch_truncated_pickle_is_corrupt(store: Store, tmp_path: Path) -> None:
    """It was reported as UnsupportedDataError ('refused to unpickle it')."""
    torch = pytest.importorskip("torch")
    torch.save({"w": torch.zeros(3)}, tmp_path / "whole.pt")
    with zipfile.ZipFile(tmp_path / "whole.pt") as archive:
        members = {i.filename: archive.read(i) for i in archive.infolist()}
    with zipfile.ZipFile(tmp_path / "cut.pt", "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data[:-5] if name.endswith("data.pkl") else data)
    with pytest.raises(CorruptSourceError, match=r"cut\.pt: whole/data\.pkl: the pickle is truncated"):
        store.put_file("k", tmp_path / "cut.pt")
    _nothing_published(store)


def test_torch_state_dicts_of_every_shape_still_load(store: Store, tmp_path: Path) -> None:
    """Parameters, nested dicts, views of one storage, a module's state dict (with _metadata)."""
    torch = pytest.importorskip("torch")
    big = torch.arange(600, dtype=torch.float32)
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(50)])
    cases = {
        "params": {f"p{i}": torch.nn.Parameter(torch.full((3,), float(i))) for i in range(200)},
        "nested": {f"d{i}": {f"q{j}": torch.full((2,), float(j)) for j in range(10)} for i in range(50)},
        "views": {f"v{i}": big[i * 6 : (i + 1) * 6].view(2, 3) for i in range(100)},
        "module": model.state_dict(),
    }
    for name, state in cases.items():
        torch.save(state, tmp_path / f"{name}.pt")
        store.put_file(name, tmp_path / f"{name}.pt")
    assert store.open_array("params/p7").tolist() == [7.0] * 3
    assert store.open_array("nested/d3/q4").tolist() == [4.0] * 2
    assert store.open_array("views/v99").tolist() == big[594:].view(2, 3).tolist()
    assert store.open_array("module/49.bias").tolist() == model[49].bias.tolist()


# ---------------------------------------------------------------------- safetensors headers


def _safetensors(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)
    return path


def _list_of_objects(size: int) -> bytes:
    """``{"x": [{}, {}, ...]}`` of ``size`` bytes: ~24 bytes of Python objects a byte, parsed whole."""
    return (b'{"x": [' + b"{}," * ((size - 20) // 3)).rstrip(b",") + b"]}"


def test_safetensors_header_of_objects_costs_what_its_size_allows(tmp_path: Path) -> None:
    """A 20 MiB header grew the put by +485 MiB (json.loads of all of it, then a refusal)."""
    source = _safetensors(tmp_path / "big.safetensors", _list_of_objects(20 * MiB))
    growth = _growth(source)
    assert growth < 3 * 20 * MiB, f"grew by {growth >> 20} MiB"


def test_safetensors_long_description_is_refused_by_name(store: Store, tmp_path: Path) -> None:
    source = _safetensors(tmp_path / "long.safetensors", _list_of_objects(MiB))
    with pytest.raises(CorruptSourceError, match=r"long\.safetensors: tensor 'x': its description is over"):
        store.put_file("k", source)
    _nothing_published(store)


def test_safetensors_metadata_must_be_strings(store: Store, tmp_path: Path) -> None:
    """As in the reference parser: __metadata__ maps strings to strings (or is null)."""
    tensor = b'"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
    for metadata in (b'{"a": "b", "c": ""}', b"{}", b"null"):
        source = _safetensors(
            tmp_path / "ok.safetensors", b'{"__metadata__": ' + metadata + b", " + tensor + b"}", b"\x05"
        )
        store.put_file("k", source, overwrite=True)
        assert store.open_array("k/t").tolist() == [5]
    source = _safetensors(
        tmp_path / "bad.safetensors", b'{"__metadata__": {"a": [1]}, ' + tensor + b"}", b"\x05"
    )
    with pytest.raises(
        CorruptSourceError, match=r"bad\.safetensors: the \.safetensors header is not valid JSON"
    ):
        store.put_file("j", source)


def _f32(begin: int, end: int) -> dict[str, object]:
    return {"dtype": "F32", "shape": [(end - begin) // 4], "data_offsets": [begin, end]}


RANGES = {
    "overlap": ({"a": _f32(0, 32), "b": _f32(8, 24)}, 32, r"tensors 'a' and 'b' overlap \(bytes 8 to 32"),
    "gap at the start": ({"a": _f32(16, 32)}, 32, r"16 bytes at the start of the data belong to no tensor"),
    "gap between": (
        {"a": _f32(0, 8), "b": _f32(16, 32)},
        32,
        r"8 bytes after tensor 'a' belong to no tensor",
    ),
    "trailing bytes": ({"a": _f32(0, 16)}, 20, r"4 bytes after the last tensor \('a'\) belong to no tensor"),
}


@pytest.mark.parametrize("case", list(RANGES))
def test_safetensors_ranges_must_be_the_data_back_to_back(store: Store, tmp_path: Path, case: str) -> None:
    """Each range alone was checked (inside the file, exactly shape x itemsize), never against
    the others: overlapping (aliased) tensors, gaps and trailing bytes were published."""
    import json

    header, data_size, message = RANGES[case]
    source = _safetensors(tmp_path / "r.safetensors", json.dumps(header).encode(), bytes(data_size))
    with pytest.raises(CorruptSourceError, match=rf"r\.safetensors: {message}"):
        store.put_file("k", source)
    _nothing_published(store)
    reference = pytest.importorskip("safetensors.numpy")
    with pytest.raises(Exception, match=r"invalid offset|incomplete"):  # the reference refuses each
        reference.load_file(str(source))


def test_safetensors_empty_tensors_share_an_offset(store: Store, tmp_path: Path) -> None:
    import json

    header = {
        "e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [4, 4]},
        "a": _f32(0, 4),
        "b": _f32(4, 8),
    }
    source = _safetensors(tmp_path / "e.safetensors", json.dumps(header).encode(), bytes(8))
    assert sorted(store.put_file("k", source)) == ["k/a", "k/b", "k/e"]
    assert store.open_array("k/e").shape == (0, 3)


@pytest.mark.parametrize(
    "header", [b"{}", b'{"__metadata__": {"format": "pt"}}', b'{"__metadata__": null}  ']
)
def test_safetensors_without_a_tensor_is_refused(store: Store, tmp_path: Path, header: bytes) -> None:
    """It returned [] and published nothing, silently (every other container says so)."""
    source = _safetensors(tmp_path / "empty.safetensors", header)
    with pytest.raises(
        CorruptSourceError, match=r"empty\.safetensors: the \.safetensors file holds no tensor"
    ):
        store.put_file("k", source)
    _nothing_published(store)


# ---------------------------------------------------------------------- HDF5


def test_hdf5_one_huge_row_is_read_in_slabs(tmp_path: Path) -> None:
    """(1, 2**24) float64: 128 MiB of fill values in a 1 KB file, read whole (a slab was at
    least one row); now in 16 MiB slabs."""
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "row.h5"
    with h5py.File(path, "w") as h5:
        h5.create_dataset("x", (1, 1 << 24), "f8", chunks=(1, 1 << 16))
    growth = _growth(path)
    assert growth < 64 * MiB, f"grew by {growth >> 20} MiB for 128 MiB of data"


@pytest.mark.parametrize("shape", [(3, 4, 50), (1, 999), (2, 0, 5), (7,), ()])
def test_hdf5_slabs_within_rows_keep_every_value(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...]
) -> None:
    import numpy as np

    from shmcache._sources import hdf5

    h5py = pytest.importorskip("h5py")
    monkeypatch.setattr(hdf5, "_SLAB_BYTES", 48)  # rows of 100 and 1998 bytes: parts of rows
    values = np.arange(int(np.prod(shape)), dtype="<u2").reshape(shape)
    with h5py.File(tmp_path / "d.h5", "w") as h5:
        h5.create_dataset("v", data=values, **({"chunks": (1,) * len(shape)} if values.size else {}))
    store.put_file("k", tmp_path / "d.h5")
    assert np.array_equal(store.open_array("k/v"), values)


def test_hdf5_declared_strings_cost_what_the_entry_holds(tmp_path: Path) -> None:
    """2M declared, unwritten strings (a 1.4 KB file): decoded whole into a list they cost
    ~100 bytes each (+190 MiB); in slabs, the entry's own arrays (~28 bytes each)."""
    h5py = pytest.importorskip("h5py")
    count = 2_000_000
    path = tmp_path / "strings.h5"
    with h5py.File(path, "w") as h5:
        h5.create_dataset("captions", (count,), h5py.string_dtype(), chunks=(1 << 16,))
    growth = _growth(path)
    assert growth < 45 * count, f"grew by {growth >> 20} MiB, {growth // count} bytes a string"


def test_hdf5_strings_decoded_in_slabs_keep_every_value(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shmcache._sources import hdf5

    h5py = pytest.importorskip("h5py")
    monkeypatch.setattr(hdf5, "_STRINGS_PER_SLAB", 3)
    values = ["", "a", "héllo", "日本", "x" * 1000, "a", "", "last"]
    with h5py.File(tmp_path / "s.h5", "w") as h5:
        h5.create_dataset("s", data=values, dtype=h5py.string_dtype())
    store.put_file("k", tmp_path / "s.h5")
    strings = store.open_strings("k/s")
    assert list(strings) == values
    assert strings.index("héllo") == 2 and "日本" in strings


# ---------------------------------------------------------------------- HDF5 links


def test_hdf5_dataset_is_published_under_each_of_its_names(store: Store, tmp_path: Path) -> None:
    """visititems visits an object once: /labels was published only as /alias (which sorts
    first), and a soft link's dataset not at all."""
    import numpy as np

    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "l.h5", "w") as h5:
        h5.create_dataset("labels", data=np.arange(3))
        h5["alias"] = h5["labels"]  # a second hard link
        h5.create_group("g")["soft"] = h5py.SoftLink("/labels")
        h5["g/rel"] = h5py.SoftLink("soft")  # relative to g, through another soft link
    assert store.put_file("d", tmp_path / "l.h5") == ["d/alias", "d/g/rel", "d/g/soft", "d/labels"]
    for name in ("alias", "g/rel", "g/soft", "labels"):
        assert store.open_array(f"d/{name}").tolist() == [0, 1, 2]


@pytest.mark.parametrize("through", ["direct", "soft link", "group"])
def test_hdf5_external_link_is_refused_and_never_followed(store: Store, tmp_path: Path, through: str) -> None:
    """An external link names any file of the machine (for the team daemon, outside its
    --allow-source): it was skipped silently; now refused by name before it is opened."""
    import numpy as np

    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "other.h5", "w") as h5:
        h5.create_dataset("x", data=np.arange(3))
    with h5py.File(tmp_path / "main.h5", "w") as h5:
        h5.create_dataset("labels", data=np.arange(3))
        if through == "group":
            h5["ext"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/")
            h5["z"] = h5py.SoftLink("/ext/x")
        else:
            h5["ext"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/x")
            if through == "soft link":
                del h5["ext"]
                h5.create_group("hidden")["ext"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/")
                h5["a"] = h5py.SoftLink("/hidden/ext/x")  # sorts first: met before /hidden
    with pytest.raises(UnsupportedDataError, match=r"main\.h5\[\w+\] is an external link to .*other\.h5"):
        store.put_file("d", tmp_path / "main.h5")
    _nothing_published(store)


def test_hdf5_second_name_of_a_group_is_refused(store: Store, tmp_path: Path) -> None:
    """Each group walked once: a group linked twice per level would list 2**levels names."""
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "loop.h5", "w") as h5:
        h5.create_group("g").create_dataset("x", data=[1])
        h5["g/again"] = h5["g"]  # a loop
    with pytest.raises(
        UnsupportedDataError, match=r"loop\.h5\[g/again\] is another name \(HardLink\) of the group 'g'"
    ):
        store.put_file("d", tmp_path / "loop.h5")
    _nothing_published(store)


def test_hdf5_dangling_or_looping_soft_links_are_refused(store: Store, tmp_path: Path) -> None:
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "dangling.h5", "w") as h5:
        h5.create_dataset("x", data=[1])
        h5["gone"] = h5py.SoftLink("/nowhere")
    with pytest.raises(
        CorruptSourceError, match=r"dangling\.h5\[gone\] is a soft link to /nowhere, which is not"
    ):
        store.put_file("d", tmp_path / "dangling.h5")
    with h5py.File(tmp_path / "chain.h5", "w") as h5:
        h5.create_group("G")
        for i in range(1, 20):  # each names the next twice: 2**19 steps unless counted in all
            h5[f"G/s{i}"] = h5py.SoftLink(f"/G/s{i + 1}/s{i + 1}")
        h5["G/s20"] = h5py.SoftLink("/G")
    with pytest.raises(CorruptSourceError, match="over 16 soft links to follow"):
        store.put_file("d", tmp_path / "chain.h5")
    _nothing_published(store)


def test_daemon_refuses_an_external_link_out_of_its_allowed_sources(
    daemon: Daemon, data_dir: Path, tmp_path: Path
) -> None:
    """The daemon reads with its own rights: a link to a file outside --allow-source is
    refused by name, and nothing of that file is read or published."""
    import numpy as np

    h5py = pytest.importorskip("h5py")
    secret = tmp_path / "secret.h5"  # outside data_dir, the daemon's only allowed source
    with h5py.File(secret, "w") as h5:
        h5.create_dataset("x", data=np.arange(3))
    source = data_dir / f"{unique('main')}.h5"
    with h5py.File(source, "w") as h5:
        h5.create_dataset("labels", data=np.arange(3))
        h5["leak"] = h5py.ExternalLink(str(secret), "/x")
    key = unique("k")
    with daemon.client(timeout=60) as client:
        response = client.put(f"/v1/entries/{key}", json={"source": str(source)})
        assert response.status_code in (400, 415, 422), response.text
        assert response.json()["error"] == "UnsupportedDataError", response.text
        assert "[leak] is an external link to" in response.json()["detail"]
        listing = client.get("/v1/entries")
        assert listing.status_code == 200 and key not in listing.text


# ---------------------------------------------------------------------- name collisions


def test_torch_names_that_collide_are_told_apart(store: Store, tmp_path: Path) -> None:
    """The message named the same thing twice: 'coll.pt[a/b] and coll.pt[a/b]'."""
    torch = pytest.importorskip("torch")
    torch.save({"a/b": torch.zeros(1), "a": {"b": torch.ones(1)}}, tmp_path / "coll.pt")
    with pytest.raises(
        UnsupportedDataError, match=r"coll\.pt: tensors \['a/b'\] and \['a'\]\['b'\] would both"
    ):
        store.put_file("k", tmp_path / "coll.pt")
    _nothing_published(store)

