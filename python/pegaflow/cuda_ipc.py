"""CUDA IPC export of a device pointer through libcuda (ctypes; no build
step, no link-time CUDA dependency): the raw 64-byte CUipcMemHandle of the
whole allocation that contains the pointer, and where the pointer sits in it.

Why not `torch.UntypedStorage._share_cuda_()`: its handle is torch's own
66-byte framing (a version byte, a kind byte, then the handle), it changes
between torch versions, and it moves the storage into a ref-counted IPC
context. The server imports a plain CUipcMemHandle with cuIpcOpenMemHandle.

Legacy IPC handles exist only for cuMemAlloc'd memory: the caching
allocator's default segments. Memory from cuMemCreate/cuMemMap (PyTorch
`expandable_segments:True`, the `cudaMallocAsync` backend, vLLM sleep mode)
makes cuIpcGetMemHandle fail; `export_pointer` then raises with what to change.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

#: Where NVIDIA's container runtime puts the driver library; else the loader path.
LIBCUDA_CANDIDATES = ("/usr/local/nvidia/lib64/libcuda.so.1", "libcuda.so.1")
IPC_HANDLE_BYTES = 64
CUDA_SUCCESS = 0


class CudaIpcError(RuntimeError):
    """A CUDA IPC export that cannot work, with the driver's error and a hint."""


class _CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


@dataclass(frozen=True)
class IpcExport:
    """One pointer's export: `handle` (64 bytes) names the allocation that
    starts at `base` and is `region_bytes` long; the pointer is at
    `base_offset` inside it."""

    handle: bytes
    base: int
    base_offset: int
    region_bytes: int


class _Driver:
    def __init__(self) -> None:
        errors = []
        self.lib = None
        for name in LIBCUDA_CANDIDATES:
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError as e:
                errors.append(f"{name}: {e}")
        if self.lib is None:
            raise CudaIpcError("cannot load libcuda: " + "; ".join(errors))
        lib = self.lib
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuMemGetAddressRange_v2.argtypes = [
            ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64,
        ]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_CUipcMemHandle), ctypes.c_uint64]

    def err(self, rc: int) -> str:
        s = ctypes.c_char_p()
        if self.lib.cuGetErrorString(rc, ctypes.byref(s)) == CUDA_SUCCESS and s.value:
            return f"{s.value.decode()} ({rc})"
        return f"CUresult {rc}"


_driver: Optional[_Driver] = None
_driver_lock = threading.Lock()


def _drv() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


def export_pointer(
    ptr: int, device: int = 0, cache: Optional[Dict[Tuple[int, int, int], bytes]] = None
) -> IpcExport:
    """Exports the allocation containing device pointer `ptr`. The caller's
    CUDA context must be current (torch makes it so for a tensor's device).
    `cache` ((device, base, size) → handle), shared over one registration,
    makes layers of one allocation send identical handle bytes, so the
    server imports the allocation once.

    Example:
        e = export_pointer(t.data_ptr(), t.device.index)
        geometry.base_offset == e.base_offset
    """
    d = _drv()
    base = ctypes.c_uint64()
    size = ctypes.c_size_t()
    rc = d.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if rc != CUDA_SUCCESS:
        raise CudaIpcError(
            f"cuMemGetAddressRange(0x{ptr:x}) on device {device} failed: {d.err(rc)}; "
            "is the pointer device memory of the current context?"
        )
    key = (device, base.value, size.value)
    if cache is not None and key in cache:
        return IpcExport(cache[key], base.value, ptr - base.value, size.value)
    h = _CUipcMemHandle()
    rc = d.lib.cuIpcGetMemHandle(ctypes.byref(h), ctypes.c_uint64(base.value))
    if rc != CUDA_SUCCESS:
        raise CudaIpcError(
            f"cuIpcGetMemHandle(base 0x{base.value:x}, {size.value} bytes) on device {device} "
            f"failed: {d.err(rc)}. Legacy CUDA IPC needs cudaMalloc'd memory: unset "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True / backend:cudaMallocAsync and do "
            "not use vLLM sleep mode for the KV cache (virtual-memory allocations cannot be exported)"
        )
    # string_at, not h.reserved: a c_char array field stops at the first NUL byte.
    handle = ctypes.string_at(ctypes.addressof(h), IPC_HANDLE_BYTES)
    if cache is not None:
        cache[key] = handle
    return IpcExport(handle, base.value, ptr - base.value, size.value)
