/*
 * pf_internal.h — what the .c files of libpegaflow share and nothing else
 * sees: error reporting, the handle table, the completion ring's producer
 * side, and the backend operations table that cuda and host implement.
 */
#ifndef PF_INTERNAL_H
#define PF_INTERNAL_H

#include "pegaflow.h"
#include <pthread.h>
#include <sys/types.h>
#include <stdatomic.h>
#include <stddef.h>

/* Records `fmt` as the calling thread's last error and returns `code`. */
int32_t pf_fail(int32_t code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* Copies text into buf (truncated to cap - 1 bytes, NUL-terminated; nothing
 * is written when buf is NULL or cap is 0). Returns strlen(text), the
 * length a caller needs for the whole of it. */
int32_t pf_text_out(const char *text, char *buf, uint32_t cap);
/* Returns `rc`; when it is a failure, first copies this thread's error text
 * into `err` (`cap` bytes; `err` may be NULL). For the entry points that run
 * off the caller's thread, whose pf_last_error the caller cannot read. */
int32_t pf_error_out(int32_t rc, char *err, uint32_t cap);

/* What an engine can do (pf_engine.features); pf_engine_info reports each
 * as a named field. */
enum pf_feature {
  PF_FEAT_KERNEL = 1u << 0,    /* gather/scatter kernel loaded */
  PF_FEAT_DMA_BATCH = 1u << 1, /* cuMemcpyBatchAsync available */
  PF_FEAT_IPC = 1u << 2,       /* CUDA IPC import/export */
};
/* pf_pool.applied: the pf_pool_flags that took effect, plus this one (the
 * pages are page-locked), reported by pf_pool_info as named fields. */
#define PF_POOL_LOCKED (1u << 2)

/* ---- handles ----------------------------------------------------------- */
enum pf_kind { PF_K_ENGINE = 1, PF_K_RING, PF_K_POOL, PF_K_REGION, PF_K_URING,
               PF_K_FILE, PF_K_SHM };

/* Registers obj under a new handle of `kind`; 0 when the table is full. */
uint32_t pf_handle_new(int kind, void *obj);
/* Returns the object for handle h if it is live and of `kind`, else NULL
 * (and records PF_EHANDLE naming `what`). */
void *pf_handle_get(uint32_t h, int kind, const char *what);
/* Retires handle h (later lookups fail). */
void pf_handle_free(uint32_t h);

/* ---- completion ring (producer side) ----------------------------------- */
/* Longest failure text kept per failed batch (pf_ring_take_error). */
#define PF_ERROR_TEXT_BYTES 384u

typedef struct pf_ring_error {
  uint64_t tag;           /* 0 = empty */
  char text[PF_ERROR_TEXT_BYTES];
} pf_ring_error;

typedef struct pf_ring {
  uint8_t *mem;           /* header + records, page aligned */
  size_t mem_bytes;
  uint32_t capacity;
  pthread_mutex_t mu;     /* serialises producers */
  pthread_cond_t cv;      /* producers wait for room; consumers for news */
  atomic_int users;       /* submitted work that will still post */
  /* Texts of the last failed batches, oldest overwritten (under mu). */
  pf_ring_error errors[PF_RING_ERRORS];
  uint32_t next_error;
} pf_ring;

/* Posts one record; waits while the ring is full. Returns PF_ESHUTDOWN if
 * the ring is shut down (the record is then dropped). */
int32_t pf_ring_post(pf_ring *r, const pf_completion *c);
/* Posts one record and releases one pf_ring_acquire, atomically with
 * respect to consumers: for a batch's final record. */
int32_t pf_ring_post_release(pf_ring *r, const pf_completion *c);
int pf_ring_is_shutdown(pf_ring *r);
/* Keeps `text` as the failure text of batch `tag` (before its BATCH record
 * is posted). */
void pf_ring_keep_error(pf_ring *r, uint64_t tag, const char *text);
void pf_ring_acquire(pf_ring *r); /* work that will post later */
void pf_ring_release(pf_ring *r);

/* ---- objects shared by the backends ----------------------------------- */
struct pf_engine;
struct pf_pool;
struct pf_region;
struct pf_batch;

/* Serialises handle resolution + inflight accounting in pf_copy_submit
 * against the close/destroy calls, so that a close either sees the batch's
 * inflight count or the batch sees the handle gone, never half of each. */
extern pthread_mutex_t pf_objects_mu;

/* One contiguous copy (one validated segment): the region side is an
 * absolute address (device or host), the pool side an offset. */
typedef struct pf_range {
  uint64_t region_addr;
  uint64_t pool_off;
  uint64_t bytes;
} pf_range;

typedef struct pf_group_rt {
  struct pf_region *region;
  uint32_t layer;
  uint32_t first_range;
  uint32_t num_ranges;
  uint32_t pad;
  uint64_t bytes;
} pf_group_rt;

typedef struct pf_shm {
  uint32_t handle;
  char name[PF_HANDLE_BYTES];
  uint8_t *ptr;
  uint64_t bytes;
  int unlink_on_close;
  dev_t dev; /* the object mapped (pf_shm_same) */
  ino_t ino;
  atomic_int inflight; /* batches that will still write progress words */
} pf_shm;

/* A validated batch, owned by the backend from submit until pf_batch_done. */
typedef struct pf_batch {
  struct pf_engine *engine;
  struct pf_pool *pool;
  pf_ring *ring;
  pf_shm *progress;
  uint32_t progress_off;
  uint32_t direction;
  uint32_t path;          /* the caller's pf_path, run as given */
  uint32_t whole;         /* PF_BATCH_WHOLE: consumed only once all landed */
  uint32_t quiet;         /* PF_BATCH_QUIET: no PF_DONE_LAYER records */
  uint32_t num_groups;
  uint32_t num_ranges;
  uint32_t num_segs;      /* = num_ranges before a backend splits */
  uint64_t tag;
  uint64_t total_bytes;
  uint64_t submit_ns;     /* CLOCK_MONOTONIC at submit */
  pf_group_rt *groups;
  pf_range *ranges;
  struct pf_batch *next;  /* backend queue link */
  void *impl;             /* backend per-batch state */
  /* First failure of the batch (0 while none) and its text, claimed by the
   * thread that sets it; handed to the ring before the BATCH record. */
  _Atomic int32_t fail_status;
  char fail_text[PF_ERROR_TEXT_BYTES];
  /* Set once a group was reported failed: later groups are reported
   * PF_ECANCELED and the progress word stays where it was. Written only by
   * the thread posting groups (in order). */
  int32_t posted_fail;
  /* The progress shm faulted once: no further stores into it. */
  int32_t progress_gone;
  /* Called by pf_batch_done just before b is freed (calibration waits on
   * it); NULL for batches submitted through the ABI. */
  void (*on_done)(void *arg, int32_t status, uint64_t ns);
  void *on_done_arg;
} pf_batch;

uint64_t pf_now_ns(void);
/* Records the batch's first failure (status < 0) and its text; later calls
 * keep the first. Any thread, any time before pf_batch_done. Returns
 * status. */
int32_t pf_batch_fail(pf_batch *b, int32_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Reports group g as landed (or failed): progress word, LAYER record,
 * region inflight release. Call in group order. A group after a failed one
 * is reported PF_ECANCELED; a progress word the client's shm no longer
 * backs fails the group with PF_EFAULT (pf_batch_fail names the shm). */
void pf_batch_group_done(pf_batch *b, uint32_t g, int32_t status);
/* Ends the batch: progress status word, BATCH record (aux = path used,
 * value = ns since submit), releases pool/ring/shm and frees b. `status`
 * is the backend's; a failure recorded with pf_batch_fail wins over
 * PF_OK, and its text goes to the ring (pf_ring_take_error). */
void pf_batch_done(pf_batch *b, int32_t status, uint32_t path_used);
/* Builds a batch directly (calibration, tests of the backend): no handles,
 * no ring. Ranges are used as given. */
pf_batch *pf_batch_alloc(uint32_t num_groups, uint32_t num_ranges);
void pf_batch_free(pf_batch *b);

/* Lets a thread block until a batch it built ends (calibration): attach
 * sets b's on_done hook, submit b, then wait. Lives on the waiter's stack;
 * pf_batch_done signals it just before freeing b. */
typedef struct pf_batch_waiter {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done;
  int32_t status;
  uint64_t ns;
} pf_batch_waiter;

/* Resets w and makes it b's on_done hook. Call before submitting b. */
void pf_batch_waiter_attach(pf_batch_waiter *w, pf_batch *b);
/* Blocks until the attached batch has ended; *gbps = moved bytes over its
 * submit-to-done time (0 when that time is 0). Returns the batch status. */
int32_t pf_batch_waiter_wait(pf_batch_waiter *w, uint64_t moved, double *gbps);

/* ---- client memory guard (pf_guard.c) --------------------------------- */
/* Installs the SIGBUS handler (once per process); PF_EIO if sigaction
 * fails. Called where client mappings come into being. */
int32_t pf_guard_init(void);
/* Runs fn(arg) on this thread; a SIGBUS at an address inside
 * [client_lo, client_lo + client_bytes) ends fn early and returns PF_EFAULT
 * with *fault_off = the address minus client_lo. fn must hold no lock and
 * own no resource it would leak when cut short (plain loads, stores and
 * memcpy). Nests. */
int32_t pf_guard_run(const void *client_lo, uint64_t client_bytes,
                     void (*fn)(void *arg), void *arg, uint64_t *fault_off);
/* memcpy under a guard on the client range [client_lo, +client_bytes). */
int32_t pf_guard_copy(void *dst, const void *src, uint64_t bytes,
                      const void *client_lo, uint64_t client_bytes,
                      uint64_t *fault_off);
/* A release store of one u32 into client memory, guarded. */
int32_t pf_guard_store_u32(void *addr, uint32_t value, uint64_t *fault_off);

/* Host memory for pools: mmap (optionally MAP_HUGETLB) and parallel
 * pre-touch. Fills p->host, huge_page_bytes, applied, alloc_ns, and the
 * caller's progress words (p->progress) as it goes. */
int32_t pf_hostmem_alloc(struct pf_pool *p, const char *who);
void pf_hostmem_free(struct pf_pool *p);
/* Checks a POSIX shm name ("/" + letters, digits, - _ .) within cap. */
int32_t pf_shm_name_check(const char *fn, const char *name, size_t cap);
/* Runs fn(i, arg) for i in [0, n) on n threads (n >= 1); waits for all. */
void pf_parallel(uint32_t n, void (*fn)(uint32_t i, void *arg), void *arg);

/* ---- backends ---------------------------------------------------------- */
typedef struct pf_backend_ops {
  const char *name;
  int32_t (*open)(struct pf_engine *e, int32_t device, uint32_t workers);
  void (*close)(struct pf_engine *e);
  int32_t (*pool_alloc)(struct pf_engine *e, struct pf_pool *p);
  void (*pool_free)(struct pf_engine *e, struct pf_pool *p);
  int32_t (*region_alloc)(struct pf_engine *e, struct pf_region *r,
                          uint8_t *out_handle);
  int32_t (*region_import)(struct pf_engine *e, struct pf_region *r,
                           const uint8_t *handle);
  void (*region_close)(struct pf_engine *e, struct pf_region *r);
  int32_t (*region_rw)(struct pf_engine *e, struct pf_region *r, uint64_t off,
                       void *buf, uint64_t bytes, int write);
  /* Takes ownership of b on success (and ends it with pf_batch_done);
   * on failure b is still the caller's. */
  int32_t (*submit)(struct pf_engine *e, pf_batch *b);
  int32_t (*calibrate)(struct pf_engine *e, struct pf_pool *p,
                       uint32_t direction, const uint64_t *sizes, uint32_t n,
                       uint64_t total_bytes, double *out_gbps);
  /* Largest range the backend copies in one piece (host: longer ones are
   * split for parallelism; cuda: no limit). */
  uint64_t max_range_bytes;
  /* 1: a pool of one engine may serve batches of every engine of this
   * backend (host: one address space, memcpy everywhere; cuda: the pool is
   * registered PORTABLE, and each engine takes its own device view of it). */
  int shared_pool;
} pf_backend_ops;

typedef struct pf_engine {
  const pf_backend_ops *ops;
  uint32_t handle;
  int32_t backend;
  int32_t device;
  uint64_t features;
  uint32_t sm_count;
  uint32_t grid_blocks;    /* 0 = backend default */
  uint32_t default_grid;
  uint32_t kernel_variant; /* 0 SIMT, 1 Hopper bulk copy (cuda only) */
  uint32_t dma_share;      /* permille of MIXED bytes to the copy engines; 0 = default */
  uint32_t default_dma_share;
  uint64_t device_mem_bytes;
  uint32_t driver_version;  /* cuDriverGetVersion; 0 on host */
  char device_name[PF_DEVICE_NAME_BYTES];
  atomic_int live_objects; /* pools + regions of this engine */
  /* The device's failure (pf_engine_fail, or a sticky CUDA error); 0 =
   * healthy. Read once per batch by the backend's worker threads. */
  _Atomic int32_t failed;
  /* Why it failed, set once by the thread that set `failed` (under
   * fail_mu); every later batch quotes it. */
  pthread_mutex_t fail_mu;
  char fail_text[160];
  void *impl;              /* backend private state */
} pf_engine;

typedef struct pf_pool {
  pf_engine *engine;
  uint32_t handle;
  uint8_t *host;           /* host address */
  uint64_t device_ptr;     /* device view of the same memory (cuda) */
  uint64_t bytes;          /* requested size */
  uint64_t mapped_bytes;   /* size of the mapping (rounded to pages) */
  uint32_t flags;          /* requested pf_pool_flags */
  uint32_t applied;        /* flags actually applied */
  uint32_t touch_threads;
  uint64_t alloc_ns;
  uint64_t huge_page_bytes;
  /* The caller's progress block during pf_pool_create (NULL: none). */
  pf_pool_progress *progress;
  /* NUMA parts (pf_pool_create_split), borrowed for the create call only:
   * pf_hostmem_alloc binds each part's pages before pre-touching them. */
  const pf_pool_part *parts;
  uint32_t nparts;
  atomic_int inflight;
  void *impl;
} pf_pool;

/* Looks `pool` up and holds it (its `inflight`) under pf_objects_mu, so a
 * pf_pool_destroy racing a call that runs off the JS thread (a checksum)
 * fails with PF_EBUSY instead of freeing the pool under it; NULL (error set)
 * for a bad handle. Every hold ends with pf_pool_unhold. */
pf_pool *pf_pool_hold(uint32_t pool, const char *fn);
void pf_pool_unhold(pf_pool *p);

/* Publishes the pool-creation phase (no-op without progress words). */
void pf_pool_phase(pf_pool *p, uint32_t phase);

typedef struct pf_region {
  pf_engine *engine;
  uint32_t handle;
  uint64_t addr;           /* device address (cuda) or host address (host) */
  uint64_t bytes;
  int imported;
  uint8_t name[PF_HANDLE_BYTES];
  atomic_int inflight;
  void *impl;
} pf_region;

/* Marks engine e's device failed with `code` (first caller wins) and keeps
 * `why` for the text of every later batch. Any thread. */
void pf_engine_mark_failed(pf_engine *e, int32_t code, const char *why);
/* Fails batch b because its engine's device failed: group g's text names
 * the device, the status and why. Returns the status. */
int32_t pf_batch_fail_device(pf_batch *b, uint32_t g);

/* The cuda backend's answers for pf_device_count / pf_device_numa_node
 * (PF_ENODEV without a driver). */
int32_t pf_cuda_device_count(uint32_t *out_count);
int32_t pf_cuda_numa_node(int32_t device, int32_t *out_node);

extern const pf_backend_ops pf_host_ops;
extern const pf_backend_ops pf_cuda_ops;

#endif /* PF_INTERNAL_H */
