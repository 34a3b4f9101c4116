/*
 * pf_internal.h — what the .c files of libpegaflow share and nothing else
 * sees: error reporting, the handle table, the completion ring's producer
 * side, and the backend operations table that cuda and host implement.
 */
#ifndef PF_INTERNAL_H
#define PF_INTERNAL_H

#include "pegaflow.h"
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>

/* Records `fmt` as the calling thread's last error and returns `code`. */
int32_t pf_fail(int32_t code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

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
typedef struct pf_ring {
  uint8_t *mem;           /* header + records, page aligned */
  size_t mem_bytes;
  uint32_t capacity;
  pthread_mutex_t mu;     /* serialises producers */
  pthread_cond_t cv;      /* producers wait for room; consumers for news */
  atomic_int users;       /* submitted work that will still post */
} pf_ring;

/* Posts one record; waits while the ring is full. Returns PF_ESHUTDOWN if
 * the ring is shut down (the record is then dropped). */
int32_t pf_ring_post(pf_ring *r, const pf_completion *c);
int pf_ring_is_shutdown(pf_ring *r);
void pf_ring_acquire(pf_ring *r); /* work that will post later */
void pf_ring_release(pf_ring *r);

/* ---- backends ---------------------------------------------------------- */
struct pf_engine;
struct pf_pool;
struct pf_region;

typedef struct pf_backend_ops {
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
} pf_backend_ops;

typedef struct pf_engine {
  const pf_backend_ops *ops;
  int32_t backend;
  int32_t device;
  uint64_t features;
  uint32_t sm_count;
  uint32_t grid_blocks;
  uint64_t device_mem_mib;
  atomic_int live_objects; /* pools + regions of this engine */
  void *impl;              /* backend private state */
} pf_engine;

typedef struct pf_pool {
  pf_engine *engine;
  uint32_t handle;
  uint8_t *host;           /* host address */
  uint64_t device_ptr;     /* device view of the same memory (cuda) */
  uint64_t bytes;
  uint32_t flags;          /* requested pf_pool_flags */
  uint32_t applied;        /* flags actually applied */
  uint32_t touch_threads;
  uint64_t alloc_ns;
  uint64_t huge_page_bytes;
  atomic_int inflight;
  void *impl;
} pf_pool;

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

extern const pf_backend_ops pf_host_ops;
/* NULL when this build has no CUDA backend compiled in. */
extern const pf_backend_ops *pf_cuda_ops_ptr;

#endif /* PF_INTERNAL_H */
