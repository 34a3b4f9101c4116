/*
 * pf_engine.c — the backend-neutral half of the ABI: engines, pools,
 * regions and batch submission.
 *
 * Everything a caller passes in is checked here, once, before any backend
 * sees it: handles are resolved, every segment of a batch is bounds-checked
 * with overflow-safe arithmetic, and only a fully valid batch is handed to
 * the backend (a batch with one bad segment copies nothing). The backend
 * then only moves bytes and reports completions through pf_batch_group_done
 * and pf_batch_done, which live here so both backends report identically.
 *
 * Lifetime: regions, pools and progress shms count the batches that still
 * use them (inflight); close/destroy fails with PF_EBUSY while that count
 * is non-zero. pf_objects_mu makes "resolve handle + count" in submit atomic
 * with "check count + retire handle" in close.
 */
#define _GNU_SOURCE
#include "pf_internal.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

pthread_mutex_t pf_objects_mu = PTHREAD_MUTEX_INITIALIZER;

static const char *const dir_name[] = {"D2H", "H2D"};

uint64_t pf_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- engine ------------------------------------------------------------ */
static int32_t engine_try(const pf_backend_ops *ops, int32_t backend,
                          int32_t device, uint32_t workers, pf_engine **out) {
  pf_engine *e = calloc(1, sizeof *e);
  if (!e) return pf_fail(PF_ENOMEM, "pf_engine_open: out of memory");
  e->ops = ops;
  e->backend = backend;
  e->device = device;
  pthread_mutex_init(&e->fail_mu, NULL);
  int32_t rc = ops->open(e, device, workers);
  if (rc < 0) {
    pthread_mutex_destroy(&e->fail_mu);
    free(e);
    return rc;
  }
  *out = e;
  return PF_OK;
}

int32_t pf_engine_open(int32_t backend, int32_t device, uint32_t workers,
                       uint32_t *out_engine) {
  if (!out_engine)
    return pf_fail(PF_EINVAL, "pf_engine_open: out_engine is NULL");
  if (backend != PF_BACKEND_AUTO && backend != PF_BACKEND_CUDA &&
      backend != PF_BACKEND_HOST)
    return pf_fail(PF_EINVAL,
                   "pf_engine_open: backend %d is not one of 0 (auto), "
                   "1 (cuda), 2 (host)", backend);
  if (device < 0)
    return pf_fail(PF_EINVAL, "pf_engine_open: device %d is negative", device);
  pf_engine *e = NULL;
  int32_t rc;
  if (backend == PF_BACKEND_HOST) {
    rc = engine_try(&pf_host_ops, PF_BACKEND_HOST, device, workers, &e);
  } else {
    rc = engine_try(&pf_cuda_ops, PF_BACKEND_CUDA, device, workers, &e);
    /* AUTO falls back to host only when there is no usable GPU at all;
     * a real CUDA failure on a present GPU is reported, not hidden. */
    if (rc == PF_ENODEV && backend == PF_BACKEND_AUTO)
      rc = engine_try(&pf_host_ops, PF_BACKEND_HOST, device, workers, &e);
  }
  if (rc < 0) return rc;
  /* Client mappings (regions, load states) come after an engine: from here
   * on a client that shrinks one fails its own batch, not this process. */
  rc = pf_guard_init();
  if (rc < 0) {
    e->ops->close(e);
    free(e);
    return rc;
  }
  uint32_t h = pf_handle_new(PF_K_ENGINE, e);
  if (!h) {
    e->ops->close(e);
    free(e);
    return PF_ENOMEM;
  }
  e->handle = h;
  *out_engine = h;
  return PF_OK;
}

/* The offsets drawn in pegaflow.h are what ffi/structs.ts reads. */
_Static_assert(sizeof(pf_engine_props) == 104, "pf_engine_props layout");
_Static_assert(offsetof(pf_engine_props, has_kernel) == 28, "pf_engine_props layout");
_Static_assert(offsetof(pf_engine_props, device_mem_bytes) == 32, "pf_engine_props layout");
_Static_assert(offsetof(pf_engine_props, device_name) == 40, "pf_engine_props layout");

int32_t pf_engine_info(uint32_t engine, pf_engine_props *out) {
  pf_engine *e = pf_handle_get(engine, PF_K_ENGINE, "pf_engine_info");
  if (!e) return PF_EHANDLE;
  if (!out) return pf_fail(PF_EINVAL, "pf_engine_info: out is NULL");
  memset(out, 0, sizeof *out);
  out->backend = (uint32_t)e->backend;
  out->device = e->device;
  out->abi_version = PF_ABI_VERSION;
  out->driver_version = e->driver_version;
  out->sm_count = e->sm_count;
  out->kernel_grid = e->grid_blocks ? e->grid_blocks : e->default_grid;
  out->kernel_variant = e->kernel_variant;
  out->has_kernel = (e->features & PF_FEAT_KERNEL) != 0;
  out->has_dma_batch = (e->features & PF_FEAT_DMA_BATCH) != 0;
  out->has_ipc = (e->features & PF_FEAT_IPC) != 0;
  out->device_mem_bytes = e->device_mem_bytes;
  memcpy(out->device_name, e->device_name, sizeof out->device_name);
  out->device_name[sizeof out->device_name - 1] = 0;
  return PF_OK;
}

/* A grid larger than this many blocks per SM would only queue. */
#define PF_MAX_GRID_PER_SM 32u

