"""The exception hierarchy: one base, matching built-ins, rebuildable from the message."""

from __future__ import annotations

import builtins
import inspect
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import shmcache
from shmcache import Store, errors
from shmcache._disk.layout import ARRAY_FILE, Layout

BUILTIN_OF: dict[type[Exception], type[Exception]] = {
    errors.KeyNotFoundError: KeyError,
    errors.KeyExistsError: FileExistsError,
    errors.InvalidKeyError: ValueError,
    errors.UnsupportedDataError: TypeError,
    errors.CacheFullError: OSError,
    errors.LockTimeoutError: TimeoutError,
    errors.DaemonUnavailableError: ConnectionError,
    errors.SourceNotFoundError: FileNotFoundError,
    errors.CorruptSourceError: ValueError,
    errors.SourceKindError: ValueError,
    errors.CorruptEntryError: ValueError,
    errors.CacheRootError: PermissionError,
    errors.TooManyOpenFilesError: OSError,
    errors.MappingRefusedError: MemoryError,
    errors.DaemonRunningError: RuntimeError,
    errors.GPUUnavailableError: RuntimeError,
    errors.UnauthorizedError: PermissionError,
    errors.UntrustedDaemonError: PermissionError,
    errors.InvalidRequestError: ValueError,
    errors.JobNotFoundError: LookupError,
    errors.SourceNotAllowedError: PermissionError,
    errors.TeamConfigError: ValueError,
    errors.UnknownTeamError: LookupError,
    errors.NotPermittedError: PermissionError,
}

ERROR_CLASSES: list[type[Exception]] = [
    obj
    for obj in vars(errors).values()
    if inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__ == errors.__name__
]
MESSAGE = "entry 'a/b' is gone: put it again (see `shmcache put --help`)"


def test_all_lists_every_error_and_each_is_exported() -> None:
    assert sorted(errors.__all__) == sorted(cls.__name__ for cls in ERROR_CLASSES)
    for cls in ERROR_CLASSES:
        assert getattr(shmcache, cls.__name__) is cls
        assert cls.__name__ in shmcache.__all__


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_derives_from_the_base(cls: type[Exception]) -> None:
    assert issubclass(cls, errors.ShmCacheError)
    assert issubclass(cls, Exception)


@pytest.mark.parametrize("cls", list(BUILTIN_OF), ids=lambda c: c.__name__)
def test_error_subclasses_its_builtin(cls: type[Exception]) -> None:
    assert issubclass(cls, BUILTIN_OF[cls])
    with pytest.raises(BUILTIN_OF[cls]):
        raise cls(MESSAGE)


def test_source_errors_share_a_base() -> None:
    assert issubclass(errors.SourceNotFoundError, errors.InvalidSourceError)
    assert issubclass(errors.CorruptSourceError, errors.InvalidSourceError)
    assert issubclass(errors.SourceNotAllowedError, errors.InvalidSourceError)


def test_an_exhausted_descriptor_limit_is_still_an_os_error() -> None:
    """Code that caught ``OSError`` (EMFILE) around opens keeps working."""
    with pytest.raises(OSError):
        raise errors.TooManyOpenFilesError(MESSAGE)


_TREE_LINE = re.compile(r"^(?P<indent>[\s│├└─]*?)(?:├── |└── )(?P<name>\w+)(?:\s+\[(?P<builtin>\w+)\])?")


def _drawn_tree() -> dict[str, tuple[str, str | None]]:
    """The tree in errors' docstring: class name -> (parent drawn above it, bracketed built-in)."""
    doc = errors.__doc__ or ""
    drawn: dict[str, tuple[str, str | None]] = {}
    parents = ["ShmCacheError"]  # the root line has no branch
    for line in doc.splitlines():
        match = _TREE_LINE.match(line.strip("\n").removeprefix("    "))
        if not match:
            continue
        depth = len(match.group("indent")) // 4
        del parents[depth + 1 :]
        drawn[match.group("name")] = (parents[depth], match.group("builtin"))
        parents.append(match.group("name"))
    return drawn


def test_the_tree_in_the_docstring_is_the_real_hierarchy() -> None:
    drawn = _drawn_tree()
    assert sorted([*drawn, "ShmCacheError"]) == sorted(cls.__name__ for cls in ERROR_CLASSES)
    for name, (parent, builtin) in drawn.items():
        cls = getattr(errors, name)
        assert cls.__bases__[0] is getattr(errors, parent), name
        if builtin is not None:
            assert issubclass(cls, getattr(builtins, builtin)), name
        assert BUILTIN_OF.get(cls) == (getattr(builtins, builtin) if builtin else None), name


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_error_is_rebuilt_from_its_message(cls: type[Exception]) -> None:
    error = cls(MESSAGE)
    assert str(error) == MESSAGE  # verbatim: no quotes from KeyError, no [Errno] from OSError
    rebuilt = type(error)(str(error))
    assert type(rebuilt) is cls
    assert str(rebuilt) == MESSAGE


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_the_client_maps_every_error_back(cls: type[Exception]) -> None:
    """What the daemon sends as ``{"error": <class name>, "detail": ...}`` comes back as the class."""
    client = pytest.importorskip("shmcache.client")
    error = client.error_from_body(cls.__name__, MESSAGE)
    assert type(error) is cls and str(error) == MESSAGE


