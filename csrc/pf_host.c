/*
 * pf_host.c — the host backend: the whole ABI with no GPU.
 *
 * A client's "device" KV region is a POSIX shared-memory file named by its
 * 64-byte handle ("/pegaflow-<pid>-<n>"), so a KV server in another process
 * maps the same bytes exactly as it would open a CUDA IPC handle. Copies are
 * memcpy on a small pool of worker threads.
 *
 * Scheduling: at submit, a batch's ranges (one per segment) are cut into
 * tasks of about PF_HOST_TASK_BYTES (a task never spans two groups).
 * Workers take tasks from the batch at the head of a FIFO queue under one
 * mutex — a task is hundreds of microseconds of memcpy, so the lock is
 * cold. Each group counts its
 * unfinished tasks; whoever finishes a group's last task marks it done and
 * posts every consecutive finished group, so LAYER records leave in group
 * order even though groups finish out of order.
 *
 * A region is a MAP_SHARED mapping the client still controls: if it shrinks
 * the file, our memcpy faults (SIGBUS). Every task and every synchronous
 * region access runs under pf_guard (pf_guard.c), so such a fault fails the
 * task's group with PF_EFAULT, and the batch with a text naming the region,
 * while the process and every other client's batches carry on.
 */
#define _GNU_SOURCE
#include "pf_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Ranges are split at this size so one large segment still spreads over
 * all workers; big enough that a task is far longer than a lock round. */
#define PF_HOST_MAX_RANGE (512u << 10)
/* Consecutive small ranges are handed out together up to this many bytes. */
#define PF_HOST_TASK_BYTES (512u << 10)
#define PF_HOST_WORKERS_DEFAULT 4u
#define PF_HOST_WORKERS_MAX 64u

typedef struct host_engine {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  pf_batch *head, *tail; /* batches with unclaimed tasks */
  int stop;
  uint32_t nworkers;
  pthread_t th[PF_HOST_WORKERS_MAX];
} host_engine;

typedef struct host_batch {
  uint32_t ntasks;
  uint32_t next_task;   /* under host_engine.mu */
  uint32_t *task_first; /* ntasks + 1 range indices */
  uint32_t *task_group;
  atomic_uint *group_left;
  _Atomic int32_t *group_status; /* PF_OK or the group's first failure */
  pthread_mutex_t mu;   /* ordered posting */
  uint8_t *group_done;
  uint32_t next_post;
} host_batch;

static void host_batch_free(host_batch *hb) {
  if (!hb) return;
  free(hb->task_first);
  free(hb->task_group);
  free(hb->group_left);
  free(hb->group_status);
  free(hb->group_done);
  pthread_mutex_destroy(&hb->mu);
  free(hb);
}

static void run_range(pf_batch *b, const pf_range *r) {
  uint8_t *pool = b->pool->host + r->pool_off;
  uint8_t *reg = (uint8_t *)(uintptr_t)r->region_addr;
  if (b->direction == PF_D2H)
    memcpy(pool, reg, r->bytes);
  else
    memcpy(reg, pool, r->bytes);
}

typedef struct {
  pf_batch *b;
  uint32_t lo, hi; /* range indices */
} task_args;

static void run_ranges(void *arg) {
  task_args *t = arg;
  for (uint32_t i = t->lo; i < t->hi; i++) run_range(t->b, &t->b->ranges[i]);
}

/* Runs ranges [lo, hi) of group g under a guard on the group's region (the
 * client's memory; the pool is ours). Calibration groups have no region. */