int32_t pf_engine_set_kernel_grid(uint32_t engine, uint32_t blocks) {
  pf_engine *e = pf_handle_get(engine, PF_K_ENGINE, "pf_engine_set_kernel_grid");
  if (!e) return PF_EHANDLE;
  if (!(e->features & PF_FEAT_KERNEL))
    return pf_fail(PF_EUNSUPPORTED,
                   "pf_engine_set_kernel_grid: engine %u (%s backend) has no "
                   "copy kernel", engine, e->ops->name);
  uint32_t max = e->sm_count * PF_MAX_GRID_PER_SM;
  if (blocks > max)
    return pf_fail(PF_EINVAL,
                   "pf_engine_set_kernel_grid: %u blocks; expected 0 (default "
                   "%u) .. %u (%u SMs x %u)", blocks, e->default_grid, max,
                   e->sm_count, PF_MAX_GRID_PER_SM);
  e->grid_blocks = blocks;
  return PF_OK;
}

int32_t pf_engine_set_dma_share(uint32_t engine, uint32_t permille) {
  pf_engine *e = pf_handle_get(engine, PF_K_ENGINE, "pf_engine_set_dma_share");
  if (!e) return PF_EHANDLE;
  if (!(e->features & PF_FEAT_KERNEL))
    return pf_fail(PF_EUNSUPPORTED,
                   "pf_engine_set_dma_share: engine %u (%s backend) has no "
                   "mixed path", engine, e->ops->name);
  if (permille > 1000)
    return pf_fail(PF_EINVAL, "pf_engine_set_dma_share: %u permille; expected "
                   "0 (default %u) .. 1000", permille, e->default_dma_share);
  e->dma_share = permille;
  return PF_OK;
}

void pf_engine_mark_failed(pf_engine *e, int32_t code, const char *why) {
  pthread_mutex_lock(&e->fail_mu);
  if (atomic_load(&e->failed) == 0) {
    snprintf(e->fail_text, sizeof e->fail_text, "%s", why);
    atomic_store(&e->failed, code < 0 ? code : PF_EIO);
  }
  pthread_mutex_unlock(&e->fail_mu);
}

int32_t pf_batch_fail_device(pf_batch *b, uint32_t g) {
  pf_engine *e = b->engine;
  int32_t code = atomic_load(&e->failed);
  /* fail_text is written before `failed` and never again. */
  return pf_batch_fail(b, code,
                       "group %u (layer %u): device %d failed (status %d: %s): "
                       "this device's copies are refused; other devices keep "
                       "serving", g, b->groups[g].layer, e->device, code,
                       e->fail_text);
}

int32_t pf_engine_fail(uint32_t engine, int32_t code) {
  pf_engine *e = pf_handle_get(engine, PF_K_ENGINE, "pf_engine_fail");
  if (!e) return PF_EHANDLE;
  pf_engine_mark_failed(e, code, "set by pf_engine_fail");
  return PF_OK;
}

int32_t pf_device_count(int32_t backend, uint32_t *out_count) {
  if (!out_count) return pf_fail(PF_EINVAL, "pf_device_count: out_count is NULL");
  if (backend == PF_BACKEND_HOST) {
    *out_count = 0;
    return PF_OK;
  }
  if (backend != PF_BACKEND_CUDA && backend != PF_BACKEND_AUTO)
    return pf_fail(PF_EINVAL, "pf_device_count: backend %d is not one of 0 "
                   "(auto), 1 (cuda), 2 (host)", backend);
  int32_t rc = pf_cuda_device_count(out_count);
  if (rc == PF_ENODEV && backend == PF_BACKEND_AUTO) {
    *out_count = 0;
    return PF_OK;
  }
  return rc;
}

int32_t pf_device_numa_node(int32_t backend, int32_t device, int32_t *out_node) {
  if (!out_node) return pf_fail(PF_EINVAL, "pf_device_numa_node: out_node is NULL");
  if (device < 0)
    return pf_fail(PF_EINVAL, "pf_device_numa_node: device %d is negative", device);
  *out_node = -1;
  if (backend == PF_BACKEND_HOST) return PF_OK;
  if (backend != PF_BACKEND_CUDA && backend != PF_BACKEND_AUTO)
    return pf_fail(PF_EINVAL, "pf_device_numa_node: backend %d is not one of "
                   "0 (auto), 1 (cuda), 2 (host)", backend);
  int32_t rc = pf_cuda_numa_node(device, out_node);
  if (rc == PF_ENODEV && backend == PF_BACKEND_AUTO) return PF_OK;
  return rc;
}

int32_t pf_engine_close(uint32_t engine) {
  pthread_mutex_lock(&pf_objects_mu);
  pf_engine *e = pf_handle_get(engine, PF_K_ENGINE, "pf_engine_close");
  if (!e) {
    pthread_mutex_unlock(&pf_objects_mu);
    return PF_EHANDLE;
  }
  int live = atomic_load(&e->live_objects);
  if (live > 0) {
    pthread_mutex_unlock(&pf_objects_mu);
    return pf_fail(PF_EBUSY,
                   "pf_engine_close: engine %u still has %d pools/regions; "
                   "close them first", engine, live);
  }
  pf_handle_free(engine);
  pthread_mutex_unlock(&pf_objects_mu);
  e->ops->close(e);
  pthread_mutex_destroy(&e->fail_mu);
  free(e);
  return PF_OK;
}

/* ---- pool -------------------------------------------------------------- */
/* Checks the parts of a split pool (sizes; page alignment is checked by
 * pf_hostmem_alloc, which knows the page size it maps with). */
