"""KV regions: turning an engine's per-layer KV tensors into what
RegisterContext needs (a 64-byte region handle and a geometry per layer).

- CUDA tensors: the allocation's CUDA IPC handle (cuda_ipc.py);
  `base_offset` = where the tensor starts inside its allocation.
- Host tensors (the host backend, CI): the tensor must live in a
  `ShmRegion`, a `/dev/shm/<name>` file this process created and mapped;
  the handle is its NUL-padded name "/name".

Geometry comes from the tensor's shape and strides, one formula for every
layout (`addr(b, s) = base_offset + b*block_stride + s*seg_stride`):
  KV-first `[2, num_blocks, ...]` (FlashAttention):  2 segments,
      seg_stride = stride[0], block_stride = stride[1], seg_bytes = one block's K (or V)
  blocks-first `[num_blocks, ...]` (MLA, FlashInfer's [N, 2, ...], cross-layer): 1 segment
      of the whole block.
A block's own dimensions must be dense (any order, e.g. HND or NHD).
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .client import Geometry
from .cuda_ipc import export_pointer
from . import shm_files

HANDLE_BYTES = 64
KV_FIRST = "kv_first"
BLOCKS_FIRST = "blocks_first"

_counter = itertools.count()
_live_lock = threading.Lock()
#: name → region, to find the region a host tensor lives in.
_live: Dict[str, "ShmRegion"] = {}


class RegionError(ValueError):
    """A KV tensor that cannot be registered, naming the layer and why."""


def _dense_span(shape: Sequence[int], strides: Sequence[int]) -> Optional[int]:
    """Elements covered by dims that form one dense block (any dim order), else None."""
    dims = sorted((st, sz) for sz, st in zip(shape, strides) if sz != 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return None
        expect *= sz
    return expect


def _planes_overlap(num_blocks: int, block_stride: int, seg_stride: int, seg_bytes: int) -> bool:
    """True when some block's V half [b2*bs + ss, +seg) overlaps some block's K half [b1*bs, +seg):
    |k*bs - ss| < seg for an integer k = b1 - b2 within -(n-1)..n-1, whose nearest candidates
    to ss/bs are the only ones to check."""
    if block_stride == 0 or num_blocks == 1:
        return abs(seg_stride) < seg_bytes
    lo, hi = -(num_blocks - 1), num_blocks - 1
    k0 = seg_stride // block_stride
    for k in (k0 - 1, k0, k0 + 1, k0 + 2):
        k = min(hi, max(lo, k))
        if abs(k * block_stride - seg_stride) < seg_bytes:
            return True
    return False


def kv_geometry(
    shape: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
    base_offset: int,
    region_bytes: int,
    layout: Optional[str] = None,
    where: str = "tensor",
) -> Geometry:
    """Geometry of one layer's paged KV tensor (`strides` in elements).
    `layout` None picks KV-first when shape[0] == 2 (vLLM's rule), else blocks-first.

    Example:
        g = kv_geometry([2, 64, 16, 8, 128], [131072*2, 16384, 1024, 128, 1], 2, 0, 1 << 25)
        (g.num_segments, g.seg_bytes, g.block_stride)   # (2, 32768, 32768)
    """
    shape, strides = list(shape), list(strides)
    if len(shape) < 2:
        raise RegionError(f"{where}: a paged KV tensor has >= 2 dims, got shape {shape}")
    if any(s < 0 for s in strides):
        raise RegionError(f"{where}: negative strides {strides} are not supported")
    if layout is None:
        layout = KV_FIRST if shape[0] == 2 and len(shape) >= 3 else BLOCKS_FIRST
    if layout == KV_FIRST:
        if shape[0] != 2 or len(shape) < 3:
            raise RegionError(f"{where}: KV-first layout needs shape [2, num_blocks, ...], got {shape}")
        num_blocks, inner, segs = shape[1], 2, 2
        block_stride, seg_stride = strides[1] * itemsize, strides[0] * itemsize
    elif layout == BLOCKS_FIRST:
        num_blocks, inner, segs = shape[0], 1, 1
        block_stride = strides[0] * itemsize
        seg_stride = 0
    else:
        raise RegionError(f"{where}: layout {layout!r} is not {KV_FIRST!r} or {BLOCKS_FIRST!r}")
    span = _dense_span(shape[inner:], strides[inner:])
    if span is None:
        raise RegionError(
            f"{where}: a block's dims {shape[inner:]} with strides {strides[inner:]} are not dense; "
            "PegaFlow copies each block (or its K / V half) as one contiguous segment"
        )
    seg_bytes = span * itemsize
    if segs == 1:
        seg_stride = seg_bytes
    if num_blocks > 1 and block_stride < seg_bytes:
        raise RegionError(f"{where}: block_stride {block_stride} < seg_bytes {seg_bytes} (blocks overlap)")
    if segs == 2 and _planes_overlap(num_blocks, block_stride, seg_stride, seg_bytes):
        # e.g. a K/V dim of stride 0 (an `expand`ed tensor): saving a block would store its K
        # bytes as V too, and a load would write one over the other.
        raise RegionError(
            f"{where}: the K and V halves overlap (seg_stride {seg_stride}, block_stride {block_stride}, "
            f"seg_bytes {seg_bytes}, {num_blocks} blocks); each block's K and V must be their own bytes"
        )
    return Geometry(
        num_blocks=num_blocks,
        block_stride=block_stride,
        seg_stride=seg_stride,
        seg_bytes=seg_bytes,
        num_segments=segs,
        base_offset=base_offset,
        region_bytes=region_bytes,
    )


def block_axis(shape: Sequence[int], layout: Optional[str] = None) -> int:
    """The axis of a paged KV tensor that indexes blocks, by `kv_geometry`'s layout rule."""
    if layout is None:
        layout = KV_FIRST if shape[0] == 2 and len(shape) >= 3 else BLOCKS_FIRST
    return 1 if layout == KV_FIRST else 0


def _footprint_bytes(g: Geometry) -> int:
    return (g.num_blocks - 1) * g.block_stride + (g.num_segments - 1) * g.seg_stride + g.seg_bytes


class ShmRegion:
    """A shared-memory file `/dev/shm/<name>` created by this process
    (O_CREAT|O_EXCL, so a name is never shared by accident) and mapped here:
    host-backend KV memory the server maps by name. Not
    multiprocessing.shared_memory: its resource tracker unlinks the file
    when some process exits. The file is unlinked by `close()`; it must
    outlive the registration (the server maps it again after a restart). A region still open
    when its process exits (normally or on an unhandled exception) is unlinked then; a
    SIGKILLed process leaves its files (whoever killed it removes `pegaflow-kv-<pid>-*`).

    Example:
        r = ShmRegion(2 * 64 * 4096)
        kv = r.torch(torch.bfloat16, (2, 64, 16, 8, 16))   # or r.numpy(np.float16, ...)
        ...
        r.close()
    """

    def __init__(self, nbytes: int, name: Optional[str] = None):
        if nbytes <= 0:
            raise ValueError(f"ShmRegion size must be > 0, got {nbytes}")
        name = name or f"/pegaflow-kv-{os.getpid()}-{next(_counter)}-{os.urandom(3).hex()}"
        if not name.startswith("/") or "/" in name[1:] or len(name.encode()) >= HANDLE_BYTES:
            raise ValueError(f"shm name {name!r} must be '/name', < {HANDLE_BYTES} bytes")
        self.name = name
        self.nbytes = nbytes
        self._path = "/dev/shm" + name
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(self._path)
            raise
        os.close(fd)
        shm_files.own(self._path)
        probe = ctypes.c_char.from_buffer(self._mm)
        self.address = ctypes.addressof(probe)
        del probe  # releases the buffer export again
        self._closed = False
        with _live_lock:
            _live[name] = self

    @property
    def handle(self) -> bytes:
        """The 64-byte region handle: the NUL-padded name."""
        return self.name.encode().ljust(HANDLE_BYTES, b"\0")

    def _check(self, nbytes: int, offset: int) -> None:
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(
                f"shm region {self.name}: view of {nbytes} bytes at {offset} exceeds its {self.nbytes} bytes"
            )

    def numpy(self, dtype: Any, shape: Sequence[int], offset: int = 0) -> np.ndarray:
        """A numpy view of `shape` elements of `dtype` starting at byte `offset`."""
        dt = np.dtype(dtype)
        n = int(np.prod(shape))
        self._check(n * dt.itemsize, offset)
        return np.frombuffer(self._mm, dtype=dt, count=n, offset=offset).reshape(shape)

    def torch(self, dtype: Any, shape: Sequence[int], offset: int = 0):
        """A torch CPU tensor view (torch.frombuffer) of `shape` at byte `offset`."""
        import torch

        n = 1
        for s in shape:
            n *= int(s)
        itemsize = torch.empty((), dtype=dtype).element_size()
        self._check(n * itemsize, offset)
        return torch.frombuffer(self._mm, dtype=dtype, count=n, offset=offset).view(*shape)

    @classmethod
    def holding(cls, like: Any, shape: Sequence[int]) -> Tuple["ShmRegion", Any]:
        """A new region just big enough for `shape` elements of `like`'s dtype, and that
        array viewed in it: numpy when `like` is a numpy array, else a torch CPU tensor.
        The caller closes the region once the array is no longer used.

        Example:
            r, kv = ShmRegion.holding(torch.empty((), dtype=torch.bfloat16), (2, 64, 16, 8, 128))
        """
        n = 1
        for d in shape:
            if int(d) <= 0:
                raise ValueError(f"ShmRegion.holding: shape {tuple(shape)} has a dimension <= 0")
            n *= int(d)
        numpy = isinstance(like, np.ndarray)
        r = cls(n * (like.itemsize if numpy else like.element_size()))
        try:
            return r, (r.numpy(like.dtype, shape) if numpy else r.torch(like.dtype, shape))
        except BaseException:
            r.close()  # the file would outlive the process: nobody holds the region to close it
            raise

    def contains(self, ptr: int, nbytes: int) -> bool:
        return self.address <= ptr and ptr + nbytes <= self.address + self.nbytes

    def close(self) -> None:
        """Unlinks the file and unmaps it (the mapping stays while views of it live)."""
        if self._closed:
            return
        self._closed = True
        with _live_lock:
            _live.pop(self.name, None)
        shm_files.unlink(self._path)
        try:
            self._mm.close()
        except BufferError:
            pass  # numpy/torch views still use it; the mapping goes with the last one

    def __enter__(self) -> "ShmRegion":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def find_shm_region(ptr: int, nbytes: int) -> Optional[ShmRegion]:
    """The live ShmRegion holding [ptr, ptr + nbytes), if any."""
    with _live_lock:
        for r in _live.values():
            if r.contains(ptr, nbytes):
                return r
    return None


@dataclass(frozen=True)
class LayerRegion:
    """One layer as RegisterContext wants it."""

    name: str
    handle: bytes
    geometry: Geometry


def _tensor_info(t: Any) -> Tuple[int, List[int], List[int], int, Optional[int], bool]:
    """(data pointer, shape, strides in elements, itemsize, cuda device or None, is_cuda)."""
    if isinstance(t, np.ndarray):
        st = [s // t.itemsize for s in t.strides]
        if any(s % t.itemsize for s in t.strides):
            raise RegionError("numpy strides are not multiples of the item size")
        return t.__array_interface__["data"][0], list(t.shape), st, t.itemsize, None, False
    # torch.Tensor (duck-typed so torch stays optional)
    is_cuda = bool(getattr(t, "is_cuda", False))
    dev = t.device.index if is_cuda else None
    return t.data_ptr(), list(t.shape), list(t.stride()), t.element_size(), dev, is_cuda


def export_kv_layers(
    kv_caches: Mapping[str, Any], layout: Optional[str] = None
) -> Tuple[List[LayerRegion], int]:
    """Region handle + geometry for each layer, in the mapping's order (the
    order the model runs them). Returns (layers, CUDA device id; 0 for host).
    All layers must share one device and one segment shape.

    Example:
        layers, device = export_kv_layers({"model.layers.0.attn": kv0, "model.layers.1.attn": kv1})
    """
    if not kv_caches:
        raise RegionError("no KV tensors to register")
    out: List[LayerRegion] = []
    cache: Dict[Tuple[int, int, int], bytes] = {}
    device: Optional[int] = None
    kind: Optional[bool] = None
    for name, t in kv_caches.items():
        ptr, shape, strides, itemsize, dev, is_cuda = _tensor_info(t)
        where = f'layer "{name}"'
        if kind is not None and kind != is_cuda:
            raise RegionError(f"{where}: mixes CUDA and host KV tensors")
        kind = is_cuda
        g0 = kv_geometry(shape, strides, itemsize, 0, 1, layout, where)
        span = _footprint_bytes(g0)
        if is_cuda:
            if device is not None and dev != device:
                raise RegionError(f"{where}: on cuda:{dev}, earlier layers on cuda:{device}")
            device = dev
            e = export_pointer(ptr, dev or 0, cache)
            handle, off, size = e.handle, e.base_offset, e.region_bytes
        else:
            r = find_shm_region(ptr, span)
            if r is None:
                raise RegionError(
                    f"{where}: a host KV tensor must live in a pegaflow.regions.ShmRegion "
                    "(the host backend maps it by name); allocate it with ShmRegion(...).torch(...)"
                )
            handle, off, size = r.handle, ptr - r.address, r.nbytes
        if off + span > size:
            raise RegionError(f"{where}: reaches byte {off + span} of a {size}-byte region")
        g = kv_geometry(shape, strides, itemsize, off, size, layout, where)
        if out and (g.seg_bytes, g.num_segments) != (out[0].geometry.seg_bytes, out[0].geometry.num_segments):
            raise RegionError(
                f"{where}: {g.num_segments} x {g.seg_bytes}-byte segments, layer \"{out[0].name}\" has "
                f"{out[0].geometry.num_segments} x {out[0].geometry.seg_bytes}; all layers must agree"
            )
        out.append(LayerRegion(name, handle, g))
    return out, (device if device is not None else 0)