static int32_t run_task(pf_batch *b, uint32_t g, uint32_t lo, uint32_t hi) {
  task_args t = {b, lo, hi};
  pf_region *r = b->groups[g].region;
  if (atomic_load(&b->engine->failed) && r) return pf_batch_fail_device(b, g);
  if (!r) {
    run_ranges(&t);
    return PF_OK;
  }
  uint64_t fault = 0;
  int32_t rc = pf_guard_run((const void *)(uintptr_t)r->addr, r->bytes,
                            run_ranges, &t, &fault);
  if (rc < 0)
    pf_batch_fail(b, rc,
                  "group %u (layer %u): region %u (\"%.*s\", %llu bytes "
                  "mapped) faulted at offset %llu %s: the client shrank the "
                  "shm file behind the region after registering it",
                  g, b->groups[g].layer, r->handle, (int)PF_HANDLE_BYTES,
                  (const char *)r->name, (unsigned long long)r->bytes,
                  (unsigned long long)fault,
                  b->direction == PF_D2H ? "reading it (save)"
                                         : "writing it (load)");
  return rc;
}

static void finish_task(pf_batch *b, uint32_t g) {
  host_batch *hb = b->impl;
  if (atomic_fetch_sub(&hb->group_left[g], 1) != 1) return;
  pthread_mutex_lock(&hb->mu);
  hb->group_done[g] = 1;
  int last = 0;
  /* Only the thread that advances next_post to the end ends the batch. */
  while (hb->next_post < b->num_groups && hb->group_done[hb->next_post]) {
    pf_batch_group_done(b, hb->next_post,
                        atomic_load(&hb->group_status[hb->next_post]));
    hb->next_post++;
    if (hb->next_post == b->num_groups) last = 1;
  }
  pthread_mutex_unlock(&hb->mu);
  if (last) {
    b->impl = NULL;
    host_batch_free(hb);
    pf_batch_done(b, PF_OK, b->path); /* memcpy ran; report what was asked */
  }
}

static void *host_worker(void *arg) {
  host_engine *he = arg;
  pthread_setname_np(pthread_self(), "pf-host-copy"); /* top, perf, /proc: whose CPU */
  for (;;) {
    pthread_mutex_lock(&he->mu);
    while (!he->stop && !he->head) pthread_cond_wait(&he->cv, &he->mu);
    if (!he->head) { /* stop requested and nothing queued */
      pthread_mutex_unlock(&he->mu);
      return NULL;
    }
    pf_batch *b = he->head;
    host_batch *hb = b->impl;
    uint32_t t = hb->next_task++;
    if (hb->next_task == hb->ntasks) {
      he->head = b->next;
      if (!he->head) he->tail = NULL;
    }
    uint32_t lo = hb->task_first[t], hi = hb->task_first[t + 1];
    uint32_t g = hb->task_group[t];
    pthread_mutex_unlock(&he->mu);
    int32_t rc = run_task(b, g, lo, hi);
    if (rc < 0) {
      int32_t ok = PF_OK;
      atomic_compare_exchange_strong(&hb->group_status[g], &ok, rc);
    }
    finish_task(b, g);
  }
}

/* Wakes every worker to exit once the queue is empty, then joins the first
 * n (those started). */
static void host_stop_workers(host_engine *he, uint32_t n) {
  pthread_mutex_lock(&he->mu);
  he->stop = 1;
  pthread_cond_broadcast(&he->cv);
  pthread_mutex_unlock(&he->mu);
  for (uint32_t i = 0; i < n; i++) pthread_join(he->th[i], NULL);
}

static int32_t host_open(pf_engine *e, int32_t device, uint32_t workers) {
  if (workers > PF_HOST_WORKERS_MAX)
    return pf_fail(PF_EINVAL, "pf_engine_open: workers %u; expected 0 "
                   "(default) .. %u", workers, PF_HOST_WORKERS_MAX);
  host_engine *he = calloc(1, sizeof *he);
  if (!he) return pf_fail(PF_ENOMEM, "pf_engine_open: out of memory");
  pthread_mutex_init(&he->mu, NULL);
  pthread_cond_init(&he->cv, NULL);
  uint32_t n = workers;
  if (!n) {
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    n = cpus > 0 && (uint32_t)cpus < PF_HOST_WORKERS_DEFAULT
            ? (uint32_t)cpus : PF_HOST_WORKERS_DEFAULT;
  }
  for (uint32_t i = 0; i < n; i++) {
    /* pthread_create returns its error; it does not set errno. */
    int err = pthread_create(&he->th[i], NULL, host_worker, he);
    if (err != 0) {
      host_stop_workers(he, i);
      free(he);
      return pf_fail(PF_ENOMEM, "pf_engine_open: starting copy worker %u of "
                     "%u: %s", i, n, strerror(err));
    }
  }
  he->nworkers = n;
  e->impl = he;
  e->features = 0;
  e->sm_count = 0;
  snprintf(e->device_name, sizeof e->device_name, "host");
  e->default_grid = 0;
  return PF_OK;
}

