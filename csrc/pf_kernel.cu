/*
 * pf_kernel.cu — the gather/scatter copy kernel.
 *
 * One launch copies a table of (src, dst, bytes) entries, where one side is
 * device memory and the other is pinned host memory mapped into the device
 * address space (DEVICEMAP). Copying many 32 KB pieces this way reaches the
 * PCIe link rate where one DMA per piece cannot: the copy engines pay a
 * fixed cost per descriptor, SMs issue loads/stores back to back.
 *
 * Shape: a small grid of fat blocks. Each block walks the table with a
 * grid stride (entry i, i + gridDim.x, ...); its threads move one entry
 * with 16-byte vector accesses, PF_UNROLL loads in flight per thread before
 * the stores, so that a few blocks keep enough bytes in flight to cover
 * the link's latency (reads of host memory take microseconds). The grid is
 * chosen by the host code (pf_engine_set_kernel_grid) and kept small so
 * that the model keeps its SMs. The C side cuts entries to at most a few
 * hundred KB, so one long range still spreads over all blocks.
 *
 * Built by nvcc -fatbin (Makefile) and embedded into libpegaflow.so; loaded
 * at run time with cuModuleLoadData, so the library needs no CUDA runtime.
 */
#include <stdint.h>

#define PF_KERNEL_THREADS 512
#define PF_UNROLL 4

struct pf_kentry {
  unsigned long long src;
  unsigned long long dst;
  unsigned long long bytes;
};

extern "C" __global__ void __launch_bounds__(PF_KERNEL_THREADS)
pf_copy_entries(const pf_kentry *__restrict__ table, unsigned int n) {
  for (unsigned int i = blockIdx.x; i < n; i += gridDim.x) {
    const pf_kentry e = table[i];
    const unsigned long long bytes = e.bytes;
    if (((e.src | e.dst | bytes) & 15ull) == 0) {
      const uint4 *__restrict__ s = reinterpret_cast<const uint4 *>(e.src);
      uint4 *__restrict__ d = reinterpret_cast<uint4 *>(e.dst);
      const unsigned long long nv = bytes >> 4;
      unsigned long long j = threadIdx.x;
      const unsigned long long step = PF_KERNEL_THREADS;
      for (; j + (PF_UNROLL - 1) * step < nv; j += PF_UNROLL * step) {
        uint4 v[PF_UNROLL];
#pragma unroll
        for (int u = 0; u < PF_UNROLL; u++) v[u] = s[j + u * step];
#pragma unroll
        for (int u = 0; u < PF_UNROLL; u++) d[j + u * step] = v[u];
      }
      for (; j < nv; j += step) d[j] = s[j];
    } else if (((e.src | e.dst | bytes) & 3ull) == 0) {
      const unsigned int *__restrict__ s = reinterpret_cast<const unsigned int *>(e.src);
      unsigned int *__restrict__ d = reinterpret_cast<unsigned int *>(e.dst);
      const unsigned long long nw = bytes >> 2;
      for (unsigned long long j = threadIdx.x; j < nw; j += PF_KERNEL_THREADS) d[j] = s[j];
    } else {
      const unsigned char *__restrict__ s = reinterpret_cast<const unsigned char *>(e.src);
      unsigned char *__restrict__ d = reinterpret_cast<unsigned char *>(e.dst);
      for (unsigned long long j = threadIdx.x; j < bytes; j += PF_KERNEL_THREADS) d[j] = s[j];
    }
  }
}