static int32_t parts_check(uint64_t bytes, const pf_pool_part *parts,
                           uint32_t nparts) {
  if (nparts == 0) return PF_OK;
  if (!parts) return pf_fail(PF_EINVAL, "pf_pool_create_split: parts is NULL");
  if (nparts > PF_POOL_PARTS_MAX)
    return pf_fail(PF_EINVAL, "pf_pool_create_split: %u parts; expected at "
                   "most %u", nparts, PF_POOL_PARTS_MAX);
  uint64_t sum = 0;
  for (uint32_t i = 0; i < nparts; i++) {
    if (parts[i].bytes == 0 || parts[i].reserved != 0 || parts[i].node < -1)
      return pf_fail(PF_EINVAL, "pf_pool_create_split: part %u: bytes %llu, "
                     "node %d, reserved %u (expected bytes > 0, node >= -1, "
                     "reserved 0)", i, (unsigned long long)parts[i].bytes,
                     parts[i].node, parts[i].reserved);
    if (parts[i].bytes > UINT64_MAX - sum)
      return pf_fail(PF_EINVAL, "pf_pool_create_split: part sizes overflow");
    sum += parts[i].bytes;
  }
  if (sum != bytes)
    return pf_fail(PF_EINVAL, "pf_pool_create_split: parts sum to %llu bytes; "
                   "the pool is %llu", (unsigned long long)sum,
                   (unsigned long long)bytes);
  return PF_OK;
}

/* Looks `engine` up and counts the object about to be made on it
 * (`live_objects`) under pf_objects_mu: a pf_engine_close racing a creation
 * that runs off the JS thread (pf_pool_create pre-touching tens of GiB) then
 * fails with PF_EBUSY instead of freeing the engine under it. The count is
 * given back (engine_unhold) when the creation fails, else kept by the object. */
static pf_engine *engine_hold(uint32_t engine, const char *fn) {
  pthread_mutex_lock(&pf_objects_mu);
  pf_engine *e = pf_handle_get(engine, PF_K_ENGINE, fn);
  if (e) atomic_fetch_add(&e->live_objects, 1);
  pthread_mutex_unlock(&pf_objects_mu);
  return e;
}

static int32_t engine_unhold(pf_engine *e, int32_t rc) {
  atomic_fetch_sub(&e->live_objects, 1);
  return rc;
}

static int32_t pool_create_held(pf_engine *e, uint64_t bytes, uint32_t flags,
                                uint32_t touch_threads, pf_pool_progress *progress,
                                const pf_pool_part *parts, uint32_t nparts,
                                uint32_t *out_pool);

static int32_t pool_create(uint32_t engine, uint64_t bytes, uint32_t flags,
                           uint32_t touch_threads, pf_pool_progress *progress,
                           const pf_pool_part *parts, uint32_t nparts,
                           uint32_t *out_pool) {
  if (!out_pool) return pf_fail(PF_EINVAL, "pf_pool_create: out_pool is NULL");
  pf_engine *e = engine_hold(engine, "pf_pool_create");
  if (!e) return PF_EHANDLE;
  int32_t rc = pool_create_held(e, bytes, flags, touch_threads, progress, parts, nparts,
                                out_pool);
  return rc < 0 ? engine_unhold(e, rc) : rc;
}

static int32_t pool_create_held(pf_engine *e, uint64_t bytes, uint32_t flags,
                                uint32_t touch_threads, pf_pool_progress *progress,
                                const pf_pool_part *parts, uint32_t nparts,
                                uint32_t *out_pool) {
  if (bytes == 0) return pf_fail(PF_EINVAL, "pf_pool_create: bytes is 0");
  if (flags & ~(uint32_t)(PF_POOL_HUGEPAGES | PF_POOL_PRETOUCH))
    return pf_fail(PF_EINVAL,
                   "pf_pool_create: unknown flag bits 0x%x (expected "
                   "HUGEPAGES=1, PRETOUCH=2)", flags);
  int32_t rc = parts_check(bytes, parts, nparts);
  if (rc < 0) return rc;
  pf_pool *p = calloc(1, sizeof *p);
  if (!p) return pf_fail(PF_ENOMEM, "pf_pool_create: out of memory");
  p->engine = e;
  p->bytes = bytes;
  p->flags = flags;
  p->touch_threads = touch_threads;
  p->progress = progress;
  p->parts = parts;
  p->nparts = nparts;
  pf_pool_phase(p, PF_POOL_PHASE_MAP);
  rc = e->ops->pool_alloc(e, p);
  if (rc < 0) {
    free(p);
    return rc;
  }
  pf_pool_phase(p, PF_POOL_PHASE_DONE);
  /* The caller's memory is borrowed for this call. */
  p->progress = NULL;
  p->parts = NULL;
  uint32_t h = pf_handle_new(PF_K_POOL, p);
  if (!h) {
    e->ops->pool_free(e, p);
    free(p);
    return PF_ENOMEM;
  }
  p->handle = h; /* the engine's live_objects counts it since engine_hold */
  *out_pool = h;
  return PF_OK;
}

int32_t pf_pool_create(uint32_t engine, uint64_t bytes, uint32_t flags,
                       uint32_t touch_threads, pf_pool_progress *progress,
                       uint32_t *out_pool) {
  return pf_pool_create_split(engine, bytes, flags, touch_threads, progress,
                              NULL, 0, out_pool);
}

int32_t pf_pool_create_split(uint32_t engine, uint64_t bytes, uint32_t flags,
                             uint32_t touch_threads, pf_pool_progress *progress,
                             const pf_pool_part *parts, uint32_t nparts,
                             uint32_t *out_pool) {
  if (progress) progress->error[0] = 0;
  int32_t rc = pool_create(engine, bytes, flags, touch_threads, progress,
                           parts, nparts, out_pool);
  if (rc < 0 && progress)
    pf_last_error(progress->error, sizeof progress->error);
  return rc;
}

