/*
 * pf_core.c — errors, handles and the completion ring.
 *
 * Handles: a fixed table of slots, each with a generation counter. A handle
 * is (generation << 16 | slot + 1), so a freed-and-reused slot never answers
 * to an old handle, and a forged number is caught by the kind check. The
 * table is small and lookups take one mutex: handles are resolved once per
 * batch, never per block.
 *
 * Ring: records are written under a mutex by worker threads (completions
 * arrive per layer and per batch, a few thousand a second at most), and the
 * head is published with a release store after the record, so a consumer
 * that reads head with an acquire load sees whole records.
 */
#define _GNU_SOURCE
#include "pf_xfer_internal.h" /* pf_internal.h + the transfer handle kinds */

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

/* ---- errors ------------------------------------------------------------ */
static __thread char last_error[512];

int32_t pf_fail(int32_t code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return code;
}

int32_t pf_text_out(const char *text, char *buf, uint32_t cap) {
  size_t n = strlen(text);
  if (buf && cap) {
    size_t k = n < cap - 1 ? n : cap - 1;
    memcpy(buf, text, k);
    buf[k] = 0;
  }
  return (int32_t)n;
}

int32_t pf_last_error(char *buf, uint32_t cap) {
  return pf_text_out(last_error, buf, cap);
}

int32_t pf_error_out(int32_t rc, char *err, uint32_t cap) {
  if (rc < 0) pf_text_out(last_error, err, cap);
  return rc;
}

int32_t pf_abi_version(void) { return PF_ABI_VERSION; }

/* ---- handles ----------------------------------------------------------- */
#define PF_MAX_HANDLES 4096 /* engines + rings + pools + regions + files */

static struct {
  void *obj;
  int kind;
  uint16_t gen;
} slots[PF_MAX_HANDLES];
static pthread_mutex_t handles_mu = PTHREAD_MUTEX_INITIALIZER;

uint32_t pf_handle_new(int kind, void *obj) {
  pthread_mutex_lock(&handles_mu);
  for (uint32_t i = 0; i < PF_MAX_HANDLES; i++) {
    if (slots[i].obj == NULL) {
      slots[i].obj = obj;
      slots[i].kind = kind;
      slots[i].gen = (uint16_t)(slots[i].gen + 1);
      if (slots[i].gen == 0) slots[i].gen = 1;
      uint32_t h = ((uint32_t)slots[i].gen << 16) | (i + 1);
      pthread_mutex_unlock(&handles_mu);
      return h;
    }
  }
  pthread_mutex_unlock(&handles_mu);
  pf_fail(PF_ENOMEM, "handle table full (%d live objects)", PF_MAX_HANDLES);
  return 0;
}

static const char *kind_name(int kind) {
  switch (kind) {
  case PF_K_ENGINE: return "engine";
  case PF_K_RING: return "ring";
  case PF_K_POOL: return "pool";
  case PF_K_REGION: return "region";
  case PF_K_URING: return "uring";
  case PF_K_FILE: return "file";
  case PF_K_SHM: return "shm";
  case PF_K_XFER: return "transfer endpoint";
  case PF_K_XPEER: return "transfer peer";
  default: return "object";
  }
}

void *pf_handle_get(uint32_t h, int kind, const char *what) {
  uint32_t idx = (h & 0xffff);
  uint16_t gen = (uint16_t)(h >> 16);
  void *obj = NULL;
  if (idx >= 1 && idx <= PF_MAX_HANDLES) {
    pthread_mutex_lock(&handles_mu);
    if (slots[idx - 1].obj && slots[idx - 1].gen == gen &&
        slots[idx - 1].kind == kind)
      obj = slots[idx - 1].obj;
    pthread_mutex_unlock(&handles_mu);
  }
  if (!obj)
    pf_fail(PF_EHANDLE, "%s: %u is not a live %s handle", what ? what : "?",
            h, kind_name(kind));
  return obj;
}

void pf_handle_free(uint32_t h) {
  uint32_t idx = (h & 0xffff);
  if (idx < 1 || idx > PF_MAX_HANDLES) return;
  pthread_mutex_lock(&handles_mu);
  if (slots[idx - 1].gen == (uint16_t)(h >> 16)) slots[idx - 1].obj = NULL;
  pthread_mutex_unlock(&handles_mu);
}

