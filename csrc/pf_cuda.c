/*
 * pf_cuda.c — the CUDA backend, on the driver API loaded with dlopen.
 *
 * No link-time CUDA dependency: libcuda.so.1 is opened at run time and every
 * entry point is resolved by its versioned name (the *_v2 ABI where one
 * exists). A machine without a driver or a GPU gets PF_ENODEV and AUTO
 * falls back to the host backend.
 *
 * Per engine: the device's primary context, a main stream, the embedded
 * copy kernels (pf_kernel.cu, loaded with cuModuleLoadData), a pinned +
 * device "table arena" for the kernel's segment tables, and threads:
 *  - the submitter: pf_copy_submit only validates and queues; this thread
 *    builds kernel tables and issues the work, so the JS thread never pays
 *    for it;
 *  - DMA lanes (PF_DMA_LANES_DEFAULT, each with its own stream): issue the
 *    copy-engine descriptors of a batch in parallel, because the driver's
 *    CPU cost per copy, not the link, limits one thread at 32 KB;
 *  - the completion thread: waits for each group's events in order, posts
 *    LAYER records and progress words, then the BATCH record.
 * Batches on one engine complete in submit order (later batches' main
 * stream waits for the earlier batch's lanes).
 *
 * Several devices: one engine per device, each with its own primary
 * context, streams, lanes and threads; one pool (registered PORTABLE, so it
 * is pinned for every context) that every engine copies through, each with
 * its own device view of it (pool_view: the creating engine's is the pool's
 * own, so one device pays nothing extra); every engine posts to the same
 * ring. A device that meets an error which leaves its context unusable
 * (illegal address, launch failure, ECC, a destroyed context) is marked
 * failed: its engine's later batches fail at once with a text naming the
 * device, and the other engines, on their own threads, keep copying.
 *
 * Copy paths (chosen per batch by the caller, never here: the policy is
 * lib/copy_path.ts, from pf_calibrate's tables):
 *  - KERNEL: ranges (segments, merged by the caller) are cut into table
 *    entries, the table goes to the device with one async H2D copy, one
 *    launch per group.
 *  - DMA_BATCH: cuMemcpyBatchAsync (driver 12.8+), spread over the lanes.
 *  - DMA: one cuMemcpyAsync per range, spread over the lanes.
 *  - MIXED: a share of each group to the lanes, the rest to the kernel.
 */
#define _GNU_SOURCE
#include "pf_internal.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
  /* Errors after which the context is unusable (the device is lost for
   * this process): see cu_sticky. */
  CUDA_ERROR_ECC_UNCORRECTABLE = 214,
  CUDA_ERROR_NVLINK_UNCORRECTABLE = 220,
  CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_LAUNCH_TIMEOUT = 702,
  CUDA_ERROR_CONTEXT_IS_DESTROYED = 709,
  CUDA_ERROR_HARDWARE_STACK_ERROR = 714,
  CUDA_ERROR_ILLEGAL_INSTRUCTION = 715,
  CUDA_ERROR_MISALIGNED_ADDRESS = 716,
  CUDA_ERROR_INVALID_ADDRESS_SPACE = 717,
  CUDA_ERROR_INVALID_PC = 718,
  CUDA_ERROR_LAUNCH_FAILED = 719,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_UNKNOWN = 999,
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
  X(cuDeviceGetName, CUresult (*)(char *, int, CUdevice))                      \
  X(cuDeviceGetPCIBusId, CUresult (*)(char *, int, CUdevice))                  \
  X(cuDriverGetVersion, CUresult (*)(int *))                                   \
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
  X(cuEventQuery, CUresult (*)(CUevent))                                       \
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

/* The engine whose worker thread (submitter, lane, completion) this is;
 * NULL on the caller's threads. A sticky error met on it fails its device. */
static __thread pf_engine *cu_thread_engine;

/* 1: after this error the context cannot be used again (the driver says so
 * for these; an Xid that takes the GPU away shows up as one of them). */
static int cu_sticky(CUresult r) {
  switch (r) {
  case CUDA_ERROR_ECC_UNCORRECTABLE: case CUDA_ERROR_NVLINK_UNCORRECTABLE:
  case CUDA_ERROR_ILLEGAL_ADDRESS: case CUDA_ERROR_LAUNCH_TIMEOUT:
  case CUDA_ERROR_CONTEXT_IS_DESTROYED: case CUDA_ERROR_HARDWARE_STACK_ERROR:
  case CUDA_ERROR_ILLEGAL_INSTRUCTION: case CUDA_ERROR_MISALIGNED_ADDRESS:
  case CUDA_ERROR_INVALID_ADDRESS_SPACE: case CUDA_ERROR_INVALID_PC:
  case CUDA_ERROR_LAUNCH_FAILED: case CUDA_ERROR_UNKNOWN:
    return 1;
  default:
    return 0;
  }
}

/* Records a failed driver call as PF_ECUDA with its name and message; on an
 * engine's worker thread a sticky error also marks that device failed. */
static int32_t cu_fail(CUresult r, const char *fn, const char *call) {
  const char *n = "?", *s = "?";
  if (cu.cuGetErrorName) cu.cuGetErrorName(r, &n);
  if (cu.cuGetErrorString) cu.cuGetErrorString(r, &s);
  if (cu_thread_engine && cu_sticky(r)) {
    char why[128];
    snprintf(why, sizeof why, "%s (%d) in %s; the context is unusable", n, r,
             call);
    pf_engine_mark_failed(cu_thread_engine, PF_ECUDA, why);
  }
  return pf_fail(PF_ECUDA, "%s: %s failed: %s (%d): %s", fn, call, n, r, s);
}