void *pf_pool_ptr(uint32_t pool) {
  pf_pool *p = pf_handle_get(pool, PF_K_POOL, "pf_pool_ptr");
  return p ? p->host : NULL;
}

_Static_assert(sizeof(pf_pool_props) == 32, "pf_pool_props layout");
_Static_assert(offsetof(pf_pool_props, hugepages) == 24, "pf_pool_props layout");

int32_t pf_pool_info(uint32_t pool, pf_pool_props *out) {
  pf_pool *p = pf_handle_get(pool, PF_K_POOL, "pf_pool_info");
  if (!p) return PF_EHANDLE;
  if (!out) return pf_fail(PF_EINVAL, "pf_pool_info: out is NULL");
  memset(out, 0, sizeof *out);
  out->bytes = p->bytes;
  out->alloc_ns = p->alloc_ns;
  out->huge_page_bytes = p->huge_page_bytes;
  out->hugepages = (p->applied & PF_POOL_HUGEPAGES) != 0;
  out->pretouched = (p->applied & PF_POOL_PRETOUCH) != 0;
  out->locked = (p->applied & PF_POOL_LOCKED) != 0;
  return PF_OK;
}

pf_pool *pf_pool_hold(uint32_t pool, const char *fn) {
  pthread_mutex_lock(&pf_objects_mu);
  pf_pool *p = pf_handle_get(pool, PF_K_POOL, fn);
  if (p) atomic_fetch_add(&p->inflight, 1);
  pthread_mutex_unlock(&pf_objects_mu);
  return p;
}

void pf_pool_unhold(pf_pool *p) { atomic_fetch_sub(&p->inflight, 1); }

int32_t pf_pool_destroy(uint32_t pool) {
  pthread_mutex_lock(&pf_objects_mu);
  pf_pool *p = pf_handle_get(pool, PF_K_POOL, "pf_pool_destroy");
  if (!p) {
    pthread_mutex_unlock(&pf_objects_mu);
    return PF_EHANDLE;
  }
  int n = atomic_load(&p->inflight);
  if (n > 0) {
    pthread_mutex_unlock(&pf_objects_mu);
    return pf_fail(PF_EBUSY,
                   "pf_pool_destroy: pool %u has %d batches in flight; wait "
                   "for their completions first", pool, n);
  }
  pf_handle_free(pool);
  pthread_mutex_unlock(&pf_objects_mu);
  p->engine->ops->pool_free(p->engine, p);
  atomic_fetch_sub(&p->engine->live_objects, 1);
  free(p);
  return PF_OK;
}

/* ---- regions ----------------------------------------------------------- */
static int32_t region_finish(pf_engine *e, pf_region *r, uint32_t *out) {
  uint32_t h = pf_handle_new(PF_K_REGION, r);
  if (!h) {
    e->ops->region_close(e, r);
    free(r);
    return PF_ENOMEM;
  }
  r->handle = h; /* the engine's live_objects counts it since engine_hold */
  *out = h;
  return PF_OK;
}

int32_t pf_region_alloc(uint32_t engine, uint64_t bytes, uint8_t *out_handle,
                        uint32_t *out_region) {
  if (!out_handle || !out_region)
    return pf_fail(PF_EINVAL, "pf_region_alloc: out_handle/out_region is NULL");
  if (bytes == 0) return pf_fail(PF_EINVAL, "pf_region_alloc: bytes is 0");
  pf_engine *e = engine_hold(engine, "pf_region_alloc");
  if (!e) return PF_EHANDLE;
  pf_region *r = calloc(1, sizeof *r);
  if (!r) return engine_unhold(e, pf_fail(PF_ENOMEM, "pf_region_alloc: out of memory"));
  r->engine = e;
  r->bytes = bytes;
  int32_t rc = e->ops->region_alloc(e, r, r->name);
  if (rc < 0) {
    free(r);
    return engine_unhold(e, rc);
  }
  memcpy(out_handle, r->name, PF_HANDLE_BYTES);
  rc = region_finish(e, r, out_region);
  return rc < 0 ? engine_unhold(e, rc) : rc;
}

int32_t pf_region_import(uint32_t engine, const uint8_t *handle, uint64_t bytes,
                         uint32_t *out_region) {
  if (!handle || !out_region)
    return pf_fail(PF_EINVAL, "pf_region_import: handle/out_region is NULL");
  if (bytes == 0) return pf_fail(PF_EINVAL, "pf_region_import: bytes is 0");
  pf_engine *e = engine_hold(engine, "pf_region_import");
  if (!e) return PF_EHANDLE;
  pf_region *r = calloc(1, sizeof *r);
  if (!r) return engine_unhold(e, pf_fail(PF_ENOMEM, "pf_region_import: out of memory"));
  r->engine = e;
  r->bytes = bytes;
  r->imported = 1;
  memcpy(r->name, handle, PF_HANDLE_BYTES);
  int32_t rc = e->ops->region_import(e, r, handle);
  if (rc < 0) {
    free(r);
    return engine_unhold(e, rc);
  }
  rc = region_finish(e, r, out_region);
  return rc < 0 ? engine_unhold(e, rc) : rc;
}

_Static_assert(sizeof(pf_region_props) == 24, "pf_region_props layout");
_Static_assert(offsetof(pf_region_props, imported) == 16, "pf_region_props layout");

