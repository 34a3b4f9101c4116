/*
 * pf_cuda.c — the CUDA backend, on the driver API loaded with dlopen.
 *
 * No link-time CUDA dependency: libcuda.so.1 is opened at run time and every
 * entry point is resolved by its versioned name (the *_v2 ABI where one
 * exists). A machine without a driver or a GPU gets PF_ENODEV and AUTO
 * falls back to the host backend.
 *
 * Per engine: the device's primary context, one non-blocking copy stream,
 * the embedded copy kernel (pf_kernel.cu, loaded with cuModuleLoadData), a
 * pinned + device "table arena" for the kernel's segment tables, and one
 * completion thread. A submit enqueues the whole batch on the stream and
 * records one event per layer group; the completion thread waits for the
 * events in order and posts LAYER records and progress words, then the
 * BATCH record. Batches on one engine complete in submit order (one stream).
 *
 * Copy paths (chosen per batch by the caller; AUTO = kernel if loaded):
 *  - KERNEL: merged ranges are cut into table entries, the table goes to
 *    the device with one async H2D copy, one launch per group.
 *  - DMA_BATCH: one cuMemcpyBatchAsync per group (driver 12.8+).
 *  - DMA: one cuMemcpyAsync per merged range.
 */
#define _GNU_SOURCE
#include "pf_internal.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the slice of the driver API we use (our own declarations) --------- */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
  int srcAccessOrder;
  CUmemLocation srcLocHint;
  CUmemLocation dstLocHint;
  unsigned int flags;
} CUmemcpyAttributes;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_NO_DEVICE = 100,
  CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
  CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY = 19,
  CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
  CU_MEMHOSTREGISTER_PORTABLE = 0x1,
  CU_MEMHOSTREGISTER_DEVICEMAP = 0x2,
  CU_MEMHOSTALLOC_PORTABLE = 0x1,
  CU_MEMHOSTALLOC_DEVICEMAP = 0x2,
  CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1,
  CU_STREAM_NON_BLOCKING = 0x1,
  CU_EVENT_DEFAULT = 0x0,
  CU_EVENT_DISABLE_TIMING = 0x2,
  CU_MEM_LOCATION_TYPE_DEVICE = 1,
  CU_MEM_LOCATION_TYPE_HOST = 2,
  CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1,
};

#define CU_FN(X)                                                               \
  X(cuInit, CUresult (*)(unsigned))                                            \
  X(cuGetErrorName, CUresult (*)(CUresult, const char **))                     \
  X(cuGetErrorString, CUresult (*)(CUresult, const char **))                   \
  X(cuDeviceGetCount, CUresult (*)(int *))                                     \
  X(cuDeviceGet, CUresult (*)(CUdevice *, int))                                \
  X(cuDeviceGetAttribute, CUresult (*)(int *, int, CUdevice))                  \
  X(cuDeviceTotalMem_v2, CUresult (*)(size_t *, CUdevice))                     \
  X(cuDevicePrimaryCtxRetain, CUresult (*)(CUcontext *, CUdevice))             \
  X(cuDevicePrimaryCtxRelease_v2, CUresult (*)(CUdevice))                      \
  X(cuCtxSetCurrent, CUresult (*)(CUcontext))                                  \
  X(cuStreamCreate, CUresult (*)(CUstream *, unsigned))                        \
  X(cuStreamDestroy_v2, CUresult (*)(CUstream))                                \
  X(cuStreamSynchronize, CUresult (*)(CUstream))                               \
  X(cuStreamWaitEvent, CUresult (*)(CUstream, CUevent, unsigned))              \
  X(cuEventCreate, CUresult (*)(CUevent *, unsigned))                          \
  X(cuEventRecord, CUresult (*)(CUevent, CUstream))                            \
  X(cuEventSynchronize, CUresult (*)(CUevent))                                 \
  X(cuEventElapsedTime, CUresult (*)(float *, CUevent, CUevent))               \
  X(cuEventDestroy_v2, CUresult (*)(CUevent))                                  \
  X(cuMemAlloc_v2, CUresult (*)(CUdeviceptr *, size_t))                        \
  X(cuMemFree_v2, CUresult (*)(CUdeviceptr))                                   \
  X(cuMemHostAlloc, CUresult (*)(void **, size_t, unsigned))                   \
  X(cuMemFreeHost, CUresult (*)(void *))                                       \
  X(cuMemHostRegister_v2, CUresult (*)(void *, size_t, unsigned))              \
  X(cuMemHostUnregister, CUresult (*)(void *))                                 \
  X(cuMemHostGetDevicePointer_v2, CUresult (*)(CUdeviceptr *, void *, unsigned)) \
  X(cuMemGetAddressRange_v2, CUresult (*)(CUdeviceptr *, size_t *, CUdeviceptr)) \
  X(cuMemcpyAsync, CUresult (*)(CUdeviceptr, CUdeviceptr, size_t, CUstream))   \
  X(cuMemcpyHtoDAsync_v2, CUresult (*)(CUdeviceptr, const void *, size_t, CUstream)) \
  X(cuMemcpyHtoD_v2, CUresult (*)(CUdeviceptr, const void *, size_t))          \
  X(cuMemcpyDtoH_v2, CUresult (*)(void *, CUdeviceptr, size_t))                \
  X(cuMemsetD8_v2, CUresult (*)(CUdeviceptr, unsigned char, size_t))           \
  X(cuIpcGetMemHandle, CUresult (*)(CUipcMemHandle *, CUdeviceptr))            \
  X(cuIpcOpenMemHandle_v2, CUresult (*)(CUdeviceptr *, CUipcMemHandle, unsigned)) \
  X(cuIpcCloseMemHandle, CUresult (*)(CUdeviceptr))                            \
  X(cuModuleLoadData, CUresult (*)(CUmodule *, const void *))                  \
  X(cuModuleUnload, CUresult (*)(CUmodule))                                    \
  X(cuModuleGetFunction, CUresult (*)(CUfunction *, CUmodule, const char *))   \
  X(cuLaunchKernel, CUresult (*)(CUfunction, unsigned, unsigned, unsigned,     \
                                 unsigned, unsigned, unsigned, unsigned,       \
                                 CUstream, void **, void **))

