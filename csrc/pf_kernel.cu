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

/*
 * Hopper variant: the bulk-copy engine of each SM (TMA) moves the bytes.
 * One thread per block streams table entries (each at most PF_TMA_CHUNK
 * bytes, 16-byte aligned, cut so by the host) through PF_TMA_STAGES shared
 * memory buffers: cp.async.bulk global->shared completes on an mbarrier,
 * cp.async.bulk shared->global writes it out. The SMs' warps stay free for
 * the model, and the bulk engine issues large requests over PCIe.
 */
#define PF_TMA_CHUNK 8192
#define PF_TMA_STAGES 4

extern "C" __global__ void __launch_bounds__(32)
pf_copy_entries_tma(const pf_kentry *__restrict__ table, unsigned int n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ __align__(128) unsigned char buf[PF_TMA_STAGES][PF_TMA_CHUNK];
  __shared__ __align__(8) unsigned long long bar[PF_TMA_STAGES];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < PF_TMA_STAGES; s++) {
    unsigned int b = (unsigned int)__cvta_generic_to_shared(&bar[s]);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b));
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const unsigned int cnt =
      n > blockIdx.x ? (n - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
#define PF_TMA_LOAD(k)                                                        \
  do {                                                                        \
    const pf_kentry e_ = table[blockIdx.x + (k) * gridDim.x];                 \
    const int s_ = (k) % PF_TMA_STAGES;                                       \
    unsigned int b_ = (unsigned int)__cvta_generic_to_shared(&bar[s_]);       \
    unsigned int d_ = (unsigned int)__cvta_generic_to_shared(&buf[s_][0]);    \
    unsigned int len_ = (unsigned int)e_.bytes;                               \
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"     \
                 ::"r"(b_), "r"(len_) : "memory");                            \
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx" \
                 "::bytes [%0], [%1], %2, [%3];"                              \
                 ::"r"(d_), "l"(e_.src), "r"(len_), "r"(b_) : "memory");      \
  } while (0)
  for (unsigned int k = 0; k < cnt && k < PF_TMA_STAGES; k++) PF_TMA_LOAD(k);
  for (unsigned int k = 0; k < cnt; k++) {
    const int s = k % PF_TMA_STAGES;
    unsigned int b = (unsigned int)__cvta_generic_to_shared(&bar[s]);
    unsigned int parity = (k / PF_TMA_STAGES) & 1;
    asm volatile(
        "{\n\t.reg .pred p;\n"
        "PF_WAIT_%=:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
        "@!p bra PF_WAIT_%=;\n}" ::"r"(b), "r"(parity) : "memory");
    const pf_kentry e = table[blockIdx.x + k * gridDim.x];
    unsigned int src = (unsigned int)__cvta_generic_to_shared(&buf[s][0]);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"(e.dst), "r"(src), "r"((unsigned int)e.bytes) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (k + PF_TMA_STAGES < cnt) {
      /* The buffer is reused only once the store has read it. */
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      PF_TMA_LOAD(k + PF_TMA_STAGES);
    }
  }
  /* The kernel ends only when every store has landed. */
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#undef PF_TMA_LOAD
#endif
}