int32_t pf_region_info(uint32_t region, pf_region_props *out) {
  pf_region *r = pf_handle_get(region, PF_K_REGION, "pf_region_info");
  if (!r) return PF_EHANDLE;
  if (!out) return pf_fail(PF_EINVAL, "pf_region_info: out is NULL");
  out->bytes = r->bytes;
  out->addr = r->addr;
  out->imported = r->imported ? 1u : 0u;
  out->inflight = (uint32_t)atomic_load(&r->inflight);
  return PF_OK;
}

static int32_t region_rw(const char *fn, uint32_t region, uint64_t offset,
                         void *buf, uint64_t bytes, int write) {
  pf_region *r = pf_handle_get(region, PF_K_REGION, fn);
  if (!r) return PF_EHANDLE;
  if (!buf && bytes) return pf_fail(PF_EINVAL, "%s: buffer is NULL", fn);
  if (offset > r->bytes || bytes > r->bytes - offset)
    return pf_fail(PF_ERANGE,
                   "%s: region %u: offset %llu + bytes %llu exceeds region "
                   "size %llu", fn, region, (unsigned long long)offset,
                   (unsigned long long)bytes, (unsigned long long)r->bytes);
  if (bytes == 0) return PF_OK;
  return r->engine->ops->region_rw(r->engine, r, offset, buf, bytes, write);
}

int32_t pf_region_write(uint32_t region, uint64_t offset, const void *src,
                        uint64_t bytes) {
  return region_rw("pf_region_write", region, offset, (void *)src, bytes, 1);
}

int32_t pf_region_read(uint32_t region, uint64_t offset, void *dst,
                       uint64_t bytes) {
  return region_rw("pf_region_read", region, offset, dst, bytes, 0);
}

int32_t pf_region_close(uint32_t region) {
  pthread_mutex_lock(&pf_objects_mu);
  pf_region *r = pf_handle_get(region, PF_K_REGION, "pf_region_close");
  if (!r) {
    pthread_mutex_unlock(&pf_objects_mu);
    return PF_EHANDLE;
  }
  int n = atomic_load(&r->inflight);
  if (n > 0) {
    pthread_mutex_unlock(&pf_objects_mu);
    return pf_fail(PF_EBUSY,
                   "pf_region_close: region %u has %d layer groups in flight; "
                   "drain them before closing (unmapping under a queued copy "
                   "corrupts memory)", region, n);
  }
  pf_handle_free(region);
  pthread_mutex_unlock(&pf_objects_mu);
  r->engine->ops->region_close(r->engine, r);
  atomic_fetch_sub(&r->engine->live_objects, 1);
  free(r);
  return PF_OK;
}

/* ---- batches ----------------------------------------------------------- */
pf_batch *pf_batch_alloc(uint32_t num_groups, uint32_t num_ranges) {
  pf_batch *b = calloc(1, sizeof *b);
  if (!b) return NULL;
  b->groups = calloc(num_groups ? num_groups : 1, sizeof *b->groups);
  b->ranges = malloc((num_ranges ? num_ranges : 1) * sizeof *b->ranges);
  if (!b->groups || !b->ranges) {
    pf_batch_free(b);
    return NULL;
  }
  b->num_groups = num_groups;
  b->num_ranges = num_ranges;
  return b;
}

void pf_batch_free(pf_batch *b) {
  if (!b) return;
  free(b->groups);
  free(b->ranges);
  free(b);
}