/* Fails batch b with the calling thread's last error, naming e's device. */
static void fail_batch_here(pf_engine *e, pf_batch *b, int32_t rc) {
  char msg[PF_ERROR_TEXT_BYTES];
  pf_last_error(msg, sizeof msg);
  pf_batch_fail(b, rc, "device %d: %s", e->device, msg);
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
/* Default grid (blocks of 512 threads) for the kernel path. On an H100
 * (docs/native.md) 8 blocks already give the kernel's plateau (~93 % D2H,
 * ~90 % H2D of the link); 16 keeps a margin and leaves 116 of 132 SMs to
 * the model. pf_engine_set_kernel_grid overrides. */
#define PF_KERNEL_GRID_DEFAULT 16u
/* cuMemcpyBatchAsync calls are cut to this many copies each. */
#define PF_DMA_BATCH_MAX 8192u
#define PF_EVENT_CACHE 1024u
/* Copy engines' share (permille of bytes) of a mixed batch: the copy
 * engines reach ~70 % of the link with 32 KB copies alone (descriptor
 * rate), the SMs ~93 %; measured best split in docs/native.md. */
#define PF_MIXED_DMA_SHARE_DEFAULT 700u
/* Which kernel variant runs when PEGAFLOW_KERNEL is unset. */
#define PF_KERNEL_DEFAULT_VARIANT PF_KERNEL_SIMT

/* Entry size of the bulk-copy variant (its shared-memory stage size). */
#define PF_TMA_CHUNK 8192ull
#define PF_TMA_THREADS 32u

typedef struct pf_kentry {
  uint64_t src, dst, bytes;
} pf_kentry;

/* Copy-engine work is issued by PF_DMA_LANES threads, each on its own
 * stream, each taking a contiguous slice of every group: the driver spends
 * ~0.5-1 us of CPU per copy in cuMemcpyBatchAsync (~3 us in
 * cuMemcpyAsync), so one thread issuing 40,000 32 KB copies, not the link,
 * sets the pace. PEGAFLOW_DMA_LANES (1..8) overrides. */
#define PF_DMA_LANES_DEFAULT 4u
#define PF_DMA_LANES_MAX 8u
#define PF_LANE_MIN_RANGES 512u
#define PF_LANE_MAX_MEAN_RANGE (128ull << 10)
/* How often the completion thread looks whether a group is fully issued. */
#define PF_ISSUE_POLL_NS 20000L
/* How often the completion thread looks whether a save's group landed. */
#define PF_SAVE_POLL_NS 50000L
/* Device views of pools created by other engines (pool_view), per engine:
 * a server has one pool, so a few entries are plenty. */
#define PF_POOL_VIEWS 4u

struct cuda_engine;
/* cuMemcpyBatchAsync argument arrays, one set per issuing thread. */
typedef struct dma_scratch {
  CUdeviceptr dst[PF_DMA_BATCH_MAX];
  CUdeviceptr src[PF_DMA_BATCH_MAX];
  size_t len[PF_DMA_BATCH_MAX];
} dma_scratch;

typedef struct dma_lane {
  struct cuda_engine *ce;
  pf_engine *e;
  uint32_t w;
  pthread_t th;
  CUstream stream;
  dma_scratch *sc;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int stop;
  /* the job: this lane's slice of every group of batch b */
  pf_batch *b;
  const uint32_t *lo, *hi;
  CUevent start;
  int32_t rc;
  int busy;
  CUevent tail; /* recorded after the lane's last copy of a batch */
} dma_lane;

typedef struct cuda_engine {
  CUdevice dev;
  CUcontext ctx;
  CUstream stream;
  dma_lane lanes[PF_DMA_LANES_MAX];
  uint32_t nlanes;
  CUmodule mod;
  CUfunction fn_copy;
  CUfunction fn_tma;   /* Hopper bulk-copy variant (NULL before sm_90) */
  int variant;         /* PF_KERNEL_SIMT or PF_KERNEL_TMA */
  int debug;           /* PEGAFLOW_DEBUG set: per-batch enqueue timings on stderr */
  /* table arena: pinned host staging + device copy, FIFO ring of spans */
  uint8_t *arena_host;
  CUdeviceptr arena_dev;
  uint64_t arena_head, arena_tail; /* virtual offsets, under mu */
  pthread_mutex_t mu;
  pthread_cond_t cv;               /* queue non-empty / arena freed */
  pf_batch *head, *tail;           /* batches awaiting completion */
  int stop;
  pthread_t th;
  pthread_cond_t scv;              /* submit queue non-empty */
  pf_batch *sq_head, *sq_tail;     /* batches awaiting enqueue */
  int sstop;
  pthread_t sth;
  CUevent events[PF_EVENT_CACHE];
  uint32_t nevents;
  /* This engine's device views of other engines' pools (under mu). */
  struct { uint32_t pool; const uint8_t *host; CUdeviceptr dev; } views[PF_POOL_VIEWS];
  uint32_t next_view;
} cuda_engine;

typedef struct cuda_batch {
  /* ev[0..I): main stream, one per issue group; with lanes, then
   * ev[I + g*L + w] for lane w's slice of issue group g, then one start
   * event. */
  CUevent *ev;
  uint32_t nev;
  uint32_t lanes; /* L: 0 when the batch uses the main stream only */
  /* I, the issue groups: the batch's groups (G), or 1 for a batch issued
   * whole (coarse: a quiet batch without progress words on the copy
   * engines, i.e. a save nobody watches layer by layer). A coarse batch's
   * ranges go out in one slice per lane (one cuMemcpyBatchAsync per lane
   * instead of one per layer) with one event per stream instead of one per
   * layer and stream, and all its groups are reported once it landed. */
  uint32_t ig;
  uint32_t path;
  uint64_t pool_dev; /* the pool's device address in this engine's context */
  _Atomic int32_t status; /* < 0 when enqueueing failed */
  /* Per issue group: lanes that have recorded their event for it. The batch
   * goes to the completion thread as soon as the lanes start, so group 0
   * can be reported while later groups are still being issued; the
   * completion thread waits for issued[g] == lanes before it syncs issue
   * group g's events. */
  atomic_uint *issued;
  atomic_int lanes_active; /* lanes still working on this batch */
  int drained;    /* completion thread synced the streams after a failure */
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

/* The device address of pool p in e's context (current). The creating
 * engine's view is the pool's own; another engine asks the driver once per
 * pool (under UVA it is the host address, but the driver is the one to
 * say) and keeps the answer. */
static int32_t pool_view(pf_engine *e, cuda_engine *ce, pf_pool *p,
                         const char *fn, uint64_t *out) {
  if (p->engine == e) {
    *out = p->device_ptr;
    return PF_OK;
  }
  pthread_mutex_lock(&ce->mu);
  for (uint32_t i = 0; i < PF_POOL_VIEWS; i++)
    if (ce->views[i].pool == p->handle && ce->views[i].host == p->host) {
      *out = ce->views[i].dev;
      pthread_mutex_unlock(&ce->mu);
      return PF_OK;
    }
  pthread_mutex_unlock(&ce->mu);
  CUdeviceptr d = 0;
  CUresult r = cu.cuMemHostGetDevicePointer_v2(&d, p->host, 0);
  if (r != CUDA_SUCCESS) {
    cu_fail(r, fn, "cuMemHostGetDevicePointer");
    char msg[PF_ERROR_TEXT_BYTES];
    pf_last_error(msg, sizeof msg);
    return pf_fail(PF_ECUDA, "%s: pool %u (created on device %d) has no view "
                   "on device %d: %s", fn, p->handle, p->engine->device,
                   e->device, msg);
  }
  pthread_mutex_lock(&ce->mu);
  uint32_t i = ce->next_view++ % PF_POOL_VIEWS;
  ce->views[i].pool = p->handle;
  ce->views[i].host = p->host;
  ce->views[i].dev = d;
  pthread_mutex_unlock(&ce->mu);
  *out = d;
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
  if (cb->ev)
    for (uint32_t i = 0; i < cb->nev; i++) event_put(ce, cb->ev[i]);
  if (cb->arena_end) {
    pthread_mutex_lock(&ce->mu);
    /* Batches finish in order, so their spans free in order; a batch that
     * failed at submit (after a stream sync) must not move the tail back. */
    if (cb->arena_end > ce->arena_tail) ce->arena_tail = cb->arena_end;
    pthread_cond_broadcast(&ce->cv);
    pthread_mutex_unlock(&ce->mu);
  }
  free(cb->ev);
  free(cb->issued);
  free(cb);
  b->impl = NULL;
}

/* Queues b for the completion thread (which reports batches in order). */
static void completion_push(cuda_engine *ce, pf_batch *b) {
  b->next = NULL;
  pthread_mutex_lock(&ce->mu);
  if (ce->tail)
    ce->tail->next = b;
  else
    ce->head = b;
  ce->tail = b;
  pthread_cond_broadcast(&ce->cv);
  pthread_mutex_unlock(&ce->mu);
}

/* Waits for ev. A load's layers feed a forward that waits on each one, so its
 * groups are waited for in the driver, which spins (their landing is seen
 * within microseconds). Nobody waits on a save's layer: its groups are
 * polled (poll != 0) with a sleep between looks, so a save costs the host
 * no core spinning beside the engine's launches for as long as it copies
 * (its completion is seen up to ~0.1 ms later; docs/native.md). */
static CUresult event_wait(CUevent ev, int poll) {
  if (!poll) return cu.cuEventSynchronize(ev);
  for (;;) {
    CUresult r = cu.cuEventQuery(ev);
    if (r != CUDA_ERROR_NOT_READY) return r;
    struct timespec ts = {0, PF_SAVE_POLL_NS};
    nanosleep(&ts, NULL);
  }
}

/* Reports issue group g of b: that group, or every group of a batch issued
 * whole (cuda_batch.ig). */
static void issue_group_done(pf_batch *b, uint32_t g, int32_t status) {
  const cuda_batch *cb = b->impl;
  if (cb->ig == b->num_groups) {
    pf_batch_group_done(b, g, status);
    return;
  }
  for (uint32_t k = 0; k < b->num_groups; k++) pf_batch_group_done(b, k, status);
}

static void *completion_main(void *arg) {
  pf_engine *e = arg;
  cuda_engine *ce = e->impl;
  pthread_setname_np(pthread_self(), "pf-cu-done"); /* top, perf, /proc: whose CPU */
  cu_thread_engine = e;
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
    int32_t status = atomic_load(&cb->status);
    const uint32_t I = cb->ig;
    for (uint32_t g = 0; g < I; g++) {
      while (status == PF_OK && cb->lanes &&
             atomic_load_explicit(&cb->issued[g], memory_order_acquire) < cb->lanes) {
        /* The lanes are still issuing this group (microseconds per copy). */
        struct timespec ts = {0, PF_ISSUE_POLL_NS};
        nanosleep(&ts, NULL);
        status = atomic_load(&cb->status);
      }
      if (status < 0) {
        if (!cb->drained) {
          /* Copies issued before the failure still run: let the lanes stop
           * issuing, then let everything land before anyone may close what
           * the batch touched. */
          while (atomic_load(&cb->lanes_active) > 0) {
            struct timespec ts = {0, PF_ISSUE_POLL_NS};
            nanosleep(&ts, NULL);
          }
          cu.cuStreamSynchronize(ce->stream);
          for (uint32_t w = 0; w < ce->nlanes; w++)
            cu.cuStreamSynchronize(ce->lanes[w].stream);
          cb->drained = 1;
        }
        issue_group_done(b, g, status);
        continue;
      }
      const int poll = b->direction == PF_D2H;
      CUresult r = event_wait(cb->ev[g], poll);
      for (uint32_t w = 0; w < cb->lanes && r == CUDA_SUCCESS; w++)
        r = event_wait(cb->ev[I + g * cb->lanes + w], poll);
      if (r != CUDA_SUCCESS && status == PF_OK) {
        status = cu_fail(r, "pf_copy_submit(completion)",
                         poll ? "cuEventQuery" : "cuEventSynchronize");
        char msg[PF_ERROR_TEXT_BYTES];
        pf_last_error(msg, sizeof msg);
        if (I == b->num_groups)
          pf_batch_fail(b, status, "device %d: group %u (layer %u): %s",
                        e->device, g, b->groups[g].layer, msg);
        else
          pf_batch_fail(b, status, "device %d: groups 0..%u (layers %u..%u, "
                        "issued whole): %s", e->device, b->num_groups - 1,
                        b->groups[0].layer, b->groups[b->num_groups - 1].layer, msg);
      }
      issue_group_done(b, g, status);
    }
    while (atomic_load(&cb->lanes_active) > 0) {
      struct timespec ts = {0, PF_ISSUE_POLL_NS};
      nanosleep(&ts, NULL);
    }
    uint32_t path = cb->path;
    cuda_batch_release(ce, b);
    pf_batch_done(b, status, path);
  }
}

static void cuda_close(pf_engine *e);
static void *submitter_main(void *arg);
static void *lane_main(void *arg);

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
  pthread_cond_init(&ce->cv, NULL);
  pthread_cond_init(&ce->scv, NULL);
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
  ce->debug = getenv("PEGAFLOW_DEBUG") != NULL;
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
  e->device_mem_bytes = total;
  int drv = 0;
  OPEN_TRY(cu.cuDriverGetVersion(&drv));
  e->driver_version = (uint32_t)drv;
  OPEN_TRY(cu.cuDeviceGetName(e->device_name, (int)sizeof e->device_name - 1, ce->dev));
  e->default_dma_share = PF_MIXED_DMA_SHARE_DEFAULT;
  /* pthread_create returns its error; it does not set errno. */
  int terr = pthread_create(&ce->th, NULL, completion_main, e);
  if (terr != 0) {
    ce->th = 0;
    rc = pf_fail(PF_ENOMEM, "pf_engine_open(cuda): completion thread: %s",
                 strerror(terr));
    goto fail;
  }
  ce->nlanes = PF_DMA_LANES_DEFAULT;
  const char *nl = getenv("PEGAFLOW_DMA_LANES");
  if (nl && atoi(nl) >= 1 && atoi(nl) <= (int)PF_DMA_LANES_MAX) ce->nlanes = (uint32_t)atoi(nl);
  for (uint32_t w = 0; w < ce->nlanes; w++) {
    dma_lane *l = &ce->lanes[w];
    l->ce = ce;
    l->e = e;
    l->w = w;
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, NULL);
    OPEN_TRY(cu.cuStreamCreate(&l->stream, CU_STREAM_NON_BLOCKING));
    OPEN_TRY(cu.cuEventCreate(&l->tail, CU_EVENT_DISABLE_TIMING));
    l->sc = malloc(sizeof *l->sc);
    if (!l->sc || pthread_create(&l->th, NULL, lane_main, l) != 0) {
      l->th = 0;
      rc = pf_fail(PF_ENOMEM, "pf_engine_open(cuda): DMA lane %u thread", w);
      goto fail;
    }
  }
  terr = pthread_create(&ce->sth, NULL, submitter_main, e);
  if (terr != 0) {
    ce->sth = 0;
    rc = pf_fail(PF_ENOMEM, "pf_engine_open(cuda): submitter thread: %s",
                 strerror(terr));
    goto fail;
  }
  return PF_OK;