static void host_close(pf_engine *e) {
  host_engine *he = e->impl;
  host_stop_workers(he, he->nworkers);
  pthread_cond_destroy(&he->cv);
  pthread_mutex_destroy(&he->mu);
  free(he);
}

static int32_t host_pool_alloc(pf_engine *e, pf_pool *p) {
  int32_t rc = pf_hostmem_alloc(p, "pf_pool_create");
  if (rc < 0) return rc;
  /* Best effort: an unprivileged process usually has a small
   * RLIMIT_MEMLOCK. The host backend works without it; info reports it. */
  pf_pool_phase(p, PF_POOL_PHASE_LOCK);
  if (mlock(p->host, p->mapped_bytes) == 0) p->applied |= PF_POOL_LOCKED;
  p->device_ptr = (uint64_t)(uintptr_t)p->host;
  return PF_OK;
}

static void host_pool_free(pf_engine *e, pf_pool *p) {
  if (p->applied & PF_POOL_LOCKED) munlock(p->host, p->mapped_bytes);
  pf_hostmem_free(p);
}

static atomic_uint region_seq;

/* Names of shm regions this process exported and has not closed yet. At
 * exit (including an exit on an uncaught error) they are unlinked, so a
 * crashed client leaves no /dev/shm files behind; the mappings of importers
 * stay valid after an unlink. (SIGKILL skips this: the server's session
 * cleanup owns that case.) */
typedef struct exported_name {
  char name[PF_HANDLE_BYTES];
  struct exported_name *next;
} exported_name;
static exported_name *exported;
static pthread_mutex_t exported_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t exported_once = PTHREAD_ONCE_INIT;

static void unlink_exported(void) {
  pthread_mutex_lock(&exported_mu);
  for (exported_name *n = exported; n; n = n->next) shm_unlink(n->name);
  pthread_mutex_unlock(&exported_mu);
}

static void exported_init(void) { atexit(unlink_exported); }

static void exported_add(const char *name) {
  exported_name *n = calloc(1, sizeof *n);
  if (!n) return; /* only hygiene at exit is lost */
  pthread_once(&exported_once, exported_init);
  snprintf(n->name, sizeof n->name, "%s", name);
  pthread_mutex_lock(&exported_mu);
  n->next = exported;
  exported = n;
  pthread_mutex_unlock(&exported_mu);
}

static void exported_remove(const char *name) {
  pthread_mutex_lock(&exported_mu);
  for (exported_name **p = &exported; *p; p = &(*p)->next) {
    if (strcmp((*p)->name, name) == 0) {
      exported_name *n = *p;
      *p = n->next;
      free(n);
      break;
    }
  }
  pthread_mutex_unlock(&exported_mu);
}

