"""GPU memory per process from NVML, for ``shmcache top`` and ``watch``: next to USS and
PSS, what each process holds on the GPUs (its CUDA context, tensors and caches).

NVML comes from the ``gpu`` extra (``nvidia-ml-py``, imported as ``pynvml``) and talks
to the driver directly, so it needs neither torch nor CUDA in this process. Without the
package or a driver, :attr:`GpuMemory.missing` says why in a few words and the tables
say "no GPU" in one line. NVML reports pids as the host's PID namespace sees them: in a
container without the host's namespace they may match none of the processes here.
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from typing import Any

__all__ = ["GpuMemory"]


class GpuMemory:
    """One NVML session: :meth:`by_pid` reads every GPU's compute processes."""

    def __init__(self) -> None:
        self.missing = ""
        """Why there is no GPU memory to show ("" when there is)."""
        self._nvml: Any = None
        self._handles: list[Any] = []
        if not Path("/proc/driver/nvidia/version").exists() and shutil.which("nvidia-smi") is None:
            self.missing = "no GPU (no NVIDIA driver)"
            return
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError:
            self.missing = "no GPU memory: nvidia-ml-py is not installed (pip install 'shmcache[gpu]')"
            return
        try:
            nvml.nvmlInit()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        except Exception as exc:  # pynvml.NVMLError: no driver, no device, no libnvidia-ml
            self.missing = f"no GPU (NVML: {exc})"
            return
        if not self._handles:
            self.missing = "no GPU (NVML sees no device)"
            return
        self._nvml = nvml

    @property
    def available(self) -> bool:
        return not self.missing

    @property
    def devices(self) -> int:
        return len(self._handles)

    def by_pid(self) -> dict[int, int]:
        """Bytes of GPU memory per pid, summed over the GPUs (empty without NVML). A pid
        whose usage NVML cannot see (another user's, on some drivers) counts 0."""
        if self._nvml is None:
            return {}
        used: dict[int, int] = {}
        for handle in self._handles:
            try:
                processes = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except Exception:  # a GPU lost or reset meanwhile: the others still count
                continue
            for process in processes:
                amount = getattr(process, "usedGpuMemory", None)
                used[int(process.pid)] = used.get(int(process.pid), 0) + int(amount or 0)
        return used

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None
