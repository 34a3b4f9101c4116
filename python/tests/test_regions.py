"""KV tensors → region handles and geometry: layouts from shape/stride,
shm regions, and the CUDA IPC export logic against a stand-in libcuda (no
GPU here: the real driver path runs on the GPU machine only)."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import torch

from pegaflow import cuda_ipc
from pegaflow.regions import (
    BLOCKS_FIRST,
    RegionError,
    ShmRegion,
    export_kv_layers,
    kv_geometry,
)

from leaks import assert_unlinked_at_exit


def test_kv_first_flash_attention_layout_is_two_planes():
    t = torch.empty((2, 64, 16, 8, 128), dtype=torch.bfloat16)
    g = kv_geometry(t.shape, t.stride(), 2, 128, 1 << 30)
    assert (g.num_blocks, g.num_segments) == (64, 2)
    assert g.seg_bytes == g.block_stride == 16 * 8 * 128 * 2  # 32 KiB, Llama-3.1-8B per layer per block
    assert g.seg_stride == 64 * g.block_stride and g.base_offset == 128


def test_hnd_stride_order_is_still_one_dense_segment_per_block():
    phys = torch.empty((2, 10, 8, 16, 64), dtype=torch.float16)  # [2, N, heads, block, dim]
    logical = phys.permute(0, 1, 3, 2, 4)  # vLLM's logical [2, N, block, heads, dim]
    g = kv_geometry(logical.shape, logical.stride(), 2, 0, 1 << 20)
    assert (g.num_segments, g.seg_bytes, g.block_stride) == (2, 8 * 16 * 64 * 2, 8 * 16 * 64 * 2)


def test_mla_and_blocks_first_layouts_are_one_segment():
    mla = torch.empty((100, 16, 576), dtype=torch.bfloat16)
    g = kv_geometry(mla.shape, mla.stride(), 2, 0, 1 << 24)
    assert (g.num_blocks, g.num_segments, g.seg_bytes, g.block_stride) == (100, 1, 16 * 576 * 2, 16 * 576 * 2)
    fi = torch.empty((2, 2, 16, 8, 64), dtype=torch.float16)  # FlashInfer [N, 2, ...] with N == 2
    g = kv_geometry(fi.shape, fi.stride(), 2, 0, 1 << 20, layout=BLOCKS_FIRST)
    assert (g.num_blocks, g.num_segments, g.seg_bytes) == (2, 1, 2 * 16 * 8 * 64 * 2)


def test_a_block_that_is_not_dense_is_refused_with_the_reason():
    t = torch.empty((2, 8, 16, 8, 256), dtype=torch.float16)[..., :128]  # padded head_dim
    with pytest.raises(RegionError, match='layer "x".*not dense'):
        kv_geometry(t.shape, t.stride(), 2, 0, 1 << 20, where='layer "x"')
    with pytest.raises(RegionError, match="KV-first"):
        kv_geometry((3, 4, 4), (16, 4, 1), 2, 0, 1 << 10, layout="kv_first")


def test_k_and_v_halves_that_overlap_are_refused_and_interleaved_ones_accepted():
    plane = torch.empty((1, 64, 16, 8, 128), dtype=torch.bfloat16)
    same = plane.expand(2, -1, -1, -1, -1)  # K and V are the same bytes (stride 0)
    with pytest.raises(RegionError, match='layer "x": the K and V halves overlap'):
        kv_geometry(same.shape, same.stride(), 2, 0, 1 << 30, where='layer "x"')
    seg = 16 * 8 * 128
    # V starts half a segment into the block after K: every V half straddles two K halves.
    with pytest.raises(RegionError, match="overlap"):
        kv_geometry((2, 64, 16, 8, 128), (seg + seg // 2, 2 * seg, 8 * 128, 128, 1), 2, 0, 1 << 30)
    # K then V of each block side by side ([num_blocks, 2, ...] viewed KV-first): no byte shared.
    inter = torch.empty((64, 2, 16, 8, 128), dtype=torch.bfloat16).transpose(0, 1)
    g = kv_geometry(inter.shape, inter.stride(), 2, 0, 1 << 30)
    assert (g.seg_stride, g.block_stride, g.seg_bytes) == (seg * 2, 2 * seg * 2, seg * 2)


def test_layers_in_one_shm_region_share_its_handle_and_sit_at_their_offsets():
    with ShmRegion(2 * 4096) as r:
        a = r.torch(torch.float16, (2, 8, 4, 2, 8), offset=0)
        b = r.numpy(np.float16, (2, 8, 4, 2, 8), offset=4096)
        layers, device = export_kv_layers({"l0": a, "l1": b})
        assert device == 0 and [l.name for l in layers] == ["l0", "l1"]
        assert layers[0].handle == layers[1].handle == r.name.encode().ljust(64, b"\0")
        assert [l.geometry.base_offset for l in layers] == [0, 4096]
        assert all(l.geometry.region_bytes == 8192 for l in layers)
        a[1, 3] = 7  # views write the shared file
        with open("/dev/shm" + r.name, "rb") as f:
            f.seek(1024 + 3 * 128)  # V plane (8 blocks x 128 bytes) + block 3
            assert np.frombuffer(f.read(2), np.float16)[0] == 7
    assert not os.path.exists("/dev/shm" + r.name)


def test_a_host_tensor_outside_a_shm_region_is_refused():
    with pytest.raises(RegionError, match="ShmRegion"):
        export_kv_layers({"l0": torch.zeros((2, 4, 4, 2, 8), dtype=torch.float16)})


def test_layers_with_different_block_shapes_are_refused():
    with ShmRegion(1 << 16) as r:
        a = r.numpy(np.float16, (2, 8, 4, 2, 8))
        b = r.numpy(np.float16, (2, 8, 4, 2, 16), offset=8192)
        with pytest.raises(RegionError, match="all layers must agree"):
            export_kv_layers({"a": a, "b": b})


class _FakeDriver:
    """libcuda stand-in: one allocation [0x7000_0000, +size); IPC handle = fixed bytes
    with a NUL inside (a c_char field would cut it there)."""

    def __init__(self, size: int, ipc_rc: int = 0):
        self.base, self.size, self.ipc_rc, self.ipc_calls = 0x7000_0000, size, ipc_rc, 0
        drv = self

        class Lib:
            @staticmethod
            def cuMemGetAddressRange_v2(pbase, psize, ptr):
                if not drv.base <= ptr.value < drv.base + drv.size:
                    return 1
                pbase._obj.value, psize._obj.value = drv.base, drv.size
                return 0

            @staticmethod
            def cuIpcGetMemHandle(ph, base):
                drv.ipc_calls += 1
                if drv.ipc_rc:
                    return drv.ipc_rc
                ctypes.memmove(ctypes.addressof(ph._obj), b"\xab\x00" + bytes(range(62)), 64)
                return 0

        self.lib = Lib()

    def err(self, rc):
        return f"CUresult {rc}"


def test_cuda_export_gives_the_allocation_handle_and_the_tensor_offset(monkeypatch):
    fake = _FakeDriver(1 << 20)
    monkeypatch.setattr(cuda_ipc, "_drv", lambda: fake)
    cache = {}
    a = cuda_ipc.export_pointer(fake.base + 4096, 0, cache)
    b = cuda_ipc.export_pointer(fake.base + 8192, 0, cache)
    assert a.handle == b.handle == b"\xab\x00" + bytes(range(62))
    assert (a.base_offset, b.base_offset, a.region_bytes) == (4096, 8192, 1 << 20)
    assert fake.ipc_calls == 1  # one handle per allocation


def test_cuda_export_refuses_virtual_memory_with_what_to_change(monkeypatch):
    fake = _FakeDriver(1 << 20, ipc_rc=1)
    monkeypatch.setattr(cuda_ipc, "_drv", lambda: fake)
    with pytest.raises(cuda_ipc.CudaIpcError, match="expandable_segments"):
        cuda_ipc.export_pointer(fake.base, 0)
    with pytest.raises(cuda_ipc.CudaIpcError, match="cuMemGetAddressRange"):
        cuda_ipc.export_pointer(0x10, 0)


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="a machine with a GPU driver")
def test_without_libcuda_the_export_says_so():
    cuda_ipc._driver = None
    with pytest.raises(cuda_ipc.CudaIpcError, match="libcuda"):
        cuda_ipc.export_pointer(0x1000, 0)


#: An engine process that ends on an unhandled exception without closing its KV regions (one
#: with a numpy view still alive); a child it forked, exiting normally first, must not take its
#: parent's files with it.
_ENDS_WITHOUT_CLOSING = r"""
import os, sys
import numpy as np
from pegaflow.regions import ShmRegion
plain = ShmRegion(4096)
held, kv = ShmRegion.holding(np.zeros(0, np.float16), (2, 4, 8))
if os.fork() == 0:
    sys.exit(0)
os.waitpid(-1, 0)
print(plain.name, held.name, os.path.exists("/dev/shm" + plain.name), os.path.exists("/dev/shm" + held.name), flush=True)
raise RuntimeError("the engine crashed")
"""


def test_regions_a_process_never_closed_are_unlinked_when_it_exits():
    assert_unlinked_at_exit(_ENDS_WITHOUT_CLOSING, "regions", timeout_s=120)
