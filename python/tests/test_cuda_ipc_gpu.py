"""CUDA IPC export with a real GPU (skipped where torch sees no CUDA device):
a tensor carved out of a caching-allocator segment is exported through
libcuda, another process opens the handle with cuIpcOpenMemHandle and reads
the tensor's bytes at base_offset; expandable segments are refused clearly.
Run on the GPU machine: `cd python && python3 -m pytest -q tests/test_cuda_ipc_gpu.py`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.dirname(HERE)

# A second process: open the handle, copy `n` bytes at `offset` back to the host.
READER = r"""
import ctypes, sys
from pegaflow.cuda_ipc import LIBCUDA_CANDIDATES
for name in LIBCUDA_CANDIDATES:
    try:
        cu = ctypes.CDLL(name); break
    except OSError:
        pass
class H(ctypes.Structure):
    _fields_ = [("b", ctypes.c_ubyte * 64)]
handle, offset, n, dev = bytes.fromhex(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def ok(rc, what):
    if rc != 0:
        raise SystemExit(f"{what} failed: {rc}")
ok(cu.cuInit(0), "cuInit")
d = ctypes.c_int(); ok(cu.cuDeviceGet(ctypes.byref(d), dev), "cuDeviceGet")
ctx = ctypes.c_void_p(); ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), d), "retain")
ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
h = H(); ctypes.memmove(ctypes.addressof(h), handle, 64)
p = ctypes.c_uint64()
cu.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), H, ctypes.c_uint]
ok(cu.cuIpcOpenMemHandle_v2(ctypes.byref(p), h, 1), "cuIpcOpenMemHandle")
buf = ctypes.create_string_buffer(n)
cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
ok(cu.cuMemcpyDtoH_v2(buf, p.value + offset, n), "cuMemcpyDtoH")
sys.stdout.write(buf.raw.hex())
"""


def _read_in_child(handle: bytes, offset: int, n: int, dev: int, env=None) -> bytes:
    out = subprocess.run(
        [sys.executable, "-c", READER, handle.hex(), str(offset), str(n), str(dev)],
        capture_output=True, text=True, cwd=PKG, env=env, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return bytes.fromhex(out.stdout)


def test_a_tensor_inside_a_segment_is_exported_and_readable_from_another_process():
    from pegaflow.regions import export_kv_layers

    # Two layers carved from one allocation, as vLLM does (int8 buffer, viewed).
    raw = torch.zeros(2 * 2 * 8 * 16 * 4 * 64 * 2, dtype=torch.int8, device="cuda")
    per = raw.numel() // 2
    l0 = raw[:per].view(torch.float16).view(2, 8, 16, 4, 64)
    l1 = raw[per:].view(torch.float16).view(2, 8, 16, 4, 64)
    l1.copy_(torch.arange(l1.numel(), device="cuda", dtype=torch.float32).remainder(2048).half().view_as(l1))
    torch.cuda.synchronize()
    layers, device = export_kv_layers({"l0": l0, "l1": l1})
    assert device == torch.cuda.current_device()
    assert layers[0].handle == layers[1].handle and len(layers[0].handle) == 64
    g0, g1 = layers[0].geometry, layers[1].geometry
    assert g1.base_offset - g0.base_offset == per and g0.region_bytes >= raw.numel()
    assert (g1.num_segments, g1.seg_bytes, g1.num_blocks) == (2, 16 * 4 * 64 * 2, 8)
    # V plane (segment 1) of block 5 of layer 1, read through the handle in another process.
    at = g1.base_offset + 5 * g1.block_stride + 1 * g1.seg_stride
    got = _read_in_child(layers[1].handle, at, g1.seg_bytes, device)
    assert got == l1[1, 5].contiguous().cpu().numpy().tobytes()


def test_expandable_segments_are_refused_with_what_to_change():
    code = (
        "import torch\nfrom pegaflow.regions import export_kv_layers\n"
        "from pegaflow.cuda_ipc import CudaIpcError\n"
        "t = torch.zeros((2, 4, 16, 2, 64), dtype=torch.float16, device='cuda')\n"
        "try:\n    export_kv_layers({'l': t})\nexcept CudaIpcError as e:\n    print('REFUSED', e)\n"
        "else:\n    print('EXPORTED')\n"
    )
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("REFUSED") and "expandable_segments" in out.stdout, out.stdout