static int32_t host_region_alloc(pf_engine *e, pf_region *r,
                                 uint8_t *out_handle) {
  char name[PF_HANDLE_BYTES];
  memset(name, 0, sizeof name);
  snprintf(name, sizeof name, "/pegaflow-%d-%u", (int)getpid(),
           atomic_fetch_add(&region_seq, 1));
  int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0)
    return pf_fail(PF_EIO, "pf_region_alloc: shm_open(\"%s\"): %s", name,
                   strerror(errno));
  if (ftruncate(fd, (off_t)r->bytes) != 0) {
    int err = errno;
    close(fd);
    shm_unlink(name);
    return pf_fail(PF_ENOMEM, "pf_region_alloc: ftruncate(\"%s\", %llu): %s",
                   name, (unsigned long long)r->bytes, strerror(err));
  }
  void *m = mmap(NULL, r->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (m == MAP_FAILED) {
    shm_unlink(name);
    return pf_fail(PF_ENOMEM, "pf_region_alloc: mmap(\"%s\", %llu): %s", name,
                   (unsigned long long)r->bytes, strerror(err));
  }
  r->addr = (uint64_t)(uintptr_t)m;
  memcpy(out_handle, name, PF_HANDLE_BYTES);
  exported_add(name);
  return PF_OK;
}