static struct {
#define X(name, type) __typeof__(type) name;
  CU_FN(X)
#undef X
  /* CUDA 13 ABI (no failIdx) and the 12.8 one; at most one is used. */
  CUresult (*batch_v2)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t,
                       CUmemcpyAttributes *, size_t *, size_t, CUstream);
  CUresult (*batch_v1)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t,
                       CUmemcpyAttributes *, size_t *, size_t, size_t *,
                       CUstream);
  void *lib;
  int32_t load_rc;
  char load_msg[400];
} cu;

static pthread_once_t cu_once = PTHREAD_ONCE_INIT;

static const char *const libcuda_paths[] = {
    "libcuda.so.1",
    "/usr/local/nvidia/lib64/libcuda.so.1",
    "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
    "/usr/lib64/libcuda.so.1",
    "/usr/lib/wsl/lib/libcuda.so.1",
};

static void cu_load(void) {
  const char *env = getenv("PEGAFLOW_LIBCUDA");
  char tried[256] = "";
  if (env && *env) {
    cu.lib = dlopen(env, RTLD_NOW | RTLD_LOCAL);
    snprintf(tried, sizeof tried, "%s", env);
  }
  for (size_t i = 0; !cu.lib && i < sizeof libcuda_paths / sizeof *libcuda_paths; i++)
    cu.lib = dlopen(libcuda_paths[i], RTLD_NOW | RTLD_LOCAL);
  if (!cu.lib) {
    cu.load_rc = PF_ENODEV;
    snprintf(cu.load_msg, sizeof cu.load_msg,
             "libcuda.so.1 not found (%s%s; set PEGAFLOW_LIBCUDA to its path)",
             tried[0] ? "tried $PEGAFLOW_LIBCUDA=" : "no NVIDIA driver",
             tried);
    return;
  }
#define X(name, type)                                                          \
  cu.name = (type)dlsym(cu.lib, #name);                                        \
  if (!cu.name) {                                                              \
    cu.load_rc = PF_ENODEV;                                                    \
    snprintf(cu.load_msg, sizeof cu.load_msg,                                  \
             "libcuda.so.1 lacks %s (driver too old)", #name);                 \
    return;                                                                    \
  }
  CU_FN(X)
#undef X
  cu.batch_v2 = dlsym(cu.lib, "cuMemcpyBatchAsync_v2");
  if (!cu.batch_v2) cu.batch_v1 = dlsym(cu.lib, "cuMemcpyBatchAsync");
  CUresult r = cu.cuInit(0);
  if (r != CUDA_SUCCESS) {
    const char *n = "?";
    cu.cuGetErrorName(r, &n);
    cu.load_rc = PF_ENODEV;
    snprintf(cu.load_msg, sizeof cu.load_msg, "cuInit failed: %s (%d)%s", n,
             r, r == CUDA_ERROR_NO_DEVICE ? ": no CUDA device" : "");
    return;
  }
  cu.load_rc = PF_OK;
}

/* Records a failed driver call as PF_ECUDA with its name and message. */
static int32_t cu_fail(CUresult r, const char *fn, const char *call) {
  const char *n = "?", *s = "?";
  if (cu.cuGetErrorName) cu.cuGetErrorName(r, &n);
  if (cu.cuGetErrorString) cu.cuGetErrorString(r, &s);
  return pf_fail(PF_ECUDA, "%s: %s failed: %s (%d): %s", fn, call, n, r, s);
}

#define CU_TRY(fn, expr)                                                       \
  do {                                                                         \
    CUresult r_ = (expr);                                                      \
    if (r_ != CUDA_SUCCESS) return cu_fail(r_, fn, #expr);                     \
  } while (0)

/* ---- engine state ------------------------------------------------------ */
/* Kernel table arena: 24-byte entries; 64 MiB holds ~2.8 M entries, i.e.
 * batches of ~170 GB at the entry cap below. */
#define PF_ARENA_BYTES (64ull << 20)
/* Entries are cut to this size so one long range spreads over the grid. */
#define PF_KERNEL_ENTRY_MAX (256ull << 10)
#define PF_KERNEL_THREADS 512u
/* Default grid (blocks of 512 threads) for the kernel path: measured on an
 * H100 (docs/native.md) to reach the PCIe link rate in both directions with
 * a small fraction of the SMs; pf_engine_set_kernel_grid overrides. */
#define PF_KERNEL_GRID_DEFAULT 32u
/* cuMemcpyBatchAsync calls are cut to this many copies each. */
#define PF_DMA_BATCH_MAX 8192u
#define PF_EVENT_CACHE 256u
/* Copy engines' share (permille of bytes) of a mixed batch: the copy
 * engines reach ~70 % of the link with 32 KB copies alone (descriptor
 * rate), the SMs ~93 %; measured best split in docs/native.md. */
#define PF_MIXED_DMA_SHARE_DEFAULT 600u
/* Which kernel variant runs when PEGAFLOW_KERNEL is unset. */
#define PF_KERNEL_DEFAULT_VARIANT PF_KERNEL_SIMT

enum { PF_KERNEL_SIMT = 0, PF_KERNEL_TMA = 1 };
/* Entry size of the bulk-copy variant (its shared-memory stage size). */
#define PF_TMA_CHUNK 8192ull
#define PF_TMA_THREADS 32u

typedef struct pf_kentry {
  uint64_t src, dst, bytes;
} pf_kentry;

typedef struct cuda_engine {
  CUdevice dev;
  CUcontext ctx;
  CUstream stream;
  CUstream stream2;    /* copy-engine half of the mixed path */
  CUmodule mod;
  CUfunction fn_copy;
  CUfunction fn_tma;   /* Hopper bulk-copy variant (NULL before sm_90) */
  int variant;         /* PF_KERNEL_SIMT or PF_KERNEL_TMA */
  /* table arena: pinned host staging + device copy, FIFO ring of spans */
  uint8_t *arena_host;
  CUdeviceptr arena_dev;
  uint64_t arena_head, arena_tail; /* virtual offsets, under mu */
  pthread_mutex_t submit_mu;       /* one submit at a time on the stream */
  pthread_mutex_t mu;
  pthread_cond_t cv;               /* queue non-empty / arena freed */
  pf_batch *head, *tail;           /* batches awaiting completion */
  int stop;
  pthread_t th;
  CUevent events[PF_EVENT_CACHE];
  uint32_t nevents;
} cuda_engine;

typedef struct cuda_batch {
  CUevent *ev; /* one per group */
  uint32_t path;
  uint64_t arena_end; /* virtual end of this batch's table span (0: none) */
} cuda_batch;

#if PF_HAVE_FATBIN
extern const uint8_t _binary_pf_kernel_fatbin_start[];
extern const uint8_t _binary_pf_kernel_fatbin_end[];
#endif

static int32_t set_ctx(cuda_engine *ce, const char *fn) {
  CU_TRY(fn, cu.cuCtxSetCurrent(ce->ctx));
  return PF_OK;
}

static CUevent event_get(cuda_engine *ce) {
  CUevent ev = NULL;
  pthread_mutex_lock(&ce->mu);
  if (ce->nevents) ev = ce->events[--ce->nevents];
  pthread_mutex_unlock(&ce->mu);
  if (!ev && cu.cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS)
    return NULL;
  return ev;
}

static void event_put(cuda_engine *ce, CUevent ev) {
  if (!ev) return;
  pthread_mutex_lock(&ce->mu);
  if (ce->nevents < PF_EVENT_CACHE) {
    ce->events[ce->nevents++] = ev;
    ev = NULL;
  }
  pthread_mutex_unlock(&ce->mu);
  if (ev) cu.cuEventDestroy_v2(ev);
}

static void cuda_batch_release(cuda_engine *ce, pf_batch *b) {
  cuda_batch *cb = b->impl;
  if (!cb) return;
  if (cb->ev) {
    uint32_t n = cb->path == PF_PATH_MIXED ? 2 * b->num_groups : b->num_groups;
    for (uint32_t g = 0; g < n; g++) event_put(ce, cb->ev[g]);
  }
  if (cb->arena_end) {
    pthread_mutex_lock(&ce->mu);
    /* Batches finish in order, so their spans free in order; a batch that
     * failed at submit (after a stream sync) must not move the tail back. */
    if (cb->arena_end > ce->arena_tail) ce->arena_tail = cb->arena_end;
    pthread_cond_broadcast(&ce->cv);
    pthread_mutex_unlock(&ce->mu);
  }
  free(cb->ev);
  free(cb);
  b->impl = NULL;
}

static void *completion_main(void *arg) {
  pf_engine *e = arg;
  cuda_engine *ce = e->impl;
  cu.cuCtxSetCurrent(ce->ctx);
  for (;;) {
    pthread_mutex_lock(&ce->mu);
    while (!ce->stop && !ce->head) pthread_cond_wait(&ce->cv, &ce->mu);
    if (!ce->head) {
      pthread_mutex_unlock(&ce->mu);
      return NULL;
    }
    pf_batch *b = ce->head;
    ce->head = b->next;
    if (!ce->head) ce->tail = NULL;
    pthread_mutex_unlock(&ce->mu);
    cuda_batch *cb = b->impl;
    int32_t status = PF_OK;
    for (uint32_t g = 0; g < b->num_groups; g++) {
      CUresult r = cu.cuEventSynchronize(cb->ev[g]);
      if (r != CUDA_SUCCESS && status == PF_OK)
        status = cu_fail(r, "pf_copy_submit(completion)", "cuEventSynchronize");
      pf_batch_group_done(b, g, status);
    }
    uint32_t path = cb->path;
    cuda_batch_release(ce, b);
    pf_batch_done(b, status, path);
  }
}

static void cuda_close(pf_engine *e);

static int32_t cuda_open(pf_engine *e, int32_t device, uint32_t workers) {
  pthread_once(&cu_once, cu_load);
  if (cu.load_rc < 0)
    return pf_fail(cu.load_rc, "pf_engine_open(cuda): %s", cu.load_msg);
  int count = 0;
  CU_TRY("pf_engine_open(cuda)", cu.cuDeviceGetCount(&count));
  if (count == 0)
    return pf_fail(PF_ENODEV, "pf_engine_open(cuda): no CUDA device");
  if (device >= count)
    return pf_fail(PF_ENODEV, "pf_engine_open(cuda): device %d; this machine "
                   "has %d (0..%d)", device, count, count - 1);
  cuda_engine *ce = calloc(1, sizeof *ce);
  if (!ce) return pf_fail(PF_ENOMEM, "pf_engine_open(cuda): out of memory");
  pthread_mutex_init(&ce->mu, NULL);
  pthread_mutex_init(&ce->submit_mu, NULL);
  pthread_cond_init(&ce->cv, NULL);
  e->impl = ce;
  int32_t rc = PF_OK;
  CUresult r;
#define OPEN_TRY(expr)                                                         \
  if ((r = (expr)) != CUDA_SUCCESS) {                                          \
    rc = cu_fail(r, "pf_engine_open(cuda)", #expr);                            \
    goto fail;                                                                 \
  }
  OPEN_TRY(cu.cuDeviceGet(&ce->dev, device));
  int sms = 0, map = 0, uva = 0;
  OPEN_TRY(cu.cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, ce->dev));
  OPEN_TRY(cu.cuDeviceGetAttribute(&map, CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY, ce->dev));
  OPEN_TRY(cu.cuDeviceGetAttribute(&uva, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, ce->dev));
  if (!map || !uva) {
    rc = pf_fail(PF_ENODEV, "pf_engine_open(cuda): device %d cannot map host "
                 "memory (%d) or lacks unified addressing (%d)", device, map, uva);
    goto fail;
  }
  size_t total = 0;
  OPEN_TRY(cu.cuDeviceTotalMem_v2(&total, ce->dev));
  OPEN_TRY(cu.cuDevicePrimaryCtxRetain(&ce->ctx, ce->dev));
  OPEN_TRY(cu.cuCtxSetCurrent(ce->ctx));
  OPEN_TRY(cu.cuStreamCreate(&ce->stream, CU_STREAM_NON_BLOCKING));
  OPEN_TRY(cu.cuStreamCreate(&ce->stream2, CU_STREAM_NON_BLOCKING));
  void *ah = NULL;
  OPEN_TRY(cu.cuMemHostAlloc(&ah, PF_ARENA_BYTES, CU_MEMHOSTALLOC_PORTABLE));
  ce->arena_host = ah;
  OPEN_TRY(cu.cuMemAlloc_v2(&ce->arena_dev, PF_ARENA_BYTES));
  e->features = PF_FEAT_IPC;
#if PF_HAVE_FATBIN
  if (cu.cuModuleLoadData(&ce->mod, _binary_pf_kernel_fatbin_start) ==
          CUDA_SUCCESS &&
      cu.cuModuleGetFunction(&ce->fn_copy, ce->mod, "pf_copy_entries") ==
          CUDA_SUCCESS)
    e->features |= PF_FEAT_KERNEL;
  int major = 0;
  OPEN_TRY(cu.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, ce->dev));
  if (ce->mod && major >= 9 &&
      cu.cuModuleGetFunction(&ce->fn_tma, ce->mod, "pf_copy_entries_tma") !=
          CUDA_SUCCESS)
    ce->fn_tma = NULL;
#endif
  /* PEGAFLOW_KERNEL=simt|tma picks the kernel variant (benchmarks compare
   * them); the default is the one measured faster (docs/native.md). */
  const char *var = getenv("PEGAFLOW_KERNEL");
  ce->variant = PF_KERNEL_DEFAULT_VARIANT;
  if (var && strcmp(var, "simt") == 0) ce->variant = PF_KERNEL_SIMT;
  if (var && strcmp(var, "tma") == 0) ce->variant = PF_KERNEL_TMA;
  if (!ce->fn_tma) ce->variant = PF_KERNEL_SIMT;
  e->kernel_variant = (uint32_t)ce->variant;
  if (cu.batch_v2 || cu.batch_v1) e->features |= PF_FEAT_DMA_BATCH;
  e->sm_count = (uint32_t)sms;
  e->default_grid = PF_KERNEL_GRID_DEFAULT < (uint32_t)sms
                        ? PF_KERNEL_GRID_DEFAULT : (uint32_t)sms;
  e->device_mem_mib = total >> 20;
  e->default_dma_share = PF_MIXED_DMA_SHARE_DEFAULT;
  if (pthread_create(&ce->th, NULL, completion_main, e) != 0) {
    rc = pf_fail(PF_ENOMEM, "pf_engine_open(cuda): completion thread: %s",
                 strerror(errno));
    goto fail;
  }
  return PF_OK;
fail:
  ce->th = 0;
  cuda_close(e);
  return rc;
#undef OPEN_TRY
}

static void cuda_close(pf_engine *e) {
  cuda_engine *ce = e->impl;
  if (!ce) return;
  if (ce->th) {
    pthread_mutex_lock(&ce->mu);
    ce->stop = 1;
    pthread_cond_broadcast(&ce->cv);
    pthread_mutex_unlock(&ce->mu);
    pthread_join(ce->th, NULL);
  }
  if (ce->ctx) cu.cuCtxSetCurrent(ce->ctx);
  if (ce->stream) cu.cuStreamSynchronize(ce->stream);
  if (ce->stream2) cu.cuStreamSynchronize(ce->stream2);
  for (uint32_t i = 0; i < ce->nevents; i++) cu.cuEventDestroy_v2(ce->events[i]);
  if (ce->mod) cu.cuModuleUnload(ce->mod);
  if (ce->arena_dev) cu.cuMemFree_v2(ce->arena_dev);
  if (ce->arena_host) cu.cuMemFreeHost(ce->arena_host);
  if (ce->stream) cu.cuStreamDestroy_v2(ce->stream);
  if (ce->stream2) cu.cuStreamDestroy_v2(ce->stream2);
  if (ce->ctx) cu.cuDevicePrimaryCtxRelease_v2(ce->dev);
  pthread_cond_destroy(&ce->cv);
  pthread_mutex_destroy(&ce->mu);
  pthread_mutex_destroy(&ce->submit_mu);
  free(ce);
  e->impl = NULL;
}

/* ---- pool -------------------------------------------------------------- */
static int32_t cuda_pool_alloc(pf_engine *e, pf_pool *p) {
  cuda_engine *ce = e->impl;
  int32_t rc = set_ctx(ce, "pf_pool_create");
  if (rc < 0) return rc;
  rc = pf_hostmem_alloc(p, "pf_pool_create");
  if (rc < 0) return rc;
  uint64_t t0 = pf_now_ns();
  CUresult r = cu.cuMemHostRegister_v2(
      p->host, p->mapped_bytes,
      CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP);
  if (r != CUDA_SUCCESS) {
    pf_hostmem_free(p);
    return cu_fail(r, "pf_pool_create", "cuMemHostRegister(PORTABLE|DEVICEMAP)");
  }
  CUdeviceptr d = 0;
  r = cu.cuMemHostGetDevicePointer_v2(&d, p->host, 0);
  if (r != CUDA_SUCCESS) {
    cu.cuMemHostUnregister(p->host);
    pf_hostmem_free(p);
    return cu_fail(r, "pf_pool_create", "cuMemHostGetDevicePointer");
  }
  p->device_ptr = d;
  p->applied |= PF_POOL_LOCKED;
  p->alloc_ns += pf_now_ns() - t0;
  return PF_OK;
}

static void cuda_pool_free(pf_engine *e, pf_pool *p) {
  set_ctx(e->impl, "pf_pool_destroy");
  cu.cuMemHostUnregister(p->host);
  pf_hostmem_free(p);
}

/* ---- regions ----------------------------------------------------------- */
static int32_t cuda_region_alloc(pf_engine *e, pf_region *r, uint8_t *out) {
  cuda_engine *ce = e->impl;
  int32_t rc = set_ctx(ce, "pf_region_alloc");
  if (rc < 0) return rc;
  CUdeviceptr d = 0;
  CU_TRY("pf_region_alloc", cu.cuMemAlloc_v2(&d, r->bytes));
  CUipcMemHandle h;
  CUresult res = cu.cuIpcGetMemHandle(&h, d);
  if (res != CUDA_SUCCESS) {
    cu.cuMemFree_v2(d);
    return cu_fail(res, "pf_region_alloc", "cuIpcGetMemHandle");
  }
  memcpy(out, &h, PF_HANDLE_BYTES);
  r->addr = d;
  return PF_OK;
}

static int32_t cuda_region_import(pf_engine *e, pf_region *r,
                                  const uint8_t *handle) {
  cuda_engine *ce = e->impl;
  int32_t rc = set_ctx(ce, "pf_region_import");
  if (rc < 0) return rc;
  CUipcMemHandle h;
  memcpy(&h, handle, PF_HANDLE_BYTES);
  CUdeviceptr d = 0;
  CUresult res = cu.cuIpcOpenMemHandle_v2(&d, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  if (res != CUDA_SUCCESS) {
    cu_fail(res, "pf_region_import", "cuIpcOpenMemHandle");
    /* A stale or forged handle is the caller's error, not the driver's. */
    return PF_EHANDLE;
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  res = cu.cuMemGetAddressRange_v2(&base, &size, d);
  if (res != CUDA_SUCCESS) {
    cu.cuIpcCloseMemHandle(d);
    return cu_fail(res, "pf_region_import", "cuMemGetAddressRange");
  }
  uint64_t avail = (uint64_t)(base + size - d);
  if (avail < r->bytes) {
    cu.cuIpcCloseMemHandle(d);
    return pf_fail(PF_ERANGE, "pf_region_import: declared %llu bytes; the "
                   "allocation has %llu", (unsigned long long)r->bytes,
                   (unsigned long long)avail);
  }
  r->addr = d;
  return PF_OK;
}

static void cuda_region_close(pf_engine *e, pf_region *r) {
  set_ctx(e->impl, "pf_region_close");
  if (r->imported)
    cu.cuIpcCloseMemHandle(r->addr);
  else
    cu.cuMemFree_v2(r->addr);
}

static int32_t cuda_region_rw(pf_engine *e, pf_region *r, uint64_t off,
                              void *buf, uint64_t bytes, int write) {
  int32_t rc = set_ctx(e->impl, write ? "pf_region_write" : "pf_region_read");
  if (rc < 0) return rc;
  if (write)
    CU_TRY("pf_region_write", cu.cuMemcpyHtoD_v2(r->addr + off, buf, bytes));
  else
    CU_TRY("pf_region_read", cu.cuMemcpyDtoH_v2(buf, r->addr + off, bytes));
  return PF_OK;
}

/* ---- submit ------------------------------------------------------------ */
/* Reserves `bytes` of the table arena (waits for older batches to free
 * theirs); returns the physical offset and the span's virtual end. */
static int32_t arena_reserve(cuda_engine *ce, uint64_t bytes, uint64_t *off,
                             uint64_t *vend) {
  if (bytes > PF_ARENA_BYTES)
    return pf_fail(PF_EINVAL, "pf_copy_submit: the kernel table needs %llu "
                   "bytes; the arena holds %llu (split the batch)",
                   (unsigned long long)bytes,
                   (unsigned long long)PF_ARENA_BYTES);
  pthread_mutex_lock(&ce->mu);
  uint64_t start = ce->arena_head;
  if (start % PF_ARENA_BYTES + bytes > PF_ARENA_BYTES)
    start = (start / PF_ARENA_BYTES + 1) * PF_ARENA_BYTES; /* wrap */
  while (start + bytes - ce->arena_tail > PF_ARENA_BYTES)
    pthread_cond_wait(&ce->cv, &ce->mu);
  ce->arena_head = start + bytes;
  pthread_mutex_unlock(&ce->mu);
  *off = start % PF_ARENA_BYTES;
  *vend = start + bytes;
  return PF_OK;
}

/*
 * The enqueue functions take, per group g, the subset [lo[g], hi[g]) of
 * b->ranges to move (the mixed path splits each group in two), the stream,
 * and the events to record after each group. For the kernel part, wait[g]
 * (if set) is an event of the other stream that the group's event must
 * also cover.
 */
static int32_t enqueue_kernel(pf_engine *e, cuda_engine *ce, pf_batch *b,
                              cuda_batch *cb, const uint32_t *lo,
                              const uint32_t *hi, CUevent *wait) {
  uint64_t pool_dev = b->pool->device_ptr;
  /* The bulk-copy variant needs 16-byte alignment of every address/size. */
  int tma = ce->variant == PF_KERNEL_TMA && ce->fn_tma;
  for (uint32_t i = 0; tma && i < b->num_ranges; i++)
    if ((b->ranges[i].region_addr | (pool_dev + b->ranges[i].pool_off) |
         b->ranges[i].bytes) & 15u)
      tma = 0;
  const uint64_t cut = tma ? PF_TMA_CHUNK : PF_KERNEL_ENTRY_MAX;
  uint64_t n = 0;
  for (uint32_t g = 0; g < b->num_groups; g++)
    for (uint32_t i = lo[g]; i < hi[g]; i++)
      n += (b->ranges[i].bytes + cut - 1) / cut;
  uint64_t off = 0, vend = 0;
  if (n) {
    int32_t rc = arena_reserve(ce, n * sizeof(pf_kentry), &off, &vend);
    if (rc < 0) return rc;
    cb->arena_end = vend;
  }
  pf_kentry *tab = (pf_kentry *)(ce->arena_host + off);
  uint32_t *first = malloc(((size_t)b->num_groups + 1) * sizeof *first);
  if (!first) return pf_fail(PF_ENOMEM, "pf_copy_submit: out of memory");
  uint64_t k = 0;
  for (uint32_t g = 0; g < b->num_groups; g++) {
    first[g] = (uint32_t)k;
    for (uint32_t i = lo[g]; i < hi[g]; i++) {
      const pf_range *r = &b->ranges[i];
      for (uint64_t o = 0; o < r->bytes; o += cut) {
        uint64_t len = r->bytes - o < cut ? r->bytes - o : cut;
        uint64_t dev = r->region_addr + o, host = pool_dev + r->pool_off + o;
        tab[k].src = b->direction == PF_D2H ? dev : host;
        tab[k].dst = b->direction == PF_D2H ? host : dev;
        tab[k].bytes = len;
        k++;
      }
    }
  }
  first[b->num_groups] = (uint32_t)k;
  CUresult r = CUDA_SUCCESS;
  if (k)
    r = cu.cuMemcpyHtoDAsync_v2(ce->arena_dev + off, tab,
                                k * sizeof(pf_kentry), ce->stream);
  if (r != CUDA_SUCCESS) {
    free(first);
    return cu_fail(r, "pf_copy_submit", "cuMemcpyHtoDAsync(kernel table)");
  }
  uint32_t grid = e->grid_blocks ? e->grid_blocks : e->default_grid;
  const char *call = "cuLaunchKernel(pf_copy_entries)";
  for (uint32_t g = 0; g < b->num_groups && r == CUDA_SUCCESS; g++) {
    CUdeviceptr t = ce->arena_dev + off + (uint64_t)first[g] * sizeof(pf_kentry);
    unsigned int cnt = first[g + 1] - first[g];
    unsigned int blocks = cnt < grid ? cnt : grid;
    void *args[] = {&t, &cnt};
    if (cnt)
      r = cu.cuLaunchKernel(tma ? ce->fn_tma : ce->fn_copy, blocks, 1, 1,
                            tma ? PF_TMA_THREADS : PF_KERNEL_THREADS, 1, 1, 0,
                            ce->stream, args, NULL);
    if (r == CUDA_SUCCESS && wait && wait[g]) {
      call = "cuStreamWaitEvent";
      r = cu.cuStreamWaitEvent(ce->stream, wait[g], 0);
    }
    if (r == CUDA_SUCCESS) {
      call = "cuEventRecord";
      r = cu.cuEventRecord(cb->ev[g], ce->stream);
    }
  }
  free(first);
  if (r != CUDA_SUCCESS) return cu_fail(r, "pf_copy_submit", call);
  return PF_OK;
}

static int32_t enqueue_dma(cuda_engine *ce, pf_batch *b, CUstream st,
                           const uint32_t *lo, const uint32_t *hi, CUevent *ev) {
  uint64_t pool_dev = b->pool->device_ptr;
  for (uint32_t g = 0; g < b->num_groups; g++) {
    for (uint32_t i = lo[g]; i < hi[g]; i++) {
      const pf_range *r = &b->ranges[i];
      CUdeviceptr dev = r->region_addr, host = pool_dev + r->pool_off;
      CUresult res = b->direction == PF_D2H
                         ? cu.cuMemcpyAsync(host, dev, r->bytes, st)
                         : cu.cuMemcpyAsync(dev, host, r->bytes, st);
      if (res != CUDA_SUCCESS)
        return cu_fail(res, "pf_copy_submit", "cuMemcpyAsync");
    }
    if (ev[g]) CU_TRY("pf_copy_submit", cu.cuEventRecord(ev[g], st));
  }
  return PF_OK;
}

static int32_t enqueue_dma_batch(cuda_engine *ce, pf_batch *b, CUstream st,
                                 const uint32_t *lo, const uint32_t *hi,
                                 CUevent *ev) {
  uint32_t maxn = 1;
  for (uint32_t g = 0; g < b->num_groups; g++)
    if (hi[g] - lo[g] > maxn) maxn = hi[g] - lo[g];
  if (maxn > PF_DMA_BATCH_MAX) maxn = PF_DMA_BATCH_MAX;
  CUdeviceptr *dst = malloc((size_t)maxn * sizeof *dst);
  CUdeviceptr *src = malloc((size_t)maxn * sizeof *src);
  size_t *len = malloc((size_t)maxn * sizeof *len);
  if (!dst || !src || !len) {
    free(dst), free(src), free(len);
    return pf_fail(PF_ENOMEM, "pf_copy_submit: out of memory");
  }
  CUmemcpyAttributes attr;
  memset(&attr, 0, sizeof attr);
  attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
  CUmemLocation devloc = {CU_MEM_LOCATION_TYPE_DEVICE, (int)ce->dev};
  CUmemLocation hostloc = {CU_MEM_LOCATION_TYPE_HOST, 0};
  attr.srcLocHint = b->direction == PF_D2H ? devloc : hostloc;
  attr.dstLocHint = b->direction == PF_D2H ? hostloc : devloc;
  size_t attr_idx = 0;
  uint64_t pool_dev = b->pool->device_ptr;
  int32_t rc = PF_OK;
  for (uint32_t g = 0; g < b->num_groups && rc == PF_OK; g++) {
    uint32_t i = lo[g], end = hi[g];
    while (i < end && rc == PF_OK) {
      uint32_t n = 0;
      for (; i < end && n < maxn; i++, n++) {
        const pf_range *r = &b->ranges[i];
        CUdeviceptr dev = r->region_addr, host = pool_dev + r->pool_off;
        dst[n] = b->direction == PF_D2H ? host : dev;
        src[n] = b->direction == PF_D2H ? dev : host;
        len[n] = r->bytes;
      }
      CUresult res;
      if (cu.batch_v2) {
        res = cu.batch_v2(dst, src, len, n, &attr, &attr_idx, 1, st);
      } else {
        size_t fail_idx = 0;
        res = cu.batch_v1(dst, src, len, n, &attr, &attr_idx, 1, &fail_idx, st);
      }
      if (res != CUDA_SUCCESS)
        rc = cu_fail(res, "pf_copy_submit", "cuMemcpyBatchAsync");
    }
    if (rc == PF_OK && ev[g]) {
      CUresult res = cu.cuEventRecord(ev[g], st);
      if (res != CUDA_SUCCESS) rc = cu_fail(res, "pf_copy_submit", "cuEventRecord");
    }
  }
  free(dst), free(src), free(len);
  return rc;
}

static const char *const path_name[] = {"auto", "kernel", "dma_batch", "dma",
                                        "mixed"};

/* Splits each group by bytes: [lo, mid) to the copy engines (about
 * `permille` of the group's bytes), [mid, hi) to the kernel. */
static void split_mixed(const pf_batch *b, uint32_t permille, uint32_t *lo,
                        uint32_t *mid, uint32_t *hi) {
  for (uint32_t g = 0; g < b->num_groups; g++) {
    const pf_group_rt *gr = &b->groups[g];
    lo[g] = gr->first_range;
    hi[g] = gr->first_range + gr->num_ranges;
    uint64_t want = gr->bytes / 1000 * permille + gr->bytes % 1000 * permille / 1000;
    uint64_t acc = 0;
    uint32_t i = lo[g];
    while (i < hi[g] && acc + b->ranges[i].bytes / 2 < want) acc += b->ranges[i++].bytes;
    mid[g] = i;
  }
}

static int32_t cuda_submit(pf_engine *e, pf_batch *b) {
  cuda_engine *ce = e->impl;
  uint32_t path = b->path;
  if (path == PF_PATH_AUTO)
    path = (e->features & PF_FEAT_KERNEL) ? PF_PATH_KERNEL : PF_PATH_DMA;
  if ((path == PF_PATH_KERNEL || path == PF_PATH_MIXED) &&
      !(e->features & PF_FEAT_KERNEL))
    return pf_fail(PF_EUNSUPPORTED, "pf_copy_submit: path %s: the copy "
                   "kernel is not loaded in this build (no nvcc at build time)",
                   path_name[path]);
  if (path == PF_PATH_DMA_BATCH && !(e->features & PF_FEAT_DMA_BATCH))
    return pf_fail(PF_EUNSUPPORTED, "pf_copy_submit: path dma_batch: this "
                   "driver has no cuMemcpyBatchAsync (needs CUDA 12.8+)");
  cuda_batch *cb = calloc(1, sizeof *cb);
  if (!cb) return pf_fail(PF_ENOMEM, "pf_copy_submit: out of memory");
  cb->path = path;
  size_t G = b->num_groups;
  int mixed = path == PF_PATH_MIXED;
  cb->ev = calloc(mixed ? 2 * G : G, sizeof *cb->ev);
  uint32_t *idx = malloc(3 * G * sizeof *idx);
  b->impl = cb;
  int32_t rc = cb->ev && idx ? PF_OK
                             : pf_fail(PF_ENOMEM, "pf_copy_submit: out of memory");
  for (size_t g = 0; g < (mixed ? 2 * G : G) && rc == PF_OK; g++)
    if (!(cb->ev[g] = event_get(ce)))
      rc = pf_fail(PF_ECUDA, "pf_copy_submit: cuEventCreate failed");
  if (rc == PF_OK) rc = set_ctx(ce, "pf_copy_submit");
  if (rc < 0) {
    free(idx);
    cuda_batch_release(ce, b);
    return rc;
  }
  uint32_t *lo = idx, *mid = idx + G, *hi = idx + 2 * G;
  for (uint32_t g = 0; g < G; g++) {
    lo[g] = b->groups[g].first_range;
    hi[g] = lo[g] + b->groups[g].num_ranges;
  }
  pthread_mutex_lock(&ce->submit_mu);
  if (path == PF_PATH_KERNEL) {
    rc = enqueue_kernel(e, ce, b, cb, lo, hi, NULL);
  } else if (path == PF_PATH_DMA_BATCH) {
    rc = enqueue_dma_batch(ce, b, ce->stream, lo, hi, cb->ev);
  } else if (path == PF_PATH_DMA) {
    rc = enqueue_dma(ce, b, ce->stream, lo, hi, cb->ev);
  } else {
    uint32_t share = e->dma_share ? e->dma_share : e->default_dma_share;
    split_mixed(b, share, lo, mid, hi);
    CUevent *aux = cb->ev + G;
    /* The copy-engine stream starts after everything queued before this
     * batch, like the single-stream paths do. */
    CUresult r = cu.cuEventRecord(aux[0], ce->stream);
    if (r == CUDA_SUCCESS) r = cu.cuStreamWaitEvent(ce->stream2, aux[0], 0);
    if (r != CUDA_SUCCESS) rc = cu_fail(r, "pf_copy_submit", "mixed stream join");
    if (rc == PF_OK)
      rc = (e->features & PF_FEAT_DMA_BATCH)
               ? enqueue_dma_batch(ce, b, ce->stream2, lo, mid, aux)
               : enqueue_dma(ce, b, ce->stream2, lo, mid, aux);
    if (rc == PF_OK) rc = enqueue_kernel(e, ce, b, cb, mid, hi, aux);
  }
  free(idx);
  if (rc < 0) {
    /* Work enqueued before the failure still runs: wait for it so that the
     * caller may close what the batch touched as soon as we return. */
    char msg[512];
    pf_last_error(msg, sizeof msg);
    cu.cuStreamSynchronize(ce->stream);
    cu.cuStreamSynchronize(ce->stream2);
    pthread_mutex_unlock(&ce->submit_mu);
    cuda_batch_release(ce, b);
    return pf_fail(rc, "%s (path %s)", msg, path_name[path]);
  }
  b->next = NULL;
  pthread_mutex_lock(&ce->mu);
  if (ce->tail)
    ce->tail->next = b;
  else
    ce->head = b;
  ce->tail = b;
  pthread_cond_broadcast(&ce->cv);
  pthread_mutex_unlock(&ce->mu);
  pthread_mutex_unlock(&ce->submit_mu);
  return PF_OK;
}

/* ---- calibration ------------------------------------------------------- */
typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done;
  int32_t status;
  uint64_t ns;
} waiter;

static void waiter_done(void *arg, int32_t status, uint64_t ns) {
  waiter *w = arg;
  pthread_mutex_lock(&w->mu);
  w->done = 1;
  w->status = status;
  w->ns = ns;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

/* Runs one strided single-group batch through `path`; GB/s or < 0. */
static int32_t time_path(pf_engine *e, pf_pool *p, uint32_t dir, uint32_t path,
                         CUdeviceptr scratch, uint64_t size, uint64_t total,
                         double *gbps) {
  uint64_t nseg = total / size ? total / size : 1;
  if (nseg > UINT32_MAX)
    return pf_fail(PF_EINVAL, "pf_calibrate: %llu segments is too many",
                   (unsigned long long)nseg);
  pf_batch *b = pf_batch_alloc(1, (uint32_t)nseg);
  if (!b) return pf_fail(PF_ENOMEM, "pf_calibrate: out of memory");
  for (uint64_t i = 0; i < nseg; i++)
    b->ranges[i] = (pf_range){scratch + 2 * i * size, i * size, size};
  b->groups[0] = (pf_group_rt){NULL, 0, 0, (uint32_t)nseg, 0, nseg * size};
  b->engine = e;
  b->pool = p;
  b->direction = dir;
  b->path = path;
  b->total_bytes = nseg * size;
  waiter w = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0};
  b->on_done = waiter_done;
  b->on_done_arg = &w;
  uint64_t moved = b->total_bytes;
  atomic_fetch_add(&p->inflight, 1); /* pf_batch_done releases it */
  b->submit_ns = pf_now_ns();
  int32_t rc = cuda_submit(e, b);
  if (rc < 0) {
    atomic_fetch_sub(&p->inflight, 1);
    pf_batch_free(b);
    return rc;
  }
  pthread_mutex_lock(&w.mu);
  while (!w.done) pthread_cond_wait(&w.cv, &w.mu);
  pthread_mutex_unlock(&w.mu);
  *gbps = w.ns ? (double)moved / (double)w.ns : 0;
  return w.status;
}

/* Best of PF_CAL_REPS timed runs after one warm-up. */
#define PF_CAL_REPS 3

static int32_t cuda_calibrate(pf_engine *e, pf_pool *p, uint32_t dir,
                              const uint64_t *sizes, uint32_t n, uint64_t total,
                              double *out) {
  cuda_engine *ce = e->impl;
  int32_t rc = set_ctx(ce, "pf_calibrate");
  if (rc < 0) return rc;
  CUdeviceptr scratch = 0;
  CU_TRY("pf_calibrate", cu.cuMemAlloc_v2(&scratch, 2 * total));
  /* Peak: one contiguous copy of `total`, timed by events on the stream. */
  CUevent a = NULL, z = NULL;
  double peak = 0;
  CUresult r = cu.cuEventCreate(&a, CU_EVENT_DEFAULT);
  if (r == CUDA_SUCCESS) r = cu.cuEventCreate(&z, CU_EVENT_DEFAULT);
  for (int rep = 0; rep <= PF_CAL_REPS && r == CUDA_SUCCESS; rep++) {
    CUdeviceptr host = p->device_ptr;
    r = cu.cuEventRecord(a, ce->stream);
    if (r == CUDA_SUCCESS)
      r = dir == PF_D2H ? cu.cuMemcpyAsync(host, scratch, total, ce->stream)
                        : cu.cuMemcpyAsync(scratch, host, total, ce->stream);
    if (r == CUDA_SUCCESS) r = cu.cuEventRecord(z, ce->stream);
    if (r == CUDA_SUCCESS) r = cu.cuEventSynchronize(z);
    float ms = 0;
    if (r == CUDA_SUCCESS) r = cu.cuEventElapsedTime(&ms, a, z);
    if (r == CUDA_SUCCESS && rep > 0 && ms > 0) {
      double g = (double)total / (ms * 1e6);
      if (g > peak) peak = g;
    }
  }
  if (a) cu.cuEventDestroy_v2(a);
  if (z) cu.cuEventDestroy_v2(z);
  if (r != CUDA_SUCCESS) {
    cu.cuMemFree_v2(scratch);
    return cu_fail(r, "pf_calibrate", "one large copy");
  }
  static const uint32_t paths[3] = {PF_PATH_KERNEL, PF_PATH_DMA_BATCH, PF_PATH_DMA};
  static const uint64_t need[3] = {PF_FEAT_KERNEL, PF_FEAT_DMA_BATCH, 0};
  for (uint32_t i = 0; i < n && rc == PF_OK; i++) {
    out[i] = peak;
    for (int k = 0; k < 3 && rc == PF_OK; k++) {
      if (need[k] && !(e->features & need[k])) continue;
      double best = 0;
      for (int rep = 0; rep <= PF_CAL_REPS; rep++) {
        double g = 0;
        /* A path the driver refuses at run time reads as absent (0). */
        if (time_path(e, p, dir, paths[k], scratch, sizes[i], total, &g) < 0) {
          best = 0;
          break;
        }
        if (rep > 0 && g > best) best = g;
      }
      out[(size_t)(k + 1) * n + i] = best;
    }
  }
  cu.cuStreamSynchronize(ce->stream);
  cu.cuMemFree_v2(scratch);
  return rc;
}

const pf_backend_ops pf_cuda_ops = {
    .name = "cuda",
    .open = cuda_open,
    .close = cuda_close,
    .pool_alloc = cuda_pool_alloc,
    .pool_free = cuda_pool_free,
    .region_alloc = cuda_region_alloc,
    .region_import = cuda_region_import,
    .region_close = cuda_region_close,
    .region_rw = cuda_region_rw,
    .submit = cuda_submit,
    .calibrate = cuda_calibrate,
    .max_range_bytes = UINT64_MAX,
};