static void batch_waiter_done(void *arg, int32_t status, uint64_t ns) {
  pf_batch_waiter *w = arg;
  pthread_mutex_lock(&w->mu);
  w->done = 1;
  w->status = status;
  w->ns = ns;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

void pf_batch_waiter_attach(pf_batch_waiter *w, pf_batch *b) {
  *w = (pf_batch_waiter){PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                         0, 0, 0};
  b->on_done = batch_waiter_done;
  b->on_done_arg = w;
}

int32_t pf_batch_waiter_wait(pf_batch_waiter *w, uint64_t moved, double *gbps) {
  pthread_mutex_lock(&w->mu);
  while (!w->done) pthread_cond_wait(&w->cv, &w->mu);
  pthread_mutex_unlock(&w->mu);
  *gbps = w->ns ? (double)moved / (double)w->ns : 0;
  return w->status;
}

static void post(pf_batch *b, uint32_t kind, uint32_t index, int32_t status,
                 uint32_t aux, uint64_t value) {
  if (!b->ring) return;
  pf_completion c = {.tag = b->tag, .kind = kind, .index = index,
                     .status = status, .aux = aux, .value = value};
  /* A shut-down ring drops the record; the copy itself has finished and
   * the accounting below still runs, so nothing leaks. */
  (void)pf_ring_post(b->ring, &c);
}

int32_t pf_batch_fail(pf_batch *b, int32_t status, const char *fmt, ...) {
  int32_t none = 0;
  if (!atomic_compare_exchange_strong(&b->fail_status, &none, status))
    return status;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(b->fail_text, sizeof b->fail_text, fmt, ap);
  va_end(ap);
  return status;
}

/* Stores a progress word into the client's load-state shm, guarded: the
 * client may have shrunk the object since it was opened. */
static int32_t progress_store(pf_batch *b, uint32_t off, uint32_t value,
                              const char *what) {
  uint64_t fault = 0;
  if (b->progress_gone) return PF_EFAULT;
  int32_t rc = pf_guard_store_u32(b->progress->ptr + off, value, &fault);
  if (rc < 0) {
    b->progress_gone = 1;
    pf_batch_fail(b, rc,
                  "progress words: shm %u (\"%s\", %llu bytes mapped) faulted "
                  "at offset %u writing %s: the load-state object was shrunk "
                  "after it was opened", b->progress->handle, b->progress->name,
                  (unsigned long long)b->progress->bytes, off, what);
  }
  return rc;
}

/* Order matters in both functions below: every counter a record lets the
 * consumer act on is released before that record is posted, so a consumer
 * that reacts to a record by closing the region/pool/ring never sees a
 * spurious PF_EBUSY. The bytes have landed by then; nothing touches the
 * released object afterwards. */
void pf_batch_group_done(pf_batch *b, uint32_t g, int32_t status) {
  pf_group_rt *gr = &b->groups[g];
  /* Progress is a prefix: once a group failed, later groups are not
   * reported as landed even when their bytes did. */
  if (status == PF_OK && b->posted_fail) status = PF_ECANCELED;
  if (b->progress && status == PF_OK)
    status = progress_store(b, b->progress_off, g + 1, "layers_ready");
  if (status < 0) b->posted_fail = 1;
  if (gr->region) atomic_fetch_sub(&gr->region->inflight, 1);
  if (!b->quiet) post(b, PF_DONE_LAYER, g, status, gr->layer, gr->bytes);
}

void pf_batch_done(pf_batch *b, int32_t status, uint32_t path_used) {
  int32_t failed = atomic_load(&b->fail_status);
  if (status == PF_OK && failed < 0) status = failed;
  if (b->progress) {
    progress_store(b, b->progress_off + 4,
                   (uint32_t)(status == PF_OK ? 1 : status), "state");
    /* A failed batch also reports every group done, after the state: a
     * waiter that watches only the group counter (a GPU stream wait on it)
     * wakes up and then reads the failure. */
    if (status != PF_OK)
      progress_store(b, b->progress_off, b->num_groups, "layers_ready");
    atomic_fetch_sub(&b->progress->inflight, 1);
    failed = atomic_load(&b->fail_status);
    if (status == PF_OK && failed < 0) status = failed;
  }
  if (b->pool) atomic_fetch_sub(&b->pool->inflight, 1);
  uint64_t ns = pf_now_ns() - b->submit_ns;
  if (b->on_done) b->on_done(b->on_done_arg, status, ns);
  if (b->ring) {
    if (status < 0 && b->fail_text[0])
      pf_ring_keep_error(b->ring, b->tag, b->fail_text);
    pf_completion c = {.tag = b->tag, .kind = PF_DONE_BATCH,
                       .index = b->num_groups, .status = status,
                       .aux = path_used, .value = ns};
    /* A shut-down ring drops the record; the release still happens. */
    (void)pf_ring_post_release(b->ring, &c);
  }
  pf_batch_free(b);
}

#define SEG_FMT "group %u (layer %u) segment %u (batch segment %u)"

/* Checks one segment against its region and the pool; overflow-safe. */
static int32_t check_seg(const pf_batch_seg *s, const pf_region *r,
                         const pf_pool *p, uint32_t g, uint32_t layer,
                         uint32_t k, uint32_t idx) {
  if (s->bytes == 0)
    return pf_fail(PF_EINVAL,
                   "pf_copy_submit: " SEG_FMT ": bytes is 0 (expected > 0)",
                   g, layer, k, idx);
  if (s->region_off > r->bytes || s->bytes > r->bytes - s->region_off)
    return pf_fail(PF_ERANGE,
                   "pf_copy_submit: " SEG_FMT ": region_off %llu + bytes %llu "
                   "exceeds region %u size %llu", g, layer, k, idx,
                   (unsigned long long)s->region_off,
                   (unsigned long long)s->bytes, r->handle,
                   (unsigned long long)r->bytes);
  if (s->pool_off > p->bytes || s->bytes > p->bytes - s->pool_off)
    return pf_fail(PF_ERANGE,
                   "pf_copy_submit: " SEG_FMT ": pool_off %llu + bytes %llu "
                   "exceeds pool %u size %llu", g, layer, k, idx,
                   (unsigned long long)s->pool_off,
                   (unsigned long long)s->bytes, p->handle,
                   (unsigned long long)p->bytes);
  return PF_OK;
}

int32_t pf_copy_submit(uint32_t engine, uint32_t pool, uint32_t ring,
                       const void *desc, uint64_t desc_bytes, uint64_t tag) {
  if (!desc) return pf_fail(PF_EINVAL, "pf_copy_submit: desc is NULL");
  if (desc_bytes < sizeof(pf_batch_header))
    return pf_fail(PF_EINVAL,
                   "pf_copy_submit: desc_bytes %llu is smaller than the "
                   "%zu-byte header", (unsigned long long)desc_bytes,
                   sizeof(pf_batch_header));
  if ((uintptr_t)desc & 7u)
    return pf_fail(PF_EINVAL, "pf_copy_submit: desc is not 8-byte aligned");
  const pf_batch_header *h = desc;
  if (h->direction > PF_H2D)
    return pf_fail(PF_EINVAL,
                   "pf_copy_submit: direction %u (expected 0 D2H or 1 H2D)",
                   h->direction);
  if (h->path > PF_PATH_MIXED)
    return pf_fail(PF_EINVAL,
                   "pf_copy_submit: path %u (expected 0 host, 1 kernel, "
                   "2 dma_batch, 3 dma, 4 mixed)", h->path);
  if (h->num_groups == 0)
    return pf_fail(PF_EINVAL, "pf_copy_submit: num_groups is 0");
  if (h->flags & ~(PF_BATCH_WHOLE | PF_BATCH_QUIET))
    return pf_fail(PF_EINVAL, "pf_copy_submit: header.flags 0x%x has unknown "
                   "bits (known: PF_BATCH_WHOLE = 0x1, PF_BATCH_QUIET = 0x2)",
                   h->flags);
  uint64_t groups_end =
      sizeof(pf_batch_header) + (uint64_t)h->num_groups * sizeof(pf_batch_group);
  uint64_t segs_off = h->segs_off ? h->segs_off : groups_end;
  if (segs_off & 7u)
    return pf_fail(PF_EINVAL, "pf_copy_submit: segs_off %llu is not 8-aligned",
                   (unsigned long long)segs_off);
  if (h->segs_off && segs_off < groups_end)
    return pf_fail(PF_EINVAL,
                   "pf_copy_submit: segs_off %llu overlaps groups[%u] (which "
                   "end at %llu)", (unsigned long long)segs_off, h->num_groups,
                   (unsigned long long)groups_end);
  uint64_t need = segs_off + (uint64_t)h->num_segs * sizeof(pf_batch_seg);
  if (groups_end > desc_bytes || need > desc_bytes)
    return pf_fail(PF_EINVAL,
                   "pf_copy_submit: descriptor needs %llu bytes for %u groups "
                   "and %u segments; got desc_bytes %llu",
                   (unsigned long long)(need > groups_end ? need : groups_end),
                   h->num_groups, h->num_segs, (unsigned long long)desc_bytes);
  const pf_batch_group *groups =
      (const pf_batch_group *)((const uint8_t *)desc + sizeof(pf_batch_header));
  const pf_batch_seg *segs =
      (const pf_batch_seg *)((const uint8_t *)desc + segs_off);

  /* Pass 1 (no locks): group tiling and segment counts, so we can size the
   * range array (one range per segment). */
  uint64_t next_seg = 0;
  for (uint32_t g = 0; g < h->num_groups; g++) {
    const pf_batch_group *gd = &groups[g];
    if (gd->num_segs == 0)
      return pf_fail(PF_EINVAL,
                     "pf_copy_submit: group %u (layer %u) has 0 segments",
                     g, gd->layer);
    if (gd->first_seg != next_seg)
      return pf_fail(PF_EINVAL,
                     "pf_copy_submit: group %u (layer %u): first_seg %u, "
                     "expected %llu (groups must tile segs[] in order)",
                     g, gd->layer, gd->first_seg, (unsigned long long)next_seg);
    next_seg += gd->num_segs;
  }
  if (next_seg != h->num_segs)
    return pf_fail(PF_EINVAL,
                   "pf_copy_submit: groups cover %llu segments; header says "
                   "num_segs %u", (unsigned long long)next_seg, h->num_segs);

  pf_batch *b = pf_batch_alloc(h->num_groups, h->num_segs);
  if (!b)
    return pf_fail(PF_ENOMEM, "pf_copy_submit: out of memory for %u groups / "
                   "%u segments", h->num_groups, h->num_segs);
  b->direction = h->direction;
  b->path = h->path;
  b->whole = (h->flags & PF_BATCH_WHOLE) != 0;
  b->quiet = (h->flags & PF_BATCH_QUIET) != 0;
  b->tag = tag;
  b->num_segs = h->num_segs;
  b->progress_off = h->progress_off;

  int32_t rc = PF_OK;
  pthread_mutex_lock(&pf_objects_mu);
  pf_engine *e = pf_handle_get(engine, PF_K_ENGINE, "pf_copy_submit(engine)");
  pf_pool *p = e ? pf_handle_get(pool, PF_K_POOL, "pf_copy_submit(pool)") : NULL;
  pf_ring *rg = p ? pf_handle_get(ring, PF_K_RING, "pf_copy_submit(ring)") : NULL;
  if (!e || !p || !rg) {
    rc = PF_EHANDLE;
    goto fail_locked;
  }
  if (p->engine != e && !(p->engine->ops == e->ops && e->ops->shared_pool)) {
    rc = pf_fail(PF_EINVAL, "pf_copy_submit: pool %u belongs to another "
                 "engine than %u (the %s backend cannot share a pool "
                 "across devices)", pool, engine, e->ops->name);
    goto fail_locked;
  }
  if (pf_ring_is_shutdown(rg)) {
    rc = pf_fail(PF_ESHUTDOWN, "pf_copy_submit: ring %u is shut down", ring);
    goto fail_locked;
  }
  if (h->progress_shm) {
    pf_shm *s = pf_handle_get(h->progress_shm, PF_K_SHM,
                              "pf_copy_submit(progress_shm)");
    if (!s) {
      rc = PF_EHANDLE;
      goto fail_locked;
    }
    if ((h->progress_off & 7u) || (uint64_t)h->progress_off + 8 > s->bytes) {
      rc = pf_fail(PF_ERANGE,
                   "pf_copy_submit: progress_off %u must be 8-aligned with 8 "
                   "bytes inside shm %u of %llu bytes", h->progress_off,
                   h->progress_shm, (unsigned long long)s->bytes);
      goto fail_locked;
    }
    b->progress = s;
  }

  /* Pass 2: resolve regions and check every segment; each becomes one
   * range. Contiguous segments are merged once, by the caller before submit
   * (lib/transfer/ranges.ts builds the batch and knows which segments
   * continue each other without comparing them); the library copies what it
   * is given and splits ranges only where a backend wants shorter pieces. */
  uint32_t nr = 0;
  uint64_t total = 0;
  for (uint32_t g = 0; g < h->num_groups; g++) {
    const pf_batch_group *gd = &groups[g];
    pf_region *r = pf_handle_get(gd->region, PF_K_REGION, "pf_copy_submit");
    if (!r) {
      rc = pf_fail(PF_EHANDLE,
                   "pf_copy_submit: group %u (layer %u): region %u is not a "
                   "live region handle", g, gd->layer, gd->region);
      goto fail_locked;
    }
    if (r->engine != e) {
      rc = pf_fail(PF_EINVAL,
                   "pf_copy_submit: group %u (layer %u): region %u belongs to "
                   "another engine than %u", g, gd->layer, gd->region, engine);
      goto fail_locked;
    }
    pf_group_rt *gr = &b->groups[g];
    gr->region = NULL; /* set once the batch is accepted (inflight) */
    gr->layer = gd->layer;
    gr->first_range = nr;
    uint64_t gbytes = 0;
    for (uint32_t k = 0; k < gd->num_segs; k++) {
      uint32_t idx = gd->first_seg + k;
      const pf_batch_seg *s = &segs[idx];
      rc = check_seg(s, r, p, g, gd->layer, k, idx);
      if (rc < 0) goto fail_locked;
      uint64_t addr = r->addr + s->region_off;
      b->ranges[nr].region_addr = addr;
      b->ranges[nr].pool_off = s->pool_off;
      b->ranges[nr].bytes = s->bytes;
      nr++;
      gbytes += s->bytes;
    }
    gr->num_ranges = nr - gr->first_range;
    gr->bytes = gbytes;
    gr->region = r;
    total += gbytes;
  }
  if (b->progress) {
    /* Reset the progress words last (nothing counted yet, so a fault just
     * refuses the batch): the client may have shrunk the object since it
     * was opened. */
    uint8_t *w = b->progress->ptr + h->progress_off;
    uint64_t fault = 0;
    rc = pf_guard_store_u32(w, 0, &fault);
    if (rc == PF_OK) rc = pf_guard_store_u32(w + 4, 0, &fault);
    if (rc < 0) {
      rc = pf_fail(PF_EFAULT,
                   "pf_copy_submit: progress shm %u (\"%s\", %llu bytes "
                   "mapped) faulted at offset %u: the load-state object was "
                   "shrunk after it was opened", h->progress_shm,
                   b->progress->name, (unsigned long long)b->progress->bytes,
                   h->progress_off);
      goto fail_locked;
    }
  }
  b->num_ranges = nr;
  b->total_bytes = total;
  b->engine = e;
  b->pool = p;
  b->ring = rg;
  /* Accepted: count the batch on everything it touches before the backend
   * can finish it. */
  for (uint32_t g = 0; g < b->num_groups; g++)
    atomic_fetch_add(&b->groups[g].region->inflight, 1);
  atomic_fetch_add(&p->inflight, 1);
  if (b->progress) atomic_fetch_add(&b->progress->inflight, 1);
  pf_ring_acquire(rg);
  pthread_mutex_unlock(&pf_objects_mu);

  b->submit_ns = pf_now_ns();
  rc = e->ops->submit(e, b);
  if (rc < 0) {
    /* Undo the accounting; nothing was queued. */
    pthread_mutex_lock(&pf_objects_mu);
    for (uint32_t g = 0; g < b->num_groups; g++)
      atomic_fetch_sub(&b->groups[g].region->inflight, 1);
    atomic_fetch_sub(&p->inflight, 1);
    if (b->progress) atomic_fetch_sub(&b->progress->inflight, 1);
    pf_ring_release(rg);
    pthread_mutex_unlock(&pf_objects_mu);
    pf_batch_free(b);
    return rc;
  }
  return PF_OK;

fail_locked:
  pthread_mutex_unlock(&pf_objects_mu);
  pf_batch_free(b);
  return rc;
}

int32_t pf_calibrate(uint32_t engine, uint32_t pool, uint32_t direction,
                     const uint64_t *sizes, uint32_t n, uint64_t total_bytes,
                     double *out_gbps) {
  pf_engine *e = pf_handle_get(engine, PF_K_ENGINE, "pf_calibrate");
  if (!e) return PF_EHANDLE;
  pf_pool *p = pf_handle_get(pool, PF_K_POOL, "pf_calibrate");
  if (!p) return PF_EHANDLE;
  if (p->engine != e && !(p->engine->ops == e->ops && e->ops->shared_pool))
    return pf_fail(PF_EINVAL, "pf_calibrate: pool %u belongs to another engine "
                   "(the %s backend cannot share a pool across devices)", pool,
                   e->ops->name);
  if (direction > PF_H2D)
    return pf_fail(PF_EINVAL, "pf_calibrate: direction %u (expected 0 D2H or "
                   "1 H2D)", direction);
  if (!sizes || !out_gbps || n == 0)
    return pf_fail(PF_EINVAL, "pf_calibrate: sizes/out_gbps NULL or n == 0");
  if (total_bytes == 0 || total_bytes > p->bytes)
    return pf_fail(PF_ERANGE,
                   "pf_calibrate: total_bytes %llu must be in [1, pool size "
                   "%llu]", (unsigned long long)total_bytes,
                   (unsigned long long)p->bytes);
  for (uint32_t i = 0; i < n; i++)
    if (sizes[i] == 0 || sizes[i] > total_bytes)
      return pf_fail(PF_EINVAL,
                     "pf_calibrate: sizes[%u] = %llu must be in [1, "
                     "total_bytes %llu]", i, (unsigned long long)sizes[i],
                     (unsigned long long)total_bytes);
  if (atomic_load(&p->inflight) > 0)
    return pf_fail(PF_EBUSY, "pf_calibrate: pool %u has batches in flight",
                   pool);
  (void)dir_name;
  for (uint32_t i = 0; i < 5 * n; i++) out_gbps[i] = 0;
  return e->ops->calibrate(e, p, direction, sizes, n, total_bytes, out_gbps);
}