def test_daemon_running_error_comes_back_from_the_daemon() -> None:
    client = pytest.importorskip("shmcache.client")
    error = client.error_from_body("DaemonRunningError", "x")
    assert isinstance(error, shmcache.DaemonRunningError) and str(error) == "x"
    unknown = client.error_from_body("SomethingNewError", "x", 500)
    assert type(unknown) is errors.ShmCacheError and "SomethingNewError" in str(unknown)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_error_survives_pickle(cls: type[Exception]) -> None:
    error = cls(MESSAGE)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        copy = pickle.loads(pickle.dumps(error, protocol=protocol))
        assert type(copy) is cls
        assert str(copy) == MESSAGE
        assert copy.args == error.args


def test_key_not_found_message_has_no_quotes() -> None:
    assert str(errors.KeyNotFoundError("m")) == "m"
    assert str(KeyError("m")) == "'m'"  # what the base class would have done
    assert str(errors.ShmCacheError()) == ""


def _raised(operation: Callable[[], object]) -> errors.ShmCacheError:
    with pytest.raises(errors.ShmCacheError) as info:
        operation()
    return info.value


def test_errors_raised_by_the_store_rebuild_and_pickle(store: Store, tmp_path: Path) -> None:
    store.put_array("k", np.arange(3))
    raised = [
        _raised(lambda: store.open_array("missing")),
        _raised(lambda: store.evict("missing")),
        _raised(lambda: store.put_array("k", np.arange(3))),
        _raised(lambda: store.put_array("bad key", np.arange(3))),
        _raised(lambda: store.put_array("obj", np.array([None]))),
        _raised(lambda: store.put_file("f", tmp_path / "missing.npy")),
    ]
    expected = [
        errors.KeyNotFoundError,
        errors.KeyNotFoundError,
        errors.KeyExistsError,
        errors.InvalidKeyError,
        errors.UnsupportedDataError,
        errors.SourceNotFoundError,
    ]
    assert [type(e) for e in raised] == expected
    for error in raised:
        message = str(error)
        assert message and not message.startswith("'")
        assert str(type(error)(message)) == message
        assert str(pickle.loads(pickle.dumps(error))) == message


def test_missing_key_errors_name_the_key_and_what_to_do(store: Store) -> None:
    with pytest.raises(KeyError) as info:
        store.open_array("no/such")
    assert "no/such" in str(info.value)
    assert "put" in str(info.value)
    with pytest.raises(KeyError):
        store.evict("no/such")
    with pytest.raises(KeyError):
        store.info("no/such")


def _damage(store: Store, key: str, edit: Callable[[bytearray], bytes | bytearray]) -> Path:
    path = Path(Layout(store.root).object_file(store.info(key).version, ARRAY_FILE))
    path.write_bytes(edit(bytearray(path.read_bytes())))
    return path


@pytest.mark.parametrize(
    "edit",
    [
        lambda raw: b"GARBAGE!" + raw[8:],  # bad magic
        lambda raw: raw[:-100],  # payload cut short
        lambda raw: raw[:30],  # cut inside the header
    ],
    ids=["magic", "payload", "header"],
)
def test_damaged_entry_raises_corrupt_entry_error(
    store: Store, root: Path, edit: Callable[[bytearray], bytes | bytearray]
) -> None:
    store.put_array("k", np.arange(100, dtype="<i8"))
    _damage(store, "k", edit)
    with pytest.raises(errors.CorruptEntryError) as info:
        Store(root).open_array("k")  # a fresh store: nothing attached yet
    assert "'k'" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_entry_with_unbalanced_header_raises_corrupt_entry_error(store: Store, root: Path) -> None:
    store.put_array("k", np.arange(100, dtype="<i8"))
    _damage(store, "k", lambda raw: raw.replace(b"False, 'shape': (100,), }", b"False, 'shape': (100,),  "))
    with pytest.raises(errors.CorruptEntryError):
        Store(root).open_array("k")


def test_entry_with_bad_descr_raises_corrupt_entry_error(store: Store, root: Path) -> None:
    store.put_array("k", np.arange(100, dtype="<i8"))
    _damage(store, "k", lambda raw: raw.replace(b"'descr': '<i8'", b"'descr': 'zz9'"))
    with pytest.raises(errors.CorruptEntryError):
        Store(root).open_array("k")


def test_entry_whose_data_vanished(store: Store, root: Path) -> None:
    store.put_array("k", np.arange(3))
    store.put_array("other", np.arange(4))
    shutil.rmtree(Layout(root).version_dir(store.info("k").version))  # removed behind the cache's back
    with pytest.raises(errors.CorruptEntryError) as info:
        Store(root).open_array("k")
    assert "'k'" in str(info.value) and "cleanup" in str(info.value)
    store.cleanup()
    assert [e.key for e in store.list()] == ["other"]
    with pytest.raises(errors.KeyNotFoundError):
        Store(root).open_array("k")