fail:
  cuda_close(e);
  return rc;
#undef OPEN_TRY
}

static void cuda_close(pf_engine *e) {
  cuda_engine *ce = e->impl;
  if (!ce) return;
  if (ce->sth) { /* drains the submit queue into the completion queue */
    pthread_mutex_lock(&ce->mu);
    ce->sstop = 1;
    pthread_cond_broadcast(&ce->scv);
    pthread_mutex_unlock(&ce->mu);
    pthread_join(ce->sth, NULL);
  }
  for (uint32_t w = 0; w < PF_DMA_LANES_MAX; w++) {
    dma_lane *l = &ce->lanes[w];
    if (l->th) {
      pthread_mutex_lock(&l->mu);
      l->stop = 1;
      pthread_cond_broadcast(&l->cv);
      pthread_mutex_unlock(&l->mu);
      pthread_join(l->th, NULL);
    }
  }
  if (ce->th) {
    pthread_mutex_lock(&ce->mu);
    ce->stop = 1;
    pthread_cond_broadcast(&ce->cv);
    pthread_mutex_unlock(&ce->mu);
    pthread_join(ce->th, NULL);
  }
  if (ce->ctx) cu.cuCtxSetCurrent(ce->ctx);
  if (ce->stream) cu.cuStreamSynchronize(ce->stream);
  for (uint32_t w = 0; w < PF_DMA_LANES_MAX; w++)
    if (ce->lanes[w].stream) cu.cuStreamSynchronize(ce->lanes[w].stream);
  for (uint32_t i = 0; i < ce->nevents; i++) cu.cuEventDestroy_v2(ce->events[i]);
  if (ce->mod) cu.cuModuleUnload(ce->mod);
  if (ce->arena_dev) cu.cuMemFree_v2(ce->arena_dev);
  if (ce->arena_host) cu.cuMemFreeHost(ce->arena_host);
  if (ce->stream) cu.cuStreamDestroy_v2(ce->stream);
  for (uint32_t w = 0; w < PF_DMA_LANES_MAX; w++) {
    dma_lane *l = &ce->lanes[w];
    if (l->stream) cu.cuStreamDestroy_v2(l->stream);
    if (l->tail) cu.cuEventDestroy_v2(l->tail);
    free(l->sc);
    if (l->ce) {
      pthread_cond_destroy(&l->cv);
      pthread_mutex_destroy(&l->mu);
    }
  }
  if (ce->ctx) cu.cuDevicePrimaryCtxRelease_v2(ce->dev);
  pthread_cond_destroy(&ce->cv);
  pthread_cond_destroy(&ce->scv);
  pthread_mutex_destroy(&ce->mu);
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
  pf_pool_phase(p, PF_POOL_PHASE_LOCK);
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
  /* Wait while older tables hold what this one needs. A wrap skips
   * [head, next lap), which the span below counts as in use, and the tail
   * never moves past the head: an empty arena (tail == head) must not wait,
   * or a wrapped table larger than the head's offset waits for ever. Only
   * the submitter thread reserves, so the head does not move meanwhile. */
  while (ce->arena_tail != ce->arena_head &&
         start + bytes - ce->arena_tail > PF_ARENA_BYTES)
    pthread_cond_wait(&ce->cv, &ce->mu);
  ce->arena_head = start + bytes;
  pthread_mutex_unlock(&ce->mu);
  *off = start % PF_ARENA_BYTES;
  *vend = start + bytes;
  return PF_OK;
}