static int32_t host_region_import(pf_engine *e, pf_region *r,
                                  const uint8_t *handle) {
  const char *name = (const char *)handle;
  int32_t rc = pf_shm_name_check("pf_region_import", name, PF_HANDLE_BYTES);
  if (rc < 0) return rc;
  for (size_t i = strlen(name); i < PF_HANDLE_BYTES; i++)
    if (handle[i] != 0)
      return pf_fail(PF_EINVAL, "pf_region_import: handle byte %zu after the "
                     "name is 0x%02x; expected zero padding", i, handle[i]);
  int fd = shm_open(name, O_RDWR, 0);
  if (fd < 0)
    return pf_fail(errno == ENOENT ? PF_EHANDLE : PF_EIO,
                   "pf_region_import: shm_open(\"%s\"): %s (is the exporting "
                   "process alive?)", name, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int err = errno;
    close(fd);
    return pf_fail(PF_EIO, "pf_region_import: fstat(\"%s\"): %s", name,
                   strerror(err));
  }
  if ((uint64_t)st.st_size < r->bytes) {
    close(fd);
    return pf_fail(PF_ERANGE, "pf_region_import: \"%s\" declared %llu bytes; "
                   "the allocation has %lld", name,
                   (unsigned long long)r->bytes, (long long)st.st_size);
  }
  void *m = mmap(NULL, r->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (m == MAP_FAILED)
    return pf_fail(PF_ENOMEM, "pf_region_import: mmap(\"%s\", %llu): %s", name,
                   (unsigned long long)r->bytes, strerror(err));
  r->addr = (uint64_t)(uintptr_t)m;
  return PF_OK;
}

static void host_region_close(pf_engine *e, pf_region *r) {
  munmap((void *)(uintptr_t)r->addr, r->bytes);
  if (!r->imported) {
    shm_unlink((const char *)r->name);
    exported_remove((const char *)r->name);
  }
}

static int32_t host_region_rw(pf_engine *e, pf_region *r, uint64_t off,
                              void *buf, uint64_t bytes, int write) {
  uint8_t *p = (uint8_t *)(uintptr_t)r->addr + off;
  uint64_t fault = 0;
  int32_t rc = write ? pf_guard_copy(p, buf, bytes, p - off, r->bytes, &fault)
                     : pf_guard_copy(buf, p, bytes, p - off, r->bytes, &fault);
  if (rc < 0)
    return pf_fail(rc, "%s: region %u (\"%.*s\", %llu bytes mapped) faulted "
                   "at offset %llu: the shm file behind it was shrunk",
                   write ? "pf_region_write" : "pf_region_read", r->handle,
                   (int)PF_HANDLE_BYTES, (const char *)r->name,
                   (unsigned long long)r->bytes, (unsigned long long)fault);
  return PF_OK;
}

/* Splits ranges longer than PF_HOST_MAX_RANGE in place (a segment the
 * caller merged, or one given long, can be any size). */
static int32_t split_long_ranges(pf_batch *b) {
  uint64_t extra = 0;
  for (uint32_t i = 0; i < b->num_ranges; i++)
    if (b->ranges[i].bytes > PF_HOST_MAX_RANGE)
      extra += (b->ranges[i].bytes - 1) / PF_HOST_MAX_RANGE;
  if (!extra) return PF_OK;
  if (b->num_ranges + extra > UINT32_MAX)
    return pf_fail(PF_EINVAL, "pf_copy_submit: batch too large to split");
  uint32_t n = (uint32_t)(b->num_ranges + extra);
  pf_range *out = malloc((size_t)n * sizeof *out);
  if (!out) return pf_fail(PF_ENOMEM, "pf_copy_submit: out of memory");
  uint32_t k = 0;
  for (uint32_t g = 0; g < b->num_groups; g++) {
    pf_group_rt *gr = &b->groups[g];
    uint32_t first = k;
    for (uint32_t i = gr->first_range; i < gr->first_range + gr->num_ranges;
         i++) {
      pf_range r = b->ranges[i];
      while (r.bytes > PF_HOST_MAX_RANGE) {
        out[k++] = (pf_range){r.region_addr, r.pool_off, PF_HOST_MAX_RANGE};
        r.region_addr += PF_HOST_MAX_RANGE;
        r.pool_off += PF_HOST_MAX_RANGE;
        r.bytes -= PF_HOST_MAX_RANGE;
      }
      out[k++] = r;
    }
    gr->first_range = first;
    gr->num_ranges = k - first;
  }
  free(b->ranges);
  b->ranges = out;
  b->num_ranges = n;
  return PF_OK;
}

static int32_t host_submit(pf_engine *e, pf_batch *b) {
  host_engine *he = e->impl;
  int32_t rc = split_long_ranges(b);
  if (rc < 0) return rc;
  host_batch *hb = calloc(1, sizeof *hb);
  if (!hb) return pf_fail(PF_ENOMEM, "pf_copy_submit: out of memory");
  pthread_mutex_init(&hb->mu, NULL);
  /* At most one task per range. */
  hb->task_first = malloc(((size_t)b->num_ranges + 1) * sizeof(uint32_t));
  hb->task_group = malloc((size_t)b->num_ranges * sizeof(uint32_t));
  hb->group_left = calloc(b->num_groups, sizeof(atomic_uint));
  hb->group_status = calloc(b->num_groups, sizeof(_Atomic int32_t));
  hb->group_done = calloc(b->num_groups, 1);
  if (!hb->task_first || !hb->task_group || !hb->group_left ||
      !hb->group_status || !hb->group_done) {
    host_batch_free(hb);
    return pf_fail(PF_ENOMEM, "pf_copy_submit: out of memory");
  }
  uint32_t t = 0;
  for (uint32_t g = 0; g < b->num_groups; g++) {
    pf_group_rt *gr = &b->groups[g];
    uint32_t end = gr->first_range + gr->num_ranges;
    uint32_t i = gr->first_range;
    while (i < end) {
      hb->task_first[t] = i;
      hb->task_group[t] = g;
      uint64_t acc = 0;
      while (i < end && (acc == 0 || acc + b->ranges[i].bytes <=
                                         PF_HOST_TASK_BYTES)) {
        acc += b->ranges[i].bytes;
        i++;
      }
      atomic_fetch_add(&hb->group_left[g], 1);
      t++;
    }
  }
  hb->task_first[t] = b->num_ranges;
  hb->ntasks = t;
  b->impl = hb;
  b->next = NULL;
  pthread_mutex_lock(&he->mu);
  if (he->stop) {
    pthread_mutex_unlock(&he->mu);
    b->impl = NULL;
    host_batch_free(hb);
    return pf_fail(PF_ESHUTDOWN, "pf_copy_submit: engine is closing");
  }
  if (he->tail)
    he->tail->next = b;
  else
    he->head = b;
  he->tail = b;
  pthread_cond_broadcast(&he->cv);
  pthread_mutex_unlock(&he->mu);
  return PF_OK;
}

/* ---- calibration ------------------------------------------------------- */

/* Times one strided batch of `size`-byte segments through the workers. */
static int32_t host_time_batch(pf_engine *e, pf_pool *p, uint32_t dir,
                               uint8_t *scratch, uint64_t size, uint64_t total,
                               double *gbps) {
  uint64_t nseg = total / size;
  if (nseg == 0) nseg = 1;
  if (nseg > UINT32_MAX) return pf_fail(PF_EINVAL, "pf_calibrate: too many segments");
  pf_batch *b = pf_batch_alloc(1, (uint32_t)nseg);
  if (!b) return pf_fail(PF_ENOMEM, "pf_calibrate: out of memory");
  for (uint64_t i = 0; i < nseg; i++)
    b->ranges[i] = (pf_range){(uint64_t)(uintptr_t)scratch + 2 * i * size,
                              i * size, size};
  b->groups[0] = (pf_group_rt){NULL, 0, 0, (uint32_t)nseg, 0, nseg * size};
  b->engine = e;
  b->pool = NULL; /* no inflight accounting for calibration */
  b->direction = dir;
  b->total_bytes = nseg * size;
  pf_batch_waiter w;
  pf_batch_waiter_attach(&w, b);
  /* run_range reads b->pool->host: give it a stack copy with no counter. */
  pf_pool shadow = *p;
  atomic_init(&shadow.inflight, 0);
  b->pool = &shadow;
  uint64_t moved = b->total_bytes;
  b->submit_ns = pf_now_ns();
  int32_t rc = host_submit(e, b);
  if (rc < 0) {
    pf_batch_free(b);
    return rc;
  }
  return pf_batch_waiter_wait(&w, moved, gbps);
}

static int32_t host_calibrate(pf_engine *e, pf_pool *p, uint32_t dir,
                              const uint64_t *sizes, uint32_t n, uint64_t total,
                              double *out) {
  if (total > UINT64_MAX / 2)
    return pf_fail(PF_EINVAL, "pf_calibrate: total_bytes too large");
  uint64_t scratch_bytes = 2 * total;
  uint8_t *scratch = mmap(NULL, scratch_bytes, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (scratch == MAP_FAILED)
    return pf_fail(PF_ENOMEM, "pf_calibrate: scratch mmap of %llu bytes: %s",
                   (unsigned long long)scratch_bytes, strerror(errno));
  memset(scratch, 0x5a, scratch_bytes);
  /* Peak: one contiguous memcpy of total bytes (after a warm-up). */
  uint8_t *dst = dir == PF_D2H ? p->host : scratch;
  uint8_t *src = dir == PF_D2H ? scratch : p->host;
  memcpy(dst, src, total);
  uint64_t t0 = pf_now_ns();
  memcpy(dst, src, total);
  uint64_t dt = pf_now_ns() - t0;
  double peak = dt ? (double)total / (double)dt : 0;
  int32_t rc = PF_OK;
  for (uint32_t i = 0; i < n && rc == PF_OK; i++) {
    out[i] = peak;
    double g = 0;
    rc = host_time_batch(e, p, dir, scratch, sizes[i], total, &g); /* warm */
    if (rc == PF_OK)
      rc = host_time_batch(e, p, dir, scratch, sizes[i], total, &g);
    out[3 * n + i] = g;
  }
  munmap(scratch, scratch_bytes);
  return rc;
}

const pf_backend_ops pf_host_ops = {
    .name = "host",
    .open = host_open,
    .close = host_close,
    .pool_alloc = host_pool_alloc,
    .pool_free = host_pool_free,
    .region_alloc = host_region_alloc,
    .region_import = host_region_import,
    .region_close = host_region_close,
    .region_rw = host_region_rw,
    .submit = host_submit,
    .calibrate = host_calibrate,
    .max_range_bytes = PF_HOST_MAX_RANGE,
    .shared_pool = 1,
};