/* ---- ring -------------------------------------------------------------- */
#define RING_HEAD(r) ((_Atomic uint64_t *)((r)->mem + 0))
#define RING_TAIL(r) ((_Atomic uint64_t *)((r)->mem + 8))
#define RING_SHUTDOWN(r) ((_Atomic uint32_t *)((r)->mem + 20))
#define RING_REC(r, i)                                                       \
  ((pf_completion *)((r)->mem + PF_RING_HEADER_BYTES) +                     \
   ((i) & ((r)->capacity - 1)))
/* The consumer advances tail from JS without a syscall, so a producer
 * waiting for room cannot be woken by it; it re-checks at this period. */
#define RING_FULL_POLL_NS 200000L

int32_t pf_ring_create(uint32_t capacity, uint32_t *out_ring) {
  if (!out_ring) return pf_fail(PF_EINVAL, "pf_ring_create: out_ring is NULL");
  if (capacity < 16 || capacity > (1u << 24) || (capacity & (capacity - 1)))
    return pf_fail(PF_EINVAL,
                   "pf_ring_create: capacity %u must be a power of two in "
                   "[16, 2^24]", capacity);
  pf_ring *r = calloc(1, sizeof *r);
  if (!r) return pf_fail(PF_ENOMEM, "pf_ring_create: out of memory");
  r->capacity = capacity;
  r->mem_bytes = PF_RING_HEADER_BYTES + (size_t)capacity * sizeof(pf_completion);
  r->mem = mmap(NULL, r->mem_bytes, PROT_READ | PROT_WRITE,
                MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (r->mem == MAP_FAILED) {
    free(r);
    return pf_fail(PF_ENOMEM, "pf_ring_create: mmap %zu bytes: %s",
                   (size_t)PF_RING_HEADER_BYTES + capacity * 32u,
                   strerror(errno));
  }
  *(uint32_t *)(r->mem + 16) = capacity;
  pthread_mutex_init(&r->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&r->cv, &ca);
  pthread_condattr_destroy(&ca);
  uint32_t h = pf_handle_new(PF_K_RING, r);
  if (!h) {
    munmap(r->mem, r->mem_bytes);
    free(r);
    return PF_ENOMEM;
  }
  *out_ring = h;
  return PF_OK;
}

void *pf_ring_ptr(uint32_t ring) {
  pf_ring *r = pf_handle_get(ring, PF_K_RING, "pf_ring_ptr");
  return r ? r->mem : NULL;
}

int pf_ring_is_shutdown(pf_ring *r) {
  return atomic_load_explicit(RING_SHUTDOWN(r), memory_order_acquire) != 0;
}

static void deadline_after(struct timespec *ts, long ns) {
  clock_gettime(CLOCK_MONOTONIC, ts);
  ts->tv_nsec += ns;
  while (ts->tv_nsec >= 1000000000L) {
    ts->tv_sec += 1;
    ts->tv_nsec -= 1000000000L;
  }
}

static int32_t ring_post_locked(pf_ring *r, const pf_completion *c);

int32_t pf_ring_post(pf_ring *r, const pf_completion *c) {
  pthread_mutex_lock(&r->mu);
  int32_t rc = ring_post_locked(r, c);
  pthread_mutex_unlock(&r->mu);
  return rc;
}

int32_t pf_ring_post_release(pf_ring *r, const pf_completion *c) {
  pthread_mutex_lock(&r->mu);
  int32_t rc = ring_post_locked(r, c);
  /* Under the same lock as the post: a consumer that has seen this record
   * (its wait re-took the lock) also sees the ring released. */
  atomic_fetch_sub(&r->users, 1);
  pthread_mutex_unlock(&r->mu);
  return rc;
}

/* Called with r->mu held; may wait (releasing it) while the ring is full. */
static int32_t ring_post_locked(pf_ring *r, const pf_completion *c) {
  for (;;) {
    if (pf_ring_is_shutdown(r)) return PF_ESHUTDOWN;
    uint64_t head = atomic_load_explicit(RING_HEAD(r), memory_order_relaxed);
    uint64_t tail = atomic_load_explicit(RING_TAIL(r), memory_order_acquire);
    if (head - tail < r->capacity) {
      *RING_REC(r, head) = *c;
      atomic_store_explicit(RING_HEAD(r), head + 1, memory_order_release);
      pthread_cond_broadcast(&r->cv);
      return PF_OK;
    }
    struct timespec ts;
    deadline_after(&ts, RING_FULL_POLL_NS);
    pthread_cond_timedwait(&r->cv, &r->mu, &ts);
  }
}

int64_t pf_ring_wait(uint32_t ring, uint64_t seen, int32_t timeout_ms) {
  /* Resolve and register as a user under pf_objects_mu, which
   * pf_ring_destroy also holds: a wait never starts on a freed ring. */
  pthread_mutex_lock(&pf_objects_mu);
  pf_ring *r = pf_handle_get(ring, PF_K_RING, "pf_ring_wait");
  if (!r) {
    pthread_mutex_unlock(&pf_objects_mu);
    return PF_EHANDLE;
  }
  pthread_mutex_lock(&r->mu);
  pf_ring_acquire(r);
  pthread_mutex_unlock(&pf_objects_mu);
  struct timespec ts;
  if (timeout_ms >= 0) deadline_after(&ts, (long)timeout_ms * 1000000L);
  int64_t out;
  for (;;) {
    uint64_t head = atomic_load_explicit(RING_HEAD(r), memory_order_acquire);
    if (head > seen) { out = (int64_t)head; break; }
    if (pf_ring_is_shutdown(r)) { out = PF_ESHUTDOWN; break; }
    if (timeout_ms < 0) {
      pthread_cond_wait(&r->cv, &r->mu);
    } else if (pthread_cond_timedwait(&r->cv, &r->mu, &ts) == ETIMEDOUT) {
      head = atomic_load_explicit(RING_HEAD(r), memory_order_acquire);
      out = head > seen ? (int64_t)head : PF_ETIMEDOUT;
      break;
    }
  }
  pf_ring_release(r);
  pthread_mutex_unlock(&r->mu);
  return out;
}

int32_t pf_ring_shutdown(uint32_t ring) {
  pf_ring *r = pf_handle_get(ring, PF_K_RING, "pf_ring_shutdown");
  if (!r) return PF_EHANDLE;
  pthread_mutex_lock(&r->mu);
  atomic_store_explicit(RING_SHUTDOWN(r), 1, memory_order_release);
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
  return PF_OK;
}

void pf_ring_keep_error(pf_ring *r, uint64_t tag, const char *text) {
  pthread_mutex_lock(&r->mu);
  pf_ring_error *e = &r->errors[r->next_error++ % PF_RING_ERRORS];
  e->tag = tag;
  snprintf(e->text, sizeof e->text, "%s", text);
  pthread_mutex_unlock(&r->mu);
}

int32_t pf_ring_take_error(uint32_t ring, uint64_t tag, char *buf,
                           uint32_t cap) {
  pthread_mutex_lock(&pf_objects_mu);
  pf_ring *r = pf_handle_get(ring, PF_K_RING, "pf_ring_take_error");
  if (!r) {
    pthread_mutex_unlock(&pf_objects_mu);
    return PF_EHANDLE;
  }
  int32_t n = 0;
  pthread_mutex_lock(&r->mu);
  for (uint32_t i = 0; i < PF_RING_ERRORS; i++) {
    pf_ring_error *e = &r->errors[i];
    if (e->tag == tag && e->text[0]) {
      n = pf_text_out(e->text, buf, cap);
      e->tag = 0;
      e->text[0] = 0;
      break;
    }
  }
  pthread_mutex_unlock(&r->mu);
  pthread_mutex_unlock(&pf_objects_mu);
  return n;
}

void pf_ring_acquire(pf_ring *r) { atomic_fetch_add(&r->users, 1); }
void pf_ring_release(pf_ring *r) { atomic_fetch_sub(&r->users, 1); }

int32_t pf_ring_destroy(uint32_t ring) {
  pthread_mutex_lock(&pf_objects_mu);
  pf_ring *r = pf_handle_get(ring, PF_K_RING, "pf_ring_destroy");
  if (!r) {
    pthread_mutex_unlock(&pf_objects_mu);
    return PF_EHANDLE;
  }
  pthread_mutex_lock(&r->mu);
  int users = atomic_load(&r->users);
  if (users > 0) {
    pthread_mutex_unlock(&r->mu);
    pthread_mutex_unlock(&pf_objects_mu);
    return pf_fail(PF_EBUSY,
                   "pf_ring_destroy: %d waiters or batches still use ring %u; "
                   "shut it down and drain first", users, ring);
  }
  pf_handle_free(ring);
  pthread_mutex_unlock(&r->mu);
  pthread_mutex_unlock(&pf_objects_mu);
  pthread_cond_destroy(&r->cv);
  pthread_mutex_destroy(&r->mu);
  munmap(r->mem, r->mem_bytes);
  free(r);
  return PF_OK;
}