/*
 * Enqueueing runs on the engine's submitter thread, never on the caller's:
 * building a kernel table or issuing tens of thousands of DMA descriptors
 * costs milliseconds of CPU (cuMemcpyBatchAsync ~0.4 us per copy), which
 * must not block the JS event loop. pf_copy_submit only validates and
 * queues. Copy-engine work is spread over the DMA lanes (above).
 */
typedef struct kernel_plan {
  int tma;
  uint64_t off;     /* arena offset of the table */
  uint32_t *first;  /* per group: first entry; [G] = total */
} kernel_plan;

/* Builds and uploads the kernel table for ranges [lo[g], hi[g]) of each
 * group (on ce->stream, ahead of the launches). */
static int32_t kernel_prepare(cuda_engine *ce, pf_batch *b, cuda_batch *cb,
                              const uint32_t *lo, const uint32_t *hi,
                              kernel_plan *kp) {
  uint64_t pool_dev = cb->pool_dev;
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
  kp->tma = tma;
  kp->off = 0;
  kp->first = malloc(((size_t)b->num_groups + 1) * sizeof *kp->first);
  if (!kp->first) return pf_fail(PF_ENOMEM, "pf_copy_submit: out of memory");
  if (n) {
    uint64_t vend = 0;
    int32_t rc = arena_reserve(ce, n * sizeof(pf_kentry), &kp->off, &vend);
    if (rc < 0) return rc;
    cb->arena_end = vend;
  }
  pf_kentry *tab = (pf_kentry *)(ce->arena_host + kp->off);
  uint64_t k = 0;
  for (uint32_t g = 0; g < b->num_groups; g++) {
    kp->first[g] = (uint32_t)k;
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
  kp->first[b->num_groups] = (uint32_t)k;
  if (k)
    CU_TRY("pf_copy_submit", cu.cuMemcpyHtoDAsync_v2(ce->arena_dev + kp->off, tab,
                                                     k * sizeof(pf_kentry),
                                                     ce->stream));
  return PF_OK;
}

static int32_t kernel_launch(pf_engine *e, cuda_engine *ce,
                             const kernel_plan *kp, uint32_t g) {
  unsigned int cnt = kp->first[g + 1] - kp->first[g];
  if (!cnt) return PF_OK;
  CUdeviceptr t = ce->arena_dev + kp->off + (uint64_t)kp->first[g] * sizeof(pf_kentry);
  uint32_t grid = e->grid_blocks ? e->grid_blocks : e->default_grid;
  unsigned int blocks = cnt < grid ? cnt : grid;
  void *args[] = {&t, &cnt};
  CU_TRY("pf_copy_submit",
         cu.cuLaunchKernel(kp->tma ? ce->fn_tma : ce->fn_copy, blocks, 1, 1,
                           kp->tma ? PF_TMA_THREADS : PF_KERNEL_THREADS, 1, 1,
                           0, ce->stream, args, NULL));
  return PF_OK;
}

/* One cuMemcpyAsync per range of [lo, hi). */
static int32_t dma_ranges(pf_batch *b, CUstream st, uint32_t lo, uint32_t hi) {
  uint64_t pool_dev = ((const cuda_batch *)b->impl)->pool_dev;
  for (uint32_t i = lo; i < hi; i++) {
    const pf_range *r = &b->ranges[i];
    CUdeviceptr dev = r->region_addr, host = pool_dev + r->pool_off;
    CUresult res = b->direction == PF_D2H
                       ? cu.cuMemcpyAsync(host, dev, r->bytes, st)
                       : cu.cuMemcpyAsync(dev, host, r->bytes, st);
    if (res != CUDA_SUCCESS) return cu_fail(res, "pf_copy_submit", "cuMemcpyAsync");
  }
  return PF_OK;
}

/* cuMemcpyBatchAsync over [lo, hi), PF_DMA_BATCH_MAX copies per call; the
 * scratch arrays are the submitter thread's. */


static int32_t dma_batch_ranges(cuda_engine *ce, pf_batch *b, CUstream st,
                                uint32_t lo, uint32_t hi, dma_scratch *sc) {
  CUmemcpyAttributes attr;
  memset(&attr, 0, sizeof attr);
  attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
  CUmemLocation devloc = {CU_MEM_LOCATION_TYPE_DEVICE, (int)ce->dev};
  CUmemLocation hostloc = {CU_MEM_LOCATION_TYPE_HOST, 0};
  attr.srcLocHint = b->direction == PF_D2H ? devloc : hostloc;
  attr.dstLocHint = b->direction == PF_D2H ? hostloc : devloc;
  size_t attr_idx = 0;
  uint64_t pool_dev = ((const cuda_batch *)b->impl)->pool_dev;
  uint32_t i = lo;
  while (i < hi) {
    uint32_t n = 0;
    for (; i < hi && n < PF_DMA_BATCH_MAX; i++, n++) {
      const pf_range *r = &b->ranges[i];
      CUdeviceptr dev = r->region_addr, host = pool_dev + r->pool_off;
      sc->dst[n] = b->direction == PF_D2H ? host : dev;
      sc->src[n] = b->direction == PF_D2H ? dev : host;
      sc->len[n] = r->bytes;
    }
    CUresult res;
    if (cu.batch_v2) {
      res = cu.batch_v2(sc->dst, sc->src, sc->len, n, &attr, &attr_idx, 1, st);
    } else {
      size_t fail_idx = 0;
      res = cu.batch_v1(sc->dst, sc->src, sc->len, n, &attr, &attr_idx, 1,
                        &fail_idx, st);
    }
    if (res != CUDA_SUCCESS) return cu_fail(res, "pf_copy_submit", "cuMemcpyBatchAsync");
  }
  return PF_OK;
}

static const char *const path_name[] = {"host", "kernel", "dma_batch", "dma",
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

/* Lane w's slice of [lo, hi): contiguous, the slices tile the range. */
static void lane_slice(uint32_t lo, uint32_t hi, uint32_t w, uint32_t L,
                       uint32_t *a, uint32_t *z) {
  uint64_t n = hi - lo;
  *a = lo + (uint32_t)(n * w / L);
  *z = lo + (uint32_t)(n * (w + 1) / L);
}

static void *lane_main(void *arg) {
  dma_lane *l = arg;
  cuda_engine *ce = l->ce;
  pthread_setname_np(pthread_self(), "pf-cu-lane");
  cu_thread_engine = l->e;
  cu.cuCtxSetCurrent(ce->ctx);
  for (;;) {
    pthread_mutex_lock(&l->mu);
    while (!l->stop && !l->busy) pthread_cond_wait(&l->cv, &l->mu);
    if (!l->busy) {
      pthread_mutex_unlock(&l->mu);
      return NULL;
    }
    pthread_mutex_unlock(&l->mu);
    pf_batch *b = l->b;
    cuda_batch *cb = b->impl;
    const uint32_t I = cb->ig, L = cb->lanes;
    int32_t rc = PF_OK;
    CUresult r = cu.cuStreamWaitEvent(l->stream, l->start, 0);
    if (r != CUDA_SUCCESS) rc = cu_fail(r, "pf_copy_submit", "cuStreamWaitEvent(lane)");
    for (uint32_t g = 0; g < I && rc == PF_OK; g++) {
      uint32_t a, z;
      lane_slice(l->lo[g], l->hi[g], l->w, L, &a, &z);
      if (a < z)
        rc = (l->e->features & PF_FEAT_DMA_BATCH) && cb->path != PF_PATH_DMA
                 ? dma_batch_ranges(ce, b, l->stream, a, z, l->sc)
                 : dma_ranges(b, l->stream, a, z);
      if (rc == PF_OK) {
        r = cu.cuEventRecord(cb->ev[I + g * L + l->w], l->stream);
        if (r != CUDA_SUCCESS) rc = cu_fail(r, "pf_copy_submit", "cuEventRecord(lane)");
      }
      if (rc == PF_OK) atomic_fetch_add_explicit(&cb->issued[g], 1, memory_order_release);
    }
    if (rc == PF_OK) {
      r = cu.cuEventRecord(l->tail, l->stream);
      if (r != CUDA_SUCCESS) rc = cu_fail(r, "pf_copy_submit", "cuEventRecord(lane tail)");
    }
    if (rc < 0) {
      char msg[512];
      pf_last_error(msg, sizeof msg);
      fprintf(stderr, "pegaflow: device %d DMA lane %u: %s\n", l->e->device,
              l->w, msg);
      fail_batch_here(l->e, b, rc);
      int32_t ok = PF_OK;
      atomic_compare_exchange_strong(&cb->status, &ok, rc);
    }
    /* Last touch of the batch: the completion thread frees it only once
     * every lane is done with it. */
    atomic_fetch_sub(&cb->lanes_active, 1);
    pthread_mutex_lock(&l->mu);
    l->rc = rc;
    l->busy = 0;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
  }
}

/* Runs every lane on its slice of [lo[g], hi[g]) for all groups and waits
 * until all have issued their copies; then the main stream waits for the
 * lanes, so later batches queue behind this one. */
static int32_t lanes_run(cuda_engine *ce, pf_batch *b, const uint32_t *lo,
                         const uint32_t *hi, int *handed_off) {
  cuda_batch *cb = b->impl;
  const uint32_t L = cb->lanes;
  CUevent start = cb->ev[cb->nev - 1];
  CU_TRY("pf_copy_submit", cu.cuEventRecord(start, ce->stream));
  atomic_store(&cb->lanes_active, (int)L);
  for (uint32_t w = 0; w < L; w++) {
    dma_lane *l = &ce->lanes[w];
    pthread_mutex_lock(&l->mu);
    l->b = b;
    l->lo = lo;
    l->hi = hi;
    l->start = start;
    l->rc = PF_OK;
    l->busy = 1;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
  }
  /* Everything on the main stream is issued; the completion thread may
   * start reporting groups while the lanes work (see cuda_batch.issued). */
  completion_push(ce, b);
  *handed_off = 1; /* from here on b belongs to the completion thread */
  int32_t rc = PF_OK;
  for (uint32_t w = 0; w < L; w++) {
    dma_lane *l = &ce->lanes[w];
    pthread_mutex_lock(&l->mu);
    while (l->busy) pthread_cond_wait(&l->cv, &l->mu);
    if (l->rc < 0 && rc == PF_OK)
      rc = pf_fail(l->rc, "pf_copy_submit: DMA lane %u failed (see stderr)", w);
    pthread_mutex_unlock(&l->mu);
  }
  /* Later batches queue behind this one's lanes (the lanes' own tail
   * events: the batch itself may already be reported and freed). */
  for (uint32_t w = 0; w < L && rc == PF_OK; w++) {
    CUresult r = cu.cuStreamWaitEvent(ce->stream, ce->lanes[w].tail, 0);
    if (r != CUDA_SUCCESS) rc = cu_fail(r, "pf_copy_submit", "cuStreamWaitEvent");
  }
  return rc;
}

/* Enqueues batch b (submitter thread). KERNEL: table + one launch per
 * group on the main stream. DMA / DMA_BATCH: the lanes. MIXED: kernels for
 * the kernel part first (the SMs start at once), then the lanes issue the
 * copy-engine part; the two never wait for each other inside the batch,
 * and group g is done when its main event and all its lane events fired. */
static int32_t enqueue_batch(pf_engine *e, cuda_engine *ce, pf_batch *b,
                             int *handed_off) {
  cuda_batch *cb = b->impl;
  const uint32_t G = b->num_groups, path = cb->path;
  uint32_t *idx = malloc(3 * (size_t)G * sizeof *idx);
  if (!idx) return pf_fail(PF_ENOMEM, "pf_copy_submit: out of memory");
  uint32_t *lo = idx, *mid = idx + G, *hi = idx + 2 * G;
  for (uint32_t g = 0; g < G; g++) {
    lo[g] = mid[g] = b->groups[g].first_range;
    hi[g] = lo[g] + b->groups[g].num_ranges;
  }
  /* Issued whole: the groups tile the ranges in order, so one span. */
  if (cb->ig == 1) hi[0] = hi[G - 1];
  int32_t rc = PF_OK;
  kernel_plan kp = {0, 0, NULL};
  if (path == PF_PATH_MIXED)
    split_mixed(b, e->dma_share ? e->dma_share : e->default_dma_share, lo, mid, hi);
  if (path == PF_PATH_KERNEL || path == PF_PATH_MIXED) {
    const uint32_t *klo = path == PF_PATH_MIXED ? mid : lo;
    rc = kernel_prepare(ce, b, cb, klo, hi, &kp);
    for (uint32_t g = 0; g < G && rc == PF_OK; g++) {
      rc = kernel_launch(e, ce, &kp, g);
      if (rc == PF_OK) {
        CUresult r = cu.cuEventRecord(cb->ev[g], ce->stream);
        if (r != CUDA_SUCCESS) rc = cu_fail(r, "pf_copy_submit", "cuEventRecord");
      }
    }
  } else {
    /* The lanes carry all bytes; main-stream group events only order. */
    for (uint32_t g = 0; g < cb->ig && rc == PF_OK; g++) {
      CUresult r = cu.cuEventRecord(cb->ev[g], ce->stream);
      if (r != CUDA_SUCCESS) rc = cu_fail(r, "pf_copy_submit", "cuEventRecord");
    }
  }
  if (rc == PF_OK && cb->lanes)
    rc = lanes_run(ce, b, lo, path == PF_PATH_MIXED ? mid : hi, handed_off);
  free(kp.first);
  free(idx);
  return rc;
}

static void *submitter_main(void *arg) {
  pf_engine *e = arg;
  cuda_engine *ce = e->impl;
  pthread_setname_np(pthread_self(), "pf-cu-submit");
  cu_thread_engine = e;
  cu.cuCtxSetCurrent(ce->ctx);
  for (;;) {
    pthread_mutex_lock(&ce->mu);
    while (!ce->sstop && !ce->sq_head) pthread_cond_wait(&ce->scv, &ce->mu);
    if (!ce->sq_head) {
      pthread_mutex_unlock(&ce->mu);
      break;
    }
    pf_batch *b = ce->sq_head;
    ce->sq_head = b->next;
    if (!ce->sq_head) ce->sq_tail = NULL;
    pthread_mutex_unlock(&ce->mu);
    cuda_batch *cb = b->impl;
    if (atomic_load_explicit(&e->failed, memory_order_relaxed)) {
      /* The device is gone: nothing is issued (so nothing to drain), the
       * batch fails naming it. */
      cb->drained = 1;
      atomic_store(&cb->status, pf_batch_fail_device(b, 0));
      completion_push(ce, b);
      continue;
    }
    uint64_t t0 = pf_now_ns();
    /* Copied now: once handed off, b may be freed at any moment. */
    unsigned long long tag = b->tag;
    uint32_t path = cb->path, nranges = b->num_ranges;
    int handed_off = 0;
    int32_t rc = enqueue_batch(e, ce, b, &handed_off);
    if (ce->debug)
      fprintf(stderr, "pegaflow: batch %llu path %s: %u ranges, queued %.3f ms, "
              "enqueue %.3f ms\n", tag, path_name[path], nranges,
              (t0 - b->submit_ns) / 1e6, (pf_now_ns() - t0) / 1e6);
    if (handed_off) {
      /* A lane failure already marked the batch failed; the completion
       * thread drains the streams and reports it. */
      if (rc < 0) {
        char msg[512];
        pf_last_error(msg, sizeof msg);
        fprintf(stderr, "pegaflow: batch %llu (path %s): %s\n", tag,
                path_name[path], msg);
      }
      continue;
    }
    if (rc < 0) {
      /* Work enqueued before the failure still runs: let it finish before
       * the batch is reported (its memory may be closed right after). */
      char msg[512];
      pf_last_error(msg, sizeof msg);
      fprintf(stderr, "pegaflow: device %d batch %llu (path %s) failed: %s\n",
              e->device, (unsigned long long)b->tag, path_name[cb->path], msg);
      fail_batch_here(e, b, rc);
      cu.cuStreamSynchronize(ce->stream);
      for (uint32_t w = 0; w < ce->nlanes; w++)
        cu.cuStreamSynchronize(ce->lanes[w].stream);
      atomic_store(&cb->status, rc);
    }
    completion_push(ce, b);
  }
  return NULL;
}

static int32_t cuda_submit(pf_engine *e, pf_batch *b) {
  cuda_engine *ce = e->impl;
  const uint32_t path = b->path;
  if (path == PF_PATH_HOST)
    return pf_fail(PF_EINVAL, "pf_copy_submit: path 0 (host) on the cuda "
                   "backend; expected 1 kernel, 2 dma_batch, 3 dma or 4 mixed "
                   "(the caller's path policy chooses: lib/copy_path.ts)");
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
  /* One lane per PF_LANE_MIN_RANGES ranges: a small batch is not worth
   * waking several threads for (each lane costs a few events). Large
   * ranges get one lane: the driver's CPU cost is then small next to the
   * transfer, and the copy engines were measured to run several streams of
   * large copies largely one after another, which would hold group 0's
   * completion back until most of the batch had moved (layer-wise load). */
  uint32_t want = b->num_ranges / PF_LANE_MIN_RANGES + 1;
  if (b->num_ranges && b->total_bytes / b->num_ranges >= PF_LANE_MAX_MEAN_RANGE)
    want = 1;
  /* A load (H2D) is consumed layer by layer while it lands: its groups
   * must complete in order. Several lanes interleave every group over
   * streams that the copy engines largely serialize, so groups complete in
   * bursts (measured on the H100: layers 7..31 of a 10K-token load all at
   * the end, the model idle meanwhile); one stream keeps them in order at
   * the same total time for a load's merged ranges. A load consumed only
   * once whole (PF_BATCH_WHOLE: an async load) takes lanes like a save: its
   * scattered 32 KB ranges are issue-bound on one thread. */
  if (b->direction == PF_H2D && !b->whole) want = 1;
  /* A failed device issues nothing and creates no events in its context:
   * the batch only queues, and the submitter fails it naming the device. */
  int dead = atomic_load_explicit(&e->failed, memory_order_relaxed) != 0;
  cb->lanes = path == PF_PATH_KERNEL || dead ? 0 : (want < ce->nlanes ? want : ce->nlanes);
  cb->ig = b->quiet && !b->progress && (path == PF_PATH_DMA || path == PF_PATH_DMA_BATCH)
               ? 1 : b->num_groups;
  size_t nev = dead ? 0 : (size_t)cb->ig * (1 + cb->lanes) + (cb->lanes ? 1 : 0);
  if (nev > UINT32_MAX) nev = 0;
  cb->nev = (uint32_t)nev;
  cb->ev = calloc(nev ? nev : 1, sizeof *cb->ev);
  if (cb->lanes) cb->issued = calloc(cb->ig, sizeof *cb->issued);
  b->impl = cb;
  int32_t rc = cb->ev && (!cb->lanes || cb->issued)
                   ? PF_OK
                   : pf_fail(PF_ENOMEM, "pf_copy_submit: out of memory");
  if (rc == PF_OK && !dead) rc = set_ctx(ce, "pf_copy_submit");
  if (rc == PF_OK && !dead)
    rc = pool_view(e, ce, b->pool, "pf_copy_submit", &cb->pool_dev);
  for (size_t g = 0; g < nev && rc == PF_OK; g++)
    if (!(cb->ev[g] = event_get(ce)))
      rc = pf_fail(PF_ECUDA, "pf_copy_submit: cuEventCreate failed");
  if (rc < 0) {
    cuda_batch_release(ce, b);
    return rc;
  }
  b->next = NULL;
  pthread_mutex_lock(&ce->mu);
  if (ce->sq_tail)
    ce->sq_tail->next = b;
  else
    ce->sq_head = b;
  ce->sq_tail = b;
  pthread_cond_signal(&ce->scv);
  pthread_mutex_unlock(&ce->mu);
  return PF_OK;
}

/* ---- calibration ------------------------------------------------------- */

#define PF_CAL_GROUPS 32u

/* Runs one strided batch through `path`; GB/s or < 0. */
static int32_t time_path(pf_engine *e, pf_pool *p, uint32_t dir, uint32_t path,
                         CUdeviceptr scratch, uint64_t size, uint64_t total,
                         double *gbps) {
  uint64_t nseg = total / size ? total / size : 1;
  if (nseg > UINT32_MAX)
    return pf_fail(PF_EINVAL, "pf_calibrate: %llu segments is too many",
                   (unsigned long long)nseg);
  /* Shaped like a real batch: up to PF_CAL_GROUPS layer groups. */
  uint32_t ng = nseg < PF_CAL_GROUPS ? (uint32_t)nseg : PF_CAL_GROUPS;
  pf_batch *b = pf_batch_alloc(ng, (uint32_t)nseg);
  if (!b) return pf_fail(PF_ENOMEM, "pf_calibrate: out of memory");
  for (uint64_t i = 0; i < nseg; i++)
    b->ranges[i] = (pf_range){scratch + 2 * i * size, i * size, size};
  uint32_t per = (uint32_t)(nseg / ng), first = 0;
  for (uint32_t g = 0; g < ng; g++) {
    uint32_t cnt = g + 1 == ng ? (uint32_t)nseg - first : per;
    b->groups[g] = (pf_group_rt){NULL, g, first, cnt, 0, (uint64_t)cnt * size};
    first += cnt;
  }
  b->engine = e;
  b->pool = p;
  b->direction = dir;
  b->path = path;
  b->total_bytes = nseg * size;
  pf_batch_waiter w;
  pf_batch_waiter_attach(&w, b);
  uint64_t moved = b->total_bytes;
  atomic_fetch_add(&p->inflight, 1); /* pf_batch_done releases it */
  b->submit_ns = pf_now_ns();
  int32_t rc = cuda_submit(e, b);
  if (rc < 0) {
    atomic_fetch_sub(&p->inflight, 1);
    pf_batch_free(b);
    return rc;
  }
  return pf_batch_waiter_wait(&w, moved, gbps);
}

/* Best of PF_CAL_REPS timed runs after one warm-up. */
#define PF_CAL_REPS 3

static int32_t cuda_calibrate(pf_engine *e, pf_pool *p, uint32_t dir,
                              const uint64_t *sizes, uint32_t n, uint64_t total,
                              double *out) {
  cuda_engine *ce = e->impl;
  int32_t rc = set_ctx(ce, "pf_calibrate");
  if (rc < 0) return rc;
  uint64_t pool_dev = 0;
  rc = pool_view(e, ce, p, "pf_calibrate", &pool_dev);
  if (rc < 0) return rc;
  CUdeviceptr scratch = 0;
  CU_TRY("pf_calibrate", cu.cuMemAlloc_v2(&scratch, 2 * total));
  /* Peak: one contiguous copy of `total`, timed by events on the stream. */
  CUevent a = NULL, z = NULL;
  double peak = 0;
  CUresult r = cu.cuEventCreate(&a, CU_EVENT_DEFAULT);
  if (r == CUDA_SUCCESS) r = cu.cuEventCreate(&z, CU_EVENT_DEFAULT);
  for (int rep = 0; rep <= PF_CAL_REPS && r == CUDA_SUCCESS; rep++) {
    CUdeviceptr host = pool_dev;
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
  static const uint32_t paths[4] = {PF_PATH_KERNEL, PF_PATH_DMA_BATCH,
                                    PF_PATH_DMA, PF_PATH_MIXED};
  static const uint64_t need[4] = {PF_FEAT_KERNEL, PF_FEAT_DMA_BATCH, 0,
                                   PF_FEAT_KERNEL};
  for (uint32_t i = 0; i < n && rc == PF_OK; i++) {
    out[i] = peak;
    for (int k = 0; k < 4 && rc == PF_OK; k++) {
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
      out[(size_t)paths[k] * n + i] = best;
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
    .shared_pool = 1,
};

/* ---- devices ----------------------------------------------------------- */
int32_t pf_cuda_device_count(uint32_t *out_count) {
  pthread_once(&cu_once, cu_load);
  if (cu.load_rc < 0)
    return pf_fail(cu.load_rc, "pf_device_count(cuda): %s", cu.load_msg);
  int n = 0;
  CU_TRY("pf_device_count(cuda)", cu.cuDeviceGetCount(&n));
  *out_count = n > 0 ? (uint32_t)n : 0;
  return PF_OK;
}

int32_t pf_cuda_numa_node(int32_t device, int32_t *out_node) {
  uint32_t count = 0;
  int32_t rc = pf_cuda_device_count(&count);
  if (rc < 0) return rc;
  if ((uint32_t)device >= count)
    return pf_fail(PF_ENODEV, "pf_device_numa_node: device %d; this machine "
                   "has %u CUDA devices", device, count);
  CUdevice d = 0;
  CU_TRY("pf_device_numa_node", cu.cuDeviceGet(&d, device));
  char bus[32] = {0};
  CU_TRY("pf_device_numa_node", cu.cuDeviceGetPCIBusId(bus, (int)sizeof bus - 1, d));
  /* The driver writes "0000:3B:00.0"; sysfs names it in lower case. */
  for (char *c = bus; *c; c++)
    if (*c >= 'A' && *c <= 'F') *c = (char)(*c - 'A' + 'a');
  char path[96];
  snprintf(path, sizeof path, "/sys/bus/pci/devices/%s/numa_node", bus);
  FILE *f = fopen(path, "r");
  long node = -1;
  if (f) {
    if (fscanf(f, "%ld", &node) != 1) node = -1;
    fclose(f);
  }
  *out_node = node >= 0 && node < INT32_MAX ? (int32_t)node : -1;
  return PF_OK;
}
