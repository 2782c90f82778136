"""The CUDA seam of ``shmcache.torch``: an entry's pages registered with CUDA read-only.

Only ``shmcache.torch`` imports this module (it needs torch). What is registered is a
``MAP_SHARED``/``PROT_READ`` mapping of the entry of its own (``attach_array(...,
mode="shared")``), never a reader's copy-on-write array: registering a copy-on-write
mapping copies every page into the process, even with the read-only flag (measured,
BENCHMARKS.md "probe_gpu_mappings"). Flag 8 (``cudaHostRegisterReadOnly``) is the one
that works on such a mapping; flag 0 fails. Registrations are counted per mapping per
process and undone on the last release and at exit. A pinned entry is a live shared
mapping, so the budget (which never evicts a mapped entry) keeps it; each process also
records what it holds in ``<root>/pins/<pid>`` (``_disk.pin_records``), which ``ls``,
``top`` and ``doctor`` read.

Where read-only registration is not supported (a B300 answered error 801), or where
registering an entry fails for any other reason (``cudaErrorMemoryAllocation`` under a
locked-memory limit, ``cudaErrorNotSupported``, ``cudaErrorHostMemoryAlreadyRegistered``...),
``pin`` still holds the mapping but registers nothing, and the loaders gather on the CPU
into a pinned staging buffer; this is logged once per process with the CUDA error's name,
and recorded in the root's ``pins/<pid>`` (``_disk.pin_records``) for ``ls``, ``top`` and
``doctor``.
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ._api import get_store
from ._disk.attach import SHARED, attach_array
from ._disk.layout import ARRAY_FILE
from ._disk.mapped import mapped_base, origin_of
from ._disk.pin_records import PinnedEntry, PinRecord
from .errors import GPUUnavailableError, KeyNotFoundError, UnsupportedDataError

__all__ = [
    "Pinned",
    "cuda_device",
    "cuda_view",
    "cuda_views",
    "error_name",
    "hold",
    "pin",
    "read_only_registration_supported",
    "recorded_event",
    "require_cuda",
    "to_cuda",
]

logger = logging.getLogger("shmcache.torch")

HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly
ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED = 73  # cudaDevAttrHostRegisterReadOnlySupported
STAGING_CHUNK = 64 << 20  # bytes per pinned staging copy in to_cuda's fallback
UNSUPPORTED = "cudaDevAttrHostRegisterReadOnlySupported=0"  # why nothing was registered
CUDA_ERRORS = {
    1: "cudaErrorInvalidValue",
    2: "cudaErrorMemoryAllocation",  # what a locked-memory limit (ulimit -l) answers
    3: "cudaErrorInitializationError",
    100: "cudaErrorNoDevice",
    217: "cudaErrorUnsupportedLimit",
    712: "cudaErrorHostMemoryAlreadyRegistered",
    801: "cudaErrorNotSupported",
    999: "cudaErrorUnknown",
}

Root = str | os.PathLike[str] | None


def require_cuda(what: str) -> None:
    """Raise :class:`GPUUnavailableError` naming what is missing if CUDA is not usable."""
    if torch.version.cuda is None:
        reason = (
            f"this PyTorch ({torch.__version__}) is a CPU-only build: install a CUDA build of "
            "torch (https://pytorch.org/get-started/locally/)"
        )
    elif not torch.cuda.is_available():
        reason = (
            "no CUDA device or driver is usable (torch.cuda.is_available() is False): check "
            "nvidia-smi and CUDA_VISIBLE_DEVICES"
        )
    else:
        return
    raise GPUUnavailableError(f"{what} needs CUDA, and {reason}; on CPU use device='cpu' or as_tensor")


def cuda_device(device: Any, what: str = "this function") -> torch.device:
    """``device`` (None: the current one) as a ``torch.device("cuda", index)``."""
    require_cuda(what)
    resolved = torch.device("cuda" if device is None else device)
    if resolved.type != "cuda":
        raise ValueError(f"{what} puts data on a CUDA device, not {resolved}")
    if resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _cudart() -> Any:
    """torch's binding of the CUDA runtime (``cudaHostRegister``, ``cudaHostUnregister``)."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def recorded_event() -> Any:
    """A CUDA event recorded now on the current stream."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


def _code(rc: Any) -> int:
    """A cudaError_t as returned by ``_cudart()`` (an enum or an int)."""
    return int(getattr(rc, "value", rc))


def error_name(rc: int) -> str:
    """The name of a cudaError_t (torch's runtime binding has no cudaGetErrorName)."""
    return CUDA_ERRORS.get(rc, f"cudaError {rc}")


def _clear_last_error(device: torch.device) -> None:
    """Consume the error a failed registration leaves behind, so that torch's next launch
    check does not report it as its own (a launch check reads and clears it)."""
    try:
        torch.zeros(1, device=device).add_(1)
        torch.cuda.synchronize(device)
    except (RuntimeError, AssertionError):
        pass


_SUPPORT: dict[int, bool] = {}
_LOCK = threading.RLock()


def read_only_registration_supported(device: Any = None) -> bool:
    """Whether ``device`` can register host memory read-only (``cudaHostRegisterReadOnly``).

    Asks ``cudaDevAttrHostRegisterReadOnlySupported`` where torch exposes
    ``cudaDeviceGetAttribute``; otherwise registers one page of a read-only shared
    mapping and looks at the answer. Cached per device.
    """
    resolved = cuda_device(device, "read_only_registration_supported")
    index = resolved.index
    assert index is not None
    with _LOCK:
        if index in _SUPPORT:
            return _SUPPORT[index]
        cudart = _cudart()
        getter = getattr(cudart, "cudaDeviceGetAttribute", None)
        supported: bool | None = None
        if getter is not None:
            try:
                answer = getter(ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED, index)
                if isinstance(answer, tuple) and len(answer) == 2 and _code(answer[0]) == 0:
                    supported = bool(int(answer[1]))  # (cudaError_t, value); any other shape: probe
            except Exception:
                supported = None
        if supported is None:
            page = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            probe = np.frombuffer(page, dtype=np.uint8)
            pointer = int(probe.__array_interface__["data"][0])
            with torch.cuda.device(resolved):
                rc = _code(cudart.cudaHostRegister(pointer, mmap.PAGESIZE, HOST_REGISTER_READ_ONLY))
                if rc == 0:
                    cudart.cudaHostUnregister(pointer)
                else:
                    _clear_last_error(resolved)
            supported = rc == 0
            del probe
            page.close()
        _SUPPORT[index] = supported
        if not supported:
            logger.warning(
                "%s cannot register host memory read-only (cudaHostRegisterReadOnly): shmcache.torch "
                "gathers batches on the CPU into a pinned staging buffer and copies them (slower; "
                "cuda_view is unavailable)",
                resolved,
            )
        return supported


class _Registration:
    """One entry file's shared mapping in this process, and whether CUDA has it registered."""

    def __init__(self, key: str, array: np.ndarray, device: torch.device, error: str | None) -> None:
        self.key = key
        self.array = array  # the whole entry, over a MAP_SHARED PROT_READ mapping of its own
        self.pointer = int(array.__array_interface__["data"][0])
        self.device = device
        self.registered = error is None
        self.error = error or ""  # why not registered ("" where it is, or was not asked)
        self.count = 0


_REGISTRY: dict[tuple[str, str, str], _Registration] = {}
_REGISTRY_PID = os.getpid()
_RECORDS: dict[str, PinRecord] = {}  # root -> this process's pins/<pid> there
_FELL_BACK: list[str] = []  # the error names already logged (the first one is logged)


def _registry() -> dict[tuple[str, str, str], _Registration]:
    global _REGISTRY_PID
    if os.getpid() != _REGISTRY_PID:  # a forked child inherits no CUDA registration
        _REGISTRY.clear()
        _RECORDS.clear()  # nor its parent's records (pin_records closed their descriptors)
        _REGISTRY_PID = os.getpid()
    return _REGISTRY


def _record(root: str) -> None:
    """Rewrite this process's record of what it holds in ``root`` (best effort: a root
    this process may not write to, e.g. another user's, only goes unrecorded)."""
    entries = [
        PinnedEntry(ident[1], held.key, held.registered, held.error)
        for ident, held in _REGISTRY.items()
        if ident[0] == root
    ]
    record = _RECORDS.get(root)
    if record is None:
        if not entries:
            return
        record = _RECORDS[root] = PinRecord(root)
    try:
        record.write(entries)
    except OSError as exc:
        logger.debug("cannot record the pins of %s in %s: %s", os.getpid(), root, exc)


def _host_register(pointer: int, nbytes: int, device: torch.device) -> int:
    """The CUDA call of a registration: its cudaError_t (0: registered). A failure's
    sticky error is consumed here. Tests of the fallback decision replace this seam."""
    with torch.cuda.device(device):
        rc = _code(_cudart().cudaHostRegister(pointer, nbytes, HOST_REGISTER_READ_ONLY))
    if rc != 0:
        _clear_last_error(device)
    return rc


def _register(key: str, whole: np.ndarray, device: torch.device) -> str | None:
    """Register ``whole`` read-only; None if done, else the CUDA error's name. Any failure
    means the pinned-staging path for this entry (logged once per process), never an
    error: staging is slower but gives the same batches."""
    rc = _host_register(int(whole.__array_interface__["data"][0]), whole.nbytes, device)
    if rc == 0:
        return None
    name = error_name(rc)
    first = not _FELL_BACK
    if name not in _FELL_BACK:
        _FELL_BACK.append(name)
    (logger.warning if first else logger.info)(
        "cudaHostRegister of entry %r (%d bytes, read-only) failed with %s: shmcache.torch gathers "
        "its batches on the CPU into a pinned staging buffer instead (slower; cuda_view is unavailable "
        "for it). See `shmcache doctor` (locked-memory limit `ulimit -l`, driver).%s",
        key,
        whole.nbytes,
        name,
        "" if first else " (logged at INFO after the first)",
    )
    return name


def _resolve(array_or_key: np.ndarray | str, root: Root) -> tuple[str, str, str, str, np.ndarray | None]:
    """(root, version, file, key, the caller's array or None) behind ``array_or_key``."""
    if isinstance(array_or_key, str):
        store = get_store(root)
        info = store.info(array_or_key)
        if info.kind != "array":
            raise UnsupportedDataError(
                f"entry {array_or_key!r} is a {info.kind} entry; only array entries can be pinned "
                "or copied to a GPU (put_array)"
            )
        return str(store.root), info.version, ARRAY_FILE, array_or_key, None
    if not isinstance(array_or_key, np.ndarray):
        raise TypeError(f"expected a key or a shmcache array, got {type(array_or_key).__name__}")
    found = origin_of(array_or_key)
    if found is None:
        raise ValueError("array does not live in the shmcache (open it with shmcache.open_array)")
    root_str, version, filename, key = found[0]
    return root_str, version, filename, key, array_or_key


def _acquire(ident: tuple[str, str, str], key: str, device: torch.device, register: bool) -> _Registration:
    with _LOCK:
        registry = _registry()
        held = registry.get(ident)
        if held is None:
            try:
                whole = attach_array(*ident, key, mode=SHARED)
            except FileNotFoundError:
                raise KeyNotFoundError(
                    f"entry {key!r} (version {ident[1]}) was replaced or evicted; open the key again"
                ) from None
            if not register:
                error: str | None = "" if device.type == "cpu" else UNSUPPORTED
            elif whole.nbytes:
                error = _register(key, whole, device)
            else:
                error = None  # nothing to register
            held = registry[ident] = _Registration(key, whole, device, error)
            _record(ident[0])
        elif held.registered and held.device != device:
            raise ValueError(
                f"entry {key!r} is registered for {held.device} in this process; use that device "
                "(one process per GPU), or to_cuda for a copy"
            )
        held.count += 1
        return held


def _release(ident: tuple[str, str, str]) -> None:
    with _LOCK:
        registry = _registry()
        held = registry.get(ident)
        if held is None:
            return
        held.count -= 1
        if held.count <= 0:
            del registry[ident]
            _unregister(held)
            _record(ident[0])


def _unregister(held: _Registration) -> None:
    if held.registered and held.array.nbytes:  # an empty entry was never registered
        held.registered = False
        with torch.cuda.device(held.device):
            torch.cuda.synchronize(held.device)  # no kernel may still read the pages
            _cudart().cudaHostUnregister(held.pointer)


@atexit.register
def _unregister_all() -> None:
    with _LOCK:
        if os.getpid() != _REGISTRY_PID:
            return
        for held in list(_REGISTRY.values()):
            try:
                _unregister(held)
            except Exception:
                pass
        _REGISTRY.clear()
        for record in _RECORDS.values():
            record.close()
        _RECORDS.clear()


class Pinned:
    """This process's hold on an entry's pages, registered with CUDA (``registered``) or,
    where read-only registration is unsupported, only mapped. ``release()`` (or the end of
    a ``with`` block, or garbage collection) drops it; the last one unregisters."""

    def __init__(self, ident: tuple[str, str, str], key: str, held: _Registration, view: np.ndarray) -> None:
        self.key = key
        self.version = ident[1]
        self.device = held.device
        self.registered = held.registered
        self.error = held.error
        """Why the entry is not registered: a CUDA error's name, UNSUPPORTED, or ""."""
        self.array = view  # read-only, over the registered shared mapping
        self._finalizer = weakref.finalize(self, _release, ident)

    def release(self) -> None:
        self._finalizer()

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> Pinned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "registered" if self.registered else "mapped, not registered"
        state = "released" if self.released else state
        return f"<Pinned {self.key!r} {self.array.shape} {self.array.dtype} on {self.device}: {state}>"


def pin(array_or_key: np.ndarray | str, *, root: Root = None, device: Any = None) -> Pinned:
    """Register the pages behind a cached array (or key) with CUDA, read-only, no copy."""
    resolved = cuda_device(device, "pin")
    return hold(array_or_key, root, resolved, register=read_only_registration_supported(resolved))


def hold(array_or_key: np.ndarray | str, root: Root, device: torch.device, *, register: bool) -> Pinned:
    """``pin``'s bookkeeping: this process's shared mapping of the entry, counted, and
    registered with CUDA when ``register`` (False: mapped only, e.g. on a CPU)."""
    root_str, version, filename, key, array = _resolve(array_or_key, root)
    ident = (root_str, version, filename)
    held = _acquire(ident, key, device, register)
    try:
        view = held.array if array is None else _same_view(held.array, array)
    except BaseException:
        _release(ident)
        raise
    return Pinned(ident, key, held, view)


def _same_view(whole: np.ndarray, array: np.ndarray) -> np.ndarray:
    """The caller's view of the entry (any slice), over ``whole``'s mapping instead."""
    base = mapped_base(array)
    mapping = mapped_base(whole)  # both may map part of a file: rebase through the file
    offset = int(array.__array_interface__["data"][0]) - base.start_address()
    offset += base.file_start - mapping.file_start
    view = np.ndarray(array.shape, array.dtype, buffer=mapping, offset=offset, strides=array.strides)
    view.setflags(write=False)
    return view


class _HostAlias:
    """Registered host memory shown to torch as a CUDA array (same pointer under UVA). The
    tensor keeps this object alive; its pin is released when the tensor is freed."""

    def __init__(self, pinned: Pinned) -> None:
        array = pinned.array
        self.pinned = pinned
        contiguous = array.flags.c_contiguous
        self.__cuda_array_interface__ = {
            "shape": array.shape,
            "typestr": array.dtype.str,
            "data": (int(array.__array_interface__["data"][0]), False),  # torch refuses True
            "version": 3,
            "strides": None if contiguous else array.strides,
        }


def cuda_view(array_or_key: np.ndarray | str, device: Any = None, *, root: Root = None) -> torch.Tensor:
    """A CUDA tensor aliasing the cache's registered pages: no copy, read-only by contract."""
    resolved = cuda_device(device, "cuda_view")
    pinned = pin(array_or_key, root=root, device=resolved)
    if not pinned.registered:
        pinned.release()
        why = (
            f"which {resolved} does not support (cudaDevAttrHostRegisterReadOnlySupported is 0)"
            if pinned.error == UNSUPPORTED
            else f"which failed for entry {pinned.key!r} with {pinned.error} (see `shmcache doctor`)"
        )
        raise GPUUnavailableError(
            f"cuda_view needs read-only host registration, {why}; use to_cuda (a copy in GPU "
            "memory) or GPULoader (gathers through a pinned staging buffer)"
        )
    return _alias(pinned, resolved)


def cuda_views(
    arrays_or_keys: Sequence[np.ndarray | str], device: Any = None, *, root: Root = None
) -> list[torch.Tensor] | None:
    """A :func:`cuda_view` of each cached array (or key), or None (nothing held) if any of
    them could not be registered: the caller then gathers through a pinned staging buffer."""
    resolved = cuda_device(device, "cuda_views")
    pins: list[Pinned] = []
    try:
        for array_or_key in arrays_or_keys:
            pins.append(pin(array_or_key, root=root, device=resolved))
    except BaseException:
        for held in pins:
            held.release()
        raise
    if not all(held.registered for held in pins):
        for held in pins:
            held.release()
        return None
    return [_alias(held, resolved) for held in pins]


def _alias(pinned: Pinned, resolved: torch.device) -> torch.Tensor:
    """A CUDA tensor over a registered pin's pages, which keeps the pin while it lives."""
    if pinned.array.size == 0:
        pinned.release()
        return torch.empty(pinned.array.shape, dtype=_torch_dtype(pinned.array.dtype), device=resolved)
    with torch.cuda.device(resolved):
        return torch.as_tensor(_HostAlias(pinned), device=resolved)


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    from ._tensors import tensor_of  # bfloat16/float8 entries: their real dtype

    try:
        return tensor_of(np.empty(0, dtype=dtype)).dtype
    except TypeError as exc:
        raise UnsupportedDataError(f"torch has no dtype for {dtype}: {exc}") from None


def to_cuda(key: np.ndarray | str, device: Any = None, *, root: Root = None) -> torch.Tensor:
    """A copy of a whole array entry in GPU memory (writable, the cache untouched), sent
    from the registered pages at full bandwidth, or through a pinned staging buffer."""
    resolved = cuda_device(device, "to_cuda")
    with pin(key, root=root, device=resolved) as pinned:
        array = pinned.array
        out = torch.empty(array.shape, dtype=_torch_dtype(array.dtype), device=resolved)
        if array.size == 0:
            return out
        host = _host_tensor(array)
        if pinned.registered:
            out.copy_(host, non_blocking=True)  # a DMA from registered memory
        else:
            _staged_copy(host.reshape(-1), out.view(-1))
        torch.cuda.synchronize(resolved)  # the pin ends here: no copy may still read it
        return out


def _host_tensor(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor over a read-only array, without torch's "not writable" warning (no
    write is made through it)."""
    import warnings

    from ._tensors import tensor_of  # bfloat16/float8 entries: their real dtype, same bytes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return tensor_of(array)


def _staged_copy(source: torch.Tensor, target: torch.Tensor) -> None:
    """Copy a flat CPU tensor to a flat CUDA one through two pinned buffers in turn."""
    step = max(1, STAGING_CHUNK // max(1, source.element_size()))
    buffers = [torch.empty(min(step, len(source)), dtype=source.dtype, pin_memory=True) for _ in range(2)]
    done: list[torch.cuda.Event | None] = [None, None]
    for turn, start in enumerate(range(0, len(source), step)):
        slot = turn % 2
        event = done[slot]
        if event is not None:
            event.synchronize()  # the copy out of this buffer has finished
        count = min(step, len(source) - start)
        buffers[slot][:count].copy_(source[start : start + count])
        target[start : start + count].copy_(buffers[slot][:count], non_blocking=True)
        done[slot] = recorded_event()
