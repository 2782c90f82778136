"""Tar shards (WebDataset's layout) as one blobs entry: ``put_file`` of a ``.tar``, a list, a
glob or a brace pattern, the CLI and a daemon load; hostile archives refused with a typed
error and nothing published. Shards are real tar files written with ``tarfile``."""

from __future__ import annotations

import io
import os
import pickle
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

import shmcache
from shmcache import CorruptSourceError, InvalidSourceError, SourceNotAllowedError, SourceNotFoundError, Store
from shmcache._disk.layout import Layout
from shmcache._disk.meta import read_meta
from shmcache._sources import blobs
from shmcache._sources.tar_shards import MAX_BRACE_DEPTH, MAX_EXPANSIONS, expand_braces, shard_paths
from tests.cli_helpers import cli
from tests.service_helpers import load
from tests.source_times import age

LONG = "long/" + "n" * 120  # a GNU long name (over tar's 100 bytes)


def _sample(i: int) -> dict[str, bytes]:
    return {
        f"{i:06d}.jpg": os.urandom(3000 + 17 * i),
        f"{i:06d}.cls": str(i % 10).encode(),
        f"{i:06d}.seg.png": bytes([i % 256]) * (i + 1),
    }


def write_shard(
    path: Path, members: dict[str, bytes], fmt: int = tarfile.GNU_FORMAT, prefix: str = ""
) -> Path:
    """A tar shard with ``members`` (regular files, in order); ``prefix`` as ``tar -C dir .`` writes."""
    with tarfile.open(path, "w", format=fmt) as tar:
        if prefix:
            tar.addfile(_info(".", 0, tarfile.DIRTYPE))
        for name, data in members.items():
            tar.addfile(_info(prefix + name, len(data)), io.BytesIO(data))
    return path


def _info(name: str, size: int, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.type, info.linkname, info.mtime = size, kind, link, 1_700_000_000
    return info


def make_shards(top: Path, count: int = 3, per: int = 4) -> dict[str, bytes]:
    """``count`` shards ``top/shard-000.tar``... of ``per`` samples each; every member, in order."""
    top.mkdir(parents=True, exist_ok=True)
    everything: dict[str, bytes] = {}
    for s in range(count):
        members: dict[str, bytes] = {}
        for i in range(s * per, (s + 1) * per):
            members |= _sample(i)
        write_shard(top / f"shard-{s:03d}.tar", members)
        everything |= members
    return everything


def _contents(store: Store, key: str) -> dict[str, bytes]:
    blobs = shmcache.open_blobs(key, root=store.root)
    return {name: bytes(blobs[i]) for i, name in enumerate(blobs.names)}


@pytest.mark.parametrize(
    "source",
    ["{top}/shard-{{000..002}}.tar", "{top}/shard-*.tar", "{top}/shard-{{000,001,002}}.tar", "list"],
)
def test_shards_become_one_blobs_entry_with_member_names_in_order(
    store: Store, tmp_path: Path, source: str
) -> None:
    members = make_shards(tmp_path / "shards")
    given: object = (
        [tmp_path / "shards" / f"shard-{s:03d}.tar" for s in range(3)]
        if source == "list"
        else source.format(top=tmp_path / "shards")
    )
    assert store.put_file("imgs", given) == ["imgs"]  # type: ignore[arg-type]
    info = store.info("imgs")
    assert info.kind == "blobs" and info.shape == (len(members),)
    got = _contents(store, "imgs")
    assert list(got) == list(members) and got == members  # names kept, tar order, bytes exact
    if source != "list":
        assert info.source == str(given) and info.source_fingerprint is not None
        assert info.source_fingerprint["files"] == 3


def test_one_tar_with_long_names_pax_headers_directories_and_dot_slash(store: Store, tmp_path: Path) -> None:
    gnu = write_shard(tmp_path / "gnu.tar", {f"{LONG}.jpg": b"gnu long", "a/b.txt": b"x"}, prefix="./")
    pax = write_shard(tmp_path / "pax.tar", {"é/" + "p" * 150 + ".cls": b"pax"}, fmt=tarfile.PAX_FORMAT)
    ustar_name = "d" * 60 + "/" + "e" * 60 + "/000.jpg"  # over 100 bytes: ustar's prefix field
    ustar = write_shard(tmp_path / "ustar.tar", {ustar_name: b"u", "000.cls": b"c"}, fmt=tarfile.USTAR_FORMAT)
    store.put_file("u", ustar)
    assert _contents(store, "u") == {ustar_name: b"u", "000.cls": b"c"}
    store.put_file("g", gnu)
    store.put_file("p", [pax])
    assert _contents(store, "g") == {f"{LONG}.jpg": b"gnu long", "a/b.txt": b"x"}
    assert _contents(store, "p") == {"é/" + "p" * 150 + ".cls": b"pax"}


def test_samples_group_members_by_basename_and_pickle_by_reference(store: Store, tmp_path: Path) -> None:
    members = make_shards(tmp_path / "s", count=2, per=3)
    store.put_file("ds", str(tmp_path / "s" / "shard-{000..001}.tar"))
    samples = shmcache.open_blobs("ds").samples()
    assert len(samples) == 6 and samples.keys == [f"{i:06d}" for i in range(6)]
    five = samples[5]
    assert five["__key__"] == "000005" and set(five) == {"__key__", "jpg", "cls", "seg.png"}
    assert bytes(five["jpg"]) == members["000005.jpg"] and bytes(samples[-1]["seg.png"]) == b"\x05" * 6
    again = pickle.loads(pickle.dumps(samples))
    assert len(pickle.dumps(samples)) < 1000  # a reference, not the bytes
    assert bytes(again[2]["cls"]) == b"2"
    with pytest.raises(IndexError):
        samples[6]


def test_plan_file_reports_the_entry_without_writing(store: Store, tmp_path: Path) -> None:
    members = make_shards(tmp_path / "s", count=2)
    (planned,) = store.plan_file("k", str(tmp_path / "s" / "*.tar"))
    assert planned.key == "k" and planned.size >= sum(map(len, members.values()))
    assert not store.exists("k")


def test_as_blobs_keeps_the_tar_file_itself(store: Store, tmp_path: Path) -> None:
    shard = write_shard(tmp_path / "one.tar", {"a.txt": b"a"})
    store.put_file("raw", shard, as_="blobs")
    assert _contents(store, "raw") == {"one.tar": shard.read_bytes()}


def _raw_tar(*blocks: bytes) -> bytes:
    return b"".join(blocks)


def _header(name: str, size: int, kind: bytes = tarfile.REGTYPE, link: str = "") -> bytes:
    return _info(name, size, kind, link).tobuf(format=tarfile.GNU_FORMAT)


def _good_bytes(tmp: Path) -> bytes:
    return write_shard(tmp / "good-src.tar", {"000.jpg": os.urandom(5000), "000.cls": b"1"}).read_bytes()


END = bytes(1024)
HOSTILE: dict[str, tuple[Callable[[Path], bytes], type[Exception], str]] = {
    "cut in a member's data": (lambda t: _good_bytes(t)[:512 + 1000], CorruptSourceError, "truncated"),
    "end blocks missing": (
        lambda t: _good_bytes(t)[: 512 + 5120 + 1024], CorruptSourceError, "end-of-archive"
    ),
    "size past the end": (
        lambda t: _raw_tar(_header("big.jpg", 10**9), bytes(512), END), CorruptSourceError, "past the end"
    ),
    "parent traversal": (
        lambda t: _raw_tar(_header("../evil.jpg", 1), bytes(512), END), InvalidSourceError, "relative path"
    ),
    "absolute name": (
        lambda t: _raw_tar(_header("/etc/evil.jpg", 1), bytes(512), END), InvalidSourceError, "relative path"
    ),
    "symlink": (
        lambda t: _raw_tar(_header("x.jpg", 0, tarfile.SYMTYPE, "/etc/passwd"), END),
        InvalidSourceError,
        "symbolic link",
    ),
    "hard link": (
        lambda t: _raw_tar(_header("x.jpg", 0, tarfile.LNKTYPE, "y.jpg"), END),
        InvalidSourceError,
        "hard link",
    ),
    "device": (lambda t: _raw_tar(_header("x.jpg", 0, tarfile.CHRTYPE), END), InvalidSourceError, "device"),
    "fifo": (lambda t: _raw_tar(_header("x.jpg", 0, tarfile.FIFOTYPE), END), InvalidSourceError, "FIFO"),
    "bad checksum": (
        lambda t: (lambda b: b[:5642] + b"\x01" + b[5643:])(_good_bytes(t)),  # in the 2nd header's name
        CorruptSourceError,
        "end-of-archive",
    ),
    "not a tar": (lambda t: os.urandom(4096), CorruptSourceError, "not a tar"),
    "tiny": (lambda t: b"abc", CorruptSourceError, "shorter than one header"),
    "gzip inside": (lambda t: b"\x1f\x8b\x08" + bytes(2000), InvalidSourceError, "gunzip"),
    "huge pax record": (
        lambda t: _raw_tar(_header("././@PaxHeader", 2 << 20, tarfile.XHDTYPE), bytes(2 << 20), END),
        CorruptSourceError,
        "pax record",
    ),
    "negative pax size": (
        lambda t: _raw_tar(
            _header("././@PaxHeader", 512, tarfile.XHDTYPE),
            b"14 size=-1024\n".ljust(512, b"\0"),
            _header("x.jpg", 0),
            END,
        ),
        CorruptSourceError,
        "claims -1,024 bytes",
    ),
    "same name twice": (
        lambda t: _raw_tar(_header("a.jpg", 1), bytes(512), _header("a.jpg", 1), bytes(512), END),
        InvalidSourceError,
        "twice",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_shards_are_refused_and_nothing_is_published(store: Store, tmp_path: Path, case: str) -> None:
    build, error, words = HOSTILE[case]
    good = write_shard(tmp_path / "a-good.tar", {"ok.jpg": b"fine"})
    bad = tmp_path / "b-bad.tar"
    bad.write_bytes(build(tmp_path))
    for source in (bad, str(tmp_path / "*.tar"), [good, bad]):
        with pytest.raises(error, match=words):
            store.put_file("k", source)  # type: ignore[arg-type]
        with pytest.raises(error, match=words):
            store.plan_file("k", source)  # type: ignore[arg-type]
    assert not store.exists("k") and store.list() == []
    scratch = store.root / "tmp"
    assert not scratch.exists() or list(scratch.iterdir()) == []  # checked before anything was written


def test_compressed_shards_are_refused_by_name_before_reading(store: Store, tmp_path: Path) -> None:
    (tmp_path / "s.tar.gz").write_bytes(b"anything")
    with pytest.raises(InvalidSourceError, match=r"gzip-compressed.*gunzip -k FILE"):
        store.put_file("k", tmp_path / "s.tar.gz")


def test_names_across_shards_must_be_unique(store: Store, tmp_path: Path) -> None:
    write_shard(tmp_path / "1.tar", {"a.jpg": b"1"})
    write_shard(tmp_path / "2.tar", {"a.jpg": b"2"})
    with pytest.raises(InvalidSourceError, match=r"'a.jpg' is in .*1.tar too"):
        store.put_file("k", str(tmp_path / "{1,2}.tar"))
    assert not store.exists("k")


def test_a_missing_shard_of_a_pattern_is_an_error_not_skipped(store: Store, tmp_path: Path) -> None:
    make_shards(tmp_path, count=2)
    with pytest.raises(SourceNotFoundError, match=r"shard-002\.tar does not exist"):
        store.put_file("k", str(tmp_path / "shard-{000..002}.tar"))
    with pytest.raises(SourceNotFoundError, match="no tar shard matches"):
        store.put_file("k", str(tmp_path / "nothing-*.tar"))
    with pytest.raises(InvalidSourceError, match=r"list of \.tar shards only"):
        store.put_file("k", [tmp_path / "shard-000.tar", tmp_path / "x.npy"])


def test_brace_expansion_is_bounded_and_shell_like() -> None:
    assert expand_braces("s/{000..003}.tar") == [f"s/{i:03d}.tar" for i in range(4)]
    assert expand_braces("{a,b}-{1..2}") == ["a-1", "a-2", "b-1", "b-2"]
    assert expand_braces("{x,{y,z}}{0..4..2}") == ["x0", "x2", "x4", "y0", "y2", "y4", "z0", "z2", "z4"]
    assert expand_braces("{3..1}{}{lone") == ["3{}{lone", "2{}{lone", "1{}{lone"]
    assert len(expand_braces("{0..99999}")) == MAX_EXPANSIONS
    for pattern in ("{0..100000}", "{0..999}{0..999}", "{a,b}{0..99999}"):
        with pytest.raises(InvalidSourceError, match="more than 100,000"):
            expand_braces(pattern)
    with pytest.raises(InvalidSourceError, match="more than 100,000"):
        shard_paths("/nonexistent/{0..9999999999}.tar")  # refused before any file is looked at


def _nested(depth: int) -> str:
    return "{a," * depth + "b" + "}" * depth


def test_brace_nesting_is_bounded_and_braces_are_paired_once(store: Store, tmp_path: Path) -> None:
    """1,500 nested groups raised a raw RecursionError (mutual recursion per level); each
    unclosed '{' was scanned to the pattern's end (20,000 of them: ~9 s)."""
    assert expand_braces(_nested(MAX_BRACE_DEPTH)) == ["a"] * MAX_BRACE_DEPTH + ["b"]
    assert expand_braces("{x{a,b}}-{{lit}}") == ["{xa}-{{lit}}", "{xb}-{{lit}}"]  # literal groups stay
    assert expand_braces("{" * 20 + "{a,b}") == ["{" * 20 + "a", "{" * 20 + "b"]  # unclosed: not nesting
    for pattern in (_nested(MAX_BRACE_DEPTH + 1), _nested(1500)):
        with pytest.raises(InvalidSourceError, match=f"nests braces more than {MAX_BRACE_DEPTH} deep"):
            expand_braces(pattern)
    unclosed = "{" * 20_000 + "a,b}"
    assert expand_braces(unclosed) == ["{" * 19_999 + "a", "{" * 19_999 + "b"]
    with pytest.raises(InvalidSourceError, match="nests braces more than 8 deep"):
        store.put_file("k", str(tmp_path / f"{_nested(1500)}.tar"))
    with pytest.raises(SourceNotFoundError, match="its name is too long for a file"):
        store.put_file("k", str(tmp_path / ("x" * 5000 + ".npy")))  # was a raw OSError (ENAMETOOLONG)
    assert store.list() == []


def test_cli_refuses_a_deep_brace_pattern_clearly(root: Path, tmp_path: Path) -> None:
    """The CLI said '[Errno 36] File name too long' (looking the pattern up as a file)."""
    code, out, err = cli("put", str(tmp_path / f"{_nested(1500)}.tar"), "--key", "web", "--local")
    assert code == 1 and out == "" and "nests braces more than 8 deep" in err and "Errno" not in err, err


def test_allowed_dirs_confine_every_shard(store: Store, tmp_path: Path) -> None:
    inside, outside = tmp_path / "in", tmp_path / "out"
    make_shards(outside, count=1)
    inside.mkdir()
    (inside / "shard-000.tar").symlink_to(outside / "shard-000.tar")
    with pytest.raises(SourceNotAllowedError):
        store.put_file("k", str(inside / "*.tar"), allowed_dirs=[inside])
    assert not store.exists("k")


def test_cli_puts_a_quoted_glob_of_shards_as_one_entry(root: Path, tmp_path: Path) -> None:
    members = make_shards(tmp_path / "s")
    code, out, err = cli("put", str(tmp_path / "s" / "shard-*.tar"), "--key", "web", "--local")
    assert code == 0, err
    assert out.split() == ["web"]
    assert len(shmcache.open_blobs("web")) == len(members)


def test_preload_sees_shards_unchanged_until_one_changes(store: Store, tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    from shmcache.service.sources import is_up_to_date

    make_shards(tmp_path / "s", count=2)
    pattern = tmp_path / "s" / "shard-{000..001}.tar"  # a path, as a preload's source is
    age(tmp_path / "s")  # else racily clean (source_files.RACY_NS): never current
    store.put_file("ds", pattern)
    assert is_up_to_date(store, "ds", pattern)
    write_shard(tmp_path / "s" / "shard-001.tar", {"other.jpg": b"changed"})
    assert not is_up_to_date(store, "ds", pattern)


def test_daemon_loads_a_brace_pattern_of_shards(daemon: object, data_dir: Path) -> None:
    members = make_shards(data_dir / "web", count=3, per=2)
    with daemon.client() as client:  # type: ignore[attr-defined]
        job = load(client, "web", data_dir / "web" / "shard-{000..002}.tar")
        assert job["state"] == "done", job
        assert job["keys"] == ["web"]
        blobs = shmcache.open_blobs("web", root=daemon.root)  # type: ignore[attr-defined]
        assert {n: bytes(blobs[n]) for n in blobs.names} == members
        assert len(blobs.samples()) == 6
        refused = client.put("/v1/entries/elsewhere", json={"source": "/tmp/{0..1}.tar"})
        assert refused.json()["error"] == "SourceNotAllowedError", refused.text
        missing = client.put("/v1/entries/m", json={"source": str(data_dir / "web" / "nope-{0..1}.tar")})
        assert missing.json()["error"] == "SourceNotFoundError", missing.text


def test_a_shard_rewritten_while_loading_fails_the_put(store: Store, tmp_path: Path) -> None:
    make_shards(tmp_path / "s", count=3)
    victim = tmp_path / "s" / "shard-002.tar"

    def rewrite_once(done: int, total: int, state: list[int] = [0]) -> None:  # noqa: B006
        if state[0] == 0:  # after the check, before the copy reaches the last shard
            state[0] = 1
            write_shard(victim, _sample(99) | _sample(98))

    with pytest.raises(CorruptSourceError, match=r"shard-002\.tar changed"):
        store.put_file("k", str(tmp_path / "s" / "shard-*.tar"), progress=rewrite_once)
    assert not store.exists("k")


def _written(store: Store, key: str) -> tuple[bytes, dict[str, object]]:
    """The entry's ``bytes.npy`` and its recorded metadata, less what differs between puts."""
    layout = Layout(store.root)
    version = store.info(key).version
    record = read_meta(layout, version)
    assert record is not None
    meta = record.to_json()
    for name in ("version", "created", "key"):
        meta.pop(name, None)
    return (layout.objects / version / "bytes.npy").read_bytes(), meta


def test_shards_copied_in_order_match_the_threaded_kernel_copy(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel cannot copy (another file system) the shards go through one buffer in
    order, checksummed there: the same entry, and the same CRC-32 ``verify`` computes, as the
    threaded kernel copy (members over the 1 MiB buffer and empty ones included)."""
    members = make_shards(tmp_path / "s", count=3) | {"big.bin": os.urandom((3 << 20) + 5), "empty.txt": b""}
    write_shard(tmp_path / "s" / "shard-003.tar", {"big.bin": members["big.bin"], "empty.txt": b""})
    pattern = str(tmp_path / "s" / "shard-*.tar")
    entries = {}
    for kernel in (True, False):
        monkeypatch.setattr(blobs, "_kernel_copies", lambda files, dst, kernel=kernel: kernel)
        seen: list[int] = []
        store.put_file(f"k{kernel}", pattern, progress=lambda done, total, seen=seen: seen.append(done))
        assert _contents(store, f"k{kernel}") == members
        assert store.verify(f"k{kernel}") is True
        assert seen[-1] == sum(len(v) for v in members.values())
        entries[kernel] = _written(store, f"k{kernel}")
    assert entries[True] == entries[False]


def test_the_kernel_copy_is_asked_once_per_pair_of_file_systems(store: Store, tmp_path: Path) -> None:
    make_shards(tmp_path / "s", count=2)
    store.put_file("k", str(tmp_path / "s" / "shard-*.tar"))
    src_dev = (tmp_path / "s").stat().st_dev
    assert (src_dev, store.root.stat().st_dev) in blobs._kernel_copy
    same = store.root / "shard.tar"  # the cache's own file system: the kernel copies there
    members = _sample(7)
    write_shard(same, members)
    store.put_file("same", str(same))
    assert blobs._kernel_copy[(same.stat().st_dev, store.root.stat().st_dev)] is True
    assert _contents(store, "same") == members


def test_a_shard_truncated_during_the_in_order_copy_fails_the_put(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blobs, "_kernel_copies", lambda files, dst: False)
    shard = write_shard(tmp_path / "big.tar", {f"{i}.bin": os.urandom(1 << 20) for i in range(4)})

    def truncate_once(done: int, total: int, state: list[int] = [0]) -> None:  # noqa: B006
        if done and not state[0]:  # the first buffer is written: cut the shard in half
            state[0] = 1
            os.truncate(shard, shard.stat().st_size // 2)

    with pytest.raises(CorruptSourceError, match=r"big\.tar changed while loading"):
        store.put_file("k", str(shard), progress=truncate_once)
    assert not store.exists("k")
