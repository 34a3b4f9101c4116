/*
 * pf_xfer.c — the transport-neutral half of the transfer layer: endpoints
 * and peers behind handles, batch validation (every segment against the
 * local pool and the remote pool before anything moves), planning (merge
 * adjacent segments, cut long ones into stripes, spread them over the
 * peer's lanes in contiguous runs of equal bytes), deadlines and the one
 * PF_DONE_XFER record per batch.
 *
 * The deadline rule lives here (see the slot guard in pf_xfer_internal.h):
 * a batch ends exactly once (whoever closes its guard first: the last part,
 * a failure, the timer, a peer close), and its record is posted only after
 * no transport thread is inside it any more. A transport thread enters the
 * slot for each burst of bytes it moves, never across a blocking call, so
 * the wait is short and bounded.
 *
 * The timer is one thread per endpoint that sleeps until the earliest
 * deadline of the armed slots, and for good while none is armed: an idle
 * endpoint costs no wakeup, and a batch ends within a scheduler wakeup of its
 * deadline. A submit wakes it only when its deadline comes before the wake
 * the timer planned (the first batch after idle, a shorter timeout).
 */
#define _GNU_SOURCE
#include "pf_xfer_internal.h"

#include <errno.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Retry interval of a scan that could not list every due slot (no memory). */
#define XFER_TIMER_RETRY_NS 5000000ull
/* timer_wake_ns while the timer scans: every submit then wakes it again. */
#define XFER_TIMER_SCANNING 0ull
/* timer_wake_ns while no slot is armed: the timer sleeps until a submit. */
#define XFER_TIMER_IDLE UINT64_MAX
#define XFER_MAX_TIMEOUT_MS 3600000u
#define XFER_DEFAULT_STRIPE (1u << 20)
#define XFER_MIN_STRIPE 4096u
#define XFER_MAX_LANES 64u
/* A submit's hold on its peer, counted in p->inflight above the batches
 * (at most PF_XFER_MAX_INFLIGHT): pf_xfer_peer_close waits for both. */
#define XFER_HOLD (1u << 16)
_Static_assert(PF_XFER_MAX_INFLIGHT < XFER_HOLD, "holds count above the batches");

static const xfer_ops *ops_for(uint32_t transport) {
  switch (transport) {
  case PF_XFER_TCP: return &pf_tcp_ops;
  case PF_XFER_RDMA: return &pf_rdma_ops;
  default: return NULL;
  }
}

/* ---- ending batches ---------------------------------------------------- */
static void slot_release(pf_xfer_peer *p, xfer_slot *s) {
  pthread_mutex_lock(&p->mu);
  atomic_store(&s->armed, 0);
  p->free_list[p->nfree++] = s->index;
  p->inflight--;
  if (p->inflight == 0) pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
}

/* The checksum of each group of an OK batch into the caller's out_crcs:
 * chunks are in payload order and each lies in one group, so one pass
 * joins their states in order (pf_crc32c_combine's arithmetic). */
static void batch_checksums(pf_xfer_peer *p, xfer_slot *s) {
  const uint8_t *pool = p->ep->pool->host;
  int land_pass = !p->ep->ops->crc_on_receive;
  uint32_t g = 0, acc = 0;
  uint64_t glen = 0;
  for (uint32_t k = 0; k < s->nchunks; k++) {
    const xfer_chunk *c = &s->chunks[k];
    uint32_t crc = land_pass ? pf_crc32c_raw(0, pool + c->local_off, c->bytes) : c->crc;
    if (c->group != g) {
      s->crc_out[g] = ~(pf_crc32c_shift(~0u, glen) ^ acc);
      g = c->group;
      acc = 0;
      glen = 0;
    }
    acc = pf_crc32c_shift(acc, c->bytes) ^ crc;
    glen += c->bytes;
  }
  s->crc_out[g] = ~(pf_crc32c_shift(~0u, glen) ^ acc);
}

int xfer_end(pf_xfer_peer *p, xfer_slot *s, uint32_t gen, int32_t status) {
  uint64_t w = atomic_load_explicit(&s->guard, memory_order_acquire);
  for (;;) {
    if ((uint32_t)(w >> 32) != gen || (w & XFER_CLOSED)) return 0;
    if (atomic_compare_exchange_weak_explicit(&s->guard, &w, w | XFER_CLOSED,
                                              memory_order_acq_rel,
                                              memory_order_acquire))
      break;
  }
  /* Threads inside only run non-blocking calls: this drains in
   * microseconds, so a yield loop beats a condition variable here. */
  while (atomic_load_explicit(&s->guard, memory_order_acquire) & XFER_INSIDE_MASK)
    sched_yield();
  pf_xfer_ep *ep = p->ep;
  if (status == PF_OK && s->ngroups) batch_checksums(p, s);
  if (status == PF_OK) atomic_fetch_add(&ep->n_ok, 1);
  else if (status == PF_ETIMEDOUT) atomic_fetch_add(&ep->n_timedout, 1);
  else atomic_fetch_add(&ep->n_failed, 1);
  pf_completion c = {.tag = s->tag,
                     .kind = PF_DONE_XFER,
                     .index = s->op,
                     .status = status,
                     .aux = s->nparts,
                     .value = pf_now_ns() - s->submit_ns};
  slot_release(p, s);
  pf_ring_post(ep->ring, &c);
  return 1;
}

void xfer_part_done(pf_xfer_peer *p, xfer_slot *s, uint32_t gen) {
  /* Counted inside the slot: once a thread has left it, the batch may end
   * (timer, failure) and a new batch re-arm the slot, whose parts_left this
   * part must not touch (it would end that batch one part early). */
  if (!xfer_enter(s, gen)) return; /* ended meanwhile: nothing to count */
  unsigned left = atomic_fetch_sub(&s->parts_left, 1) - 1;
  xfer_leave(s);
  if (left == 0) xfer_end(p, s, gen, PF_OK);
}

static void end_all(pf_xfer_peer *p, int32_t status) {
  for (uint32_t i = 0; i < PF_XFER_MAX_INFLIGHT; i++) {
    xfer_slot *s = &p->slots[i];
    if (!atomic_load(&s->armed)) continue;
    uint64_t w = atomic_load(&s->guard);
    xfer_end(p, s, (uint32_t)(w >> 32), status);
  }
}

/* The message is written before `broken` is published, both under p->mu:
 * the first caller writes it, a later one waits on the mutex until it is
 * whole. So a thread that sees `broken` set (any load of it: the store is
 * seq_cst) reads a whole message, which never changes afterwards. Before,
 * the flag was set first and the text after it: a submit or
 * pf_xfer_peer_error that saw the flag could read a half-written message. */
static int mark_broken(pf_xfer_peer *p, int32_t status, const char *fmt, va_list ap) {
  pthread_mutex_lock(&p->mu);
  int first = atomic_load_explicit(&p->broken, memory_order_relaxed) == 0;
  if (first) {
    vsnprintf(p->broken_msg, sizeof p->broken_msg, fmt, ap);
    /* seq_cst: the submit's arming pairs with it (see submit_held). */
    atomic_store(&p->broken, status);
  }
  pthread_mutex_unlock(&p->mu);
  return first;
}

int xfer_peer_mark_broken(pf_xfer_peer *p, int32_t status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int first = mark_broken(p, status, fmt, ap);
  va_end(ap);
  return first;
}

void xfer_peer_fail(pf_xfer_peer *p, int32_t status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  mark_broken(p, status, fmt, ap);
  va_end(ap);
  end_all(p, atomic_load(&p->closing) ? PF_ESHUTDOWN : status);
}

int32_t xfer_env_limit(const char *fn, const char *name, uint32_t def, uint32_t max,
                       const char *unit, uint32_t *out) {
  const char *env = getenv(name);
  *out = def;
  if (!env || !*env) return PF_OK;
  char *end;
  errno = 0;
  unsigned long v = strtoul(env, &end, 10);
  if (*end || env[0] == '-' || errno || v == 0 || v > max)
    return pf_fail(PF_EINVAL, "%s: %s \"%s\"; expected 1..%u%s", fn, name, env, max, unit);
  *out = (uint32_t)v;
  return PF_OK;
}

/* ---- timer ------------------------------------------------------------- */
typedef struct expired_t {
  pf_xfer_peer *p;
  xfer_slot *s;
  uint32_t gen;
} expired_t;

/* Wakes the timer for a batch whose deadline comes before its planned wake. */
static void timer_kick(pf_xfer_ep *ep) {
  pthread_mutex_lock(&ep->timer_mu);
  ep->timer_kick = 1;
  pthread_cond_signal(&ep->timer_cv);
  pthread_mutex_unlock(&ep->timer_mu);
}

/* Ends the armed slots whose deadline passed; returns the earliest deadline
 * of those left (XFER_TIMER_IDLE when none). */
static uint64_t timer_scan(pf_xfer_ep *ep, expired_t **due, uint32_t *cap) {
  uint32_t n = 0;
  uint64_t next = XFER_TIMER_IDLE;
  /* Collect under ep->mu, end outside it (an end may wait for ring room);
   * `scan` keeps the collected peers alive meanwhile. */
  pthread_rwlock_rdlock(&ep->scan);
  pthread_mutex_lock(&ep->mu);
  uint64_t now = pf_now_ns();
  for (pf_xfer_peer *p = ep->peers; p; p = p->next) {
    for (uint32_t i = 0; i < PF_XFER_MAX_INFLIGHT; i++) {
      xfer_slot *s = &p->slots[i];
      if (!atomic_load_explicit(&s->armed, memory_order_acquire)) continue;
      uint64_t w = atomic_load(&s->guard);
      if (w & XFER_CLOSED) continue;
      if (atomic_load(&s->expiring)) continue;
      uint64_t deadline = atomic_load_explicit(&s->deadline_ns, memory_order_relaxed);
      if (deadline > now) {
        if (deadline < next) next = deadline;
        continue;
      }
      if (n == *cap) {
        uint32_t ncap = *cap ? *cap * 2 : 64;
        expired_t *e = realloc(*due, ncap * sizeof **due);
        if (!e) { /* the rest waits for a retry */
          if (now + XFER_TIMER_RETRY_NS < next) next = now + XFER_TIMER_RETRY_NS;
          continue;
        }
        *due = e;
        *cap = ncap;
      }
      (*due)[n++] = (expired_t){p, s, (uint32_t)(w >> 32)};
    }
  }
  pthread_mutex_unlock(&ep->mu);
  for (uint32_t k = 0; k < n; k++) {
    if (ep->ops->expire) ep->ops->expire((*due)[k].p, (*due)[k].s, (*due)[k].gen);
    else xfer_end((*due)[k].p, (*due)[k].s, (*due)[k].gen, PF_ETIMEDOUT);
  }
  pthread_rwlock_unlock(&ep->scan);
  return next;
}

static void *timer_main(void *arg) {
  pthread_setname_np(pthread_self(), "pf-xfer-timer");
  pf_xfer_ep *ep = arg;
  expired_t *due = NULL;
  uint32_t cap = 0;
  pthread_mutex_lock(&ep->timer_mu);
  while (!ep->timer_stop) {
    /* Scanning: a submit from here on wakes the timer again (Dekker with
     * pf_xfer_submit: either the scan sees its slot armed, or the submit
     * sees XFER_TIMER_SCANNING or a wake after its deadline, and kicks). */
    ep->timer_kick = 0;
    atomic_store(&ep->timer_wake_ns, XFER_TIMER_SCANNING);
    atomic_thread_fence(memory_order_seq_cst);
    pthread_mutex_unlock(&ep->timer_mu);
    uint64_t next = timer_scan(ep, &due, &cap);
    pthread_mutex_lock(&ep->timer_mu);
    if (ep->timer_stop) break;
    if (ep->timer_kick) continue; /* a submit raced the scan: scan again */
    atomic_store(&ep->timer_wake_ns, next);
    if (next == XFER_TIMER_IDLE) {
      pthread_cond_wait(&ep->timer_cv, &ep->timer_mu);
    } else {
      struct timespec ts = {.tv_sec = (time_t)(next / 1000000000ull),
                            .tv_nsec = (long)(next % 1000000000ull)};
      pthread_cond_timedwait(&ep->timer_cv, &ep->timer_mu, &ts);
    }
  }
  pthread_mutex_unlock(&ep->timer_mu);
  free(due);
  return NULL;
}

/* ---- endpoint ---------------------------------------------------------- */
int32_t pf_xfer_open(uint32_t pool, uint32_t ring, const pf_xfer_config *cfg,
                     uint64_t cfg_bytes, uint32_t *out_ep) {
  if (!cfg || !out_ep) return pf_fail(PF_EINVAL, "pf_xfer_open: cfg or out_ep is NULL");
  if (cfg_bytes != sizeof(pf_xfer_config))
    return pf_fail(PF_EINVAL, "pf_xfer_open: config is %llu bytes; expected %zu",
                   (unsigned long long)cfg_bytes, sizeof(pf_xfer_config));
  const xfer_ops *ops = ops_for(cfg->transport);
  if (!ops)
    return pf_fail(PF_EINVAL, "pf_xfer_open: transport %u; expected 1 (tcp) or 2 (rdma)",
                   cfg->transport);
  if (cfg->streams == 0 || cfg->streams > XFER_MAX_LANES)
    return pf_fail(PF_EINVAL, "pf_xfer_open(%s): streams (%s per peer) %u; expected 1..%u",
                   ops->name, cfg->transport == PF_XFER_TCP ? "sockets" : "QPs per NIC",
                   cfg->streams, XFER_MAX_LANES);
  if (cfg->stripe_bytes && cfg->stripe_bytes < XFER_MIN_STRIPE)
    return pf_fail(PF_EINVAL, "pf_xfer_open(%s): stripe_bytes %u below %u",
                   ops->name, cfg->stripe_bytes, XFER_MIN_STRIPE);
  if (cfg->flags)
    return pf_fail(PF_EINVAL, "pf_xfer_open(%s): flags 0x%x must be 0", ops->name, cfg->flags);
  if (cfg->port > 65535)
    return pf_fail(PF_EINVAL, "pf_xfer_open(%s): port %u exceeds 65535", ops->name, cfg->port);
  if (!memchr(cfg->bind_addr, 0, sizeof cfg->bind_addr) || !memchr(cfg->nics, 0, sizeof cfg->nics))
    return pf_fail(PF_EINVAL, "pf_xfer_open(%s): bind_addr or nics is not NUL-terminated",
                   ops->name);

  pf_xfer_ep *ep = calloc(1, sizeof *ep);
  if (!ep) return pf_fail(PF_ENOMEM, "pf_xfer_open: out of memory");
  ep->ops = ops;
  ep->cfg = *cfg;
  if (!ep->cfg.stripe_bytes) ep->cfg.stripe_bytes = XFER_DEFAULT_STRIPE;
  pthread_mutex_init(&ep->mu, NULL);
  pthread_mutex_init(&ep->timer_mu, NULL);
  /* Writer preference: the RDMA poller re-takes the read side every loop,
   * and a peer close must still get through. */
  pthread_rwlockattr_t ra;
  pthread_rwlockattr_init(&ra);
  pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
  pthread_rwlock_init(&ep->scan, &ra);
  pthread_rwlockattr_destroy(&ra);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&ep->timer_cv, &ca);
  pthread_condattr_destroy(&ca);

  /* Resolve and count pool + ring under pf_objects_mu, like a copy batch:
   * destroying either fails with PF_EBUSY until pf_xfer_close. */
  pthread_mutex_lock(&pf_objects_mu);
  ep->pool = pf_handle_get(pool, PF_K_POOL, "pf_xfer_open(pool)");
  ep->ring = ep->pool ? pf_handle_get(ring, PF_K_RING, "pf_xfer_open(ring)") : NULL;
  if (!ep->pool || !ep->ring) {
    pthread_mutex_unlock(&pf_objects_mu);
    free(ep);
    return PF_EHANDLE;
  }
  if (pf_ring_is_shutdown(ep->ring)) {
    pthread_mutex_unlock(&pf_objects_mu);
    free(ep);
    return pf_fail(PF_ESHUTDOWN, "pf_xfer_open: ring %u is shut down", ring);
  }
  atomic_fetch_add(&ep->pool->inflight, 1);
  pf_ring_acquire(ep->ring);
  pthread_mutex_unlock(&pf_objects_mu);

  int32_t rc = ops->open(ep);
  if (rc < 0) goto fail;
  ep->handle = pf_handle_new(PF_K_XFER, ep);
  if (!ep->handle) {
    ops->close(ep);
    rc = PF_ENOMEM;
    goto fail;
  }
  int e = pthread_create(&ep->timer, NULL, timer_main, ep);
  if (e) {
    pf_handle_free(ep->handle);
    ops->close(ep);
    rc = pf_fail(PF_ENOMEM, "pf_xfer_open: cannot start the timer thread: %s", strerror(e));
    goto fail;
  }
  *out_ep = ep->handle;
  return PF_OK;
fail:
  atomic_fetch_sub(&ep->pool->inflight, 1);
  pf_ring_release(ep->ring);
  free(ep);
  return rc;
}

_Static_assert(sizeof(pf_xfer_stats) == 96, "pf_xfer_stats layout");
_Static_assert(offsetof(pf_xfer_stats, conns_refused) == 80, "pf_xfer_stats layout");
_Static_assert(offsetof(pf_xfer_stats, submitted) == 16, "pf_xfer_stats layout");

/* Under pf_objects_mu, which pf_xfer_close retires the handle under (on
 * another thread: the FFI call is nonblocking): the endpoint cannot be
 * freed while it is read (a metrics scrape during a close read a freed
 * endpoint before). Short: counters and ep->mu only. */
int32_t pf_xfer_info(uint32_t h, pf_xfer_stats *out) {
  if (!out) return pf_fail(PF_EINVAL, "pf_xfer_info: out is NULL");
  pthread_mutex_lock(&pf_objects_mu);
  pf_xfer_ep *ep = pf_handle_get(h, PF_K_XFER, "pf_xfer_info");
  if (!ep) {
    pthread_mutex_unlock(&pf_objects_mu);
    return PF_EHANDLE;
  }
  memset(out, 0, sizeof *out);
  out->transport = ep->cfg.transport;
  out->listen_port = ep->listen_port;
  out->streams = ep->cfg.streams;
  pthread_mutex_lock(&ep->mu);
  out->peers = ep->npeers;
  pthread_mutex_unlock(&ep->mu);
  out->submitted = atomic_load(&ep->n_submitted);
  out->ok = atomic_load(&ep->n_ok);
  out->failed = atomic_load(&ep->n_failed);
  out->timed_out = atomic_load(&ep->n_timedout);
  out->late_bytes = atomic_load(&ep->late_bytes);
  out->serving_connections = atomic_load(&ep->conns_open);
  out->bytes_served = atomic_load(&ep->bytes_served);
  out->bytes_landed = atomic_load(&ep->bytes_landed);
  out->conns_refused = atomic_load(&ep->conns_refused);
  out->accept_errors = atomic_load(&ep->accept_errors);
  pthread_mutex_unlock(&pf_objects_mu);
  return PF_OK;
}

int32_t pf_xfer_close(uint32_t h) {
  pthread_mutex_lock(&pf_objects_mu);
  pf_xfer_ep *ep = pf_handle_get(h, PF_K_XFER, "pf_xfer_close");
  if (!ep) {
    pthread_mutex_unlock(&pf_objects_mu);
    return PF_EHANDLE;
  }
  pthread_mutex_lock(&ep->mu);
  uint32_t n = ep->npeers;
  pthread_mutex_unlock(&ep->mu);
  if (n) {
    pthread_mutex_unlock(&pf_objects_mu);
    return pf_fail(PF_EBUSY, "pf_xfer_close: endpoint %u still has %u peers; close them first",
                   h, n);
  }
  pf_handle_free(h);
  pthread_mutex_unlock(&pf_objects_mu);
  pthread_mutex_lock(&ep->timer_mu);
  ep->timer_stop = 1;
  pthread_cond_broadcast(&ep->timer_cv);
  pthread_mutex_unlock(&ep->timer_mu);
  pthread_join(ep->timer, NULL);
  ep->ops->close(ep);
  pthread_mutex_lock(&pf_objects_mu);
  atomic_fetch_sub(&ep->pool->inflight, 1);
  pf_ring_release(ep->ring);
  pthread_mutex_unlock(&pf_objects_mu);
  pthread_cond_destroy(&ep->timer_cv);
  pthread_mutex_destroy(&ep->timer_mu);
  pthread_mutex_destroy(&ep->mu);
  pthread_rwlock_destroy(&ep->scan);
  free(ep);
  return PF_OK;
}

/* ---- peers ------------------------------------------------------------- */
/* Undoes peer_create's reservation of a place among ep's peers. */
static void peer_unreserve(pf_xfer_ep *ep) {
  pthread_mutex_lock(&ep->mu);
  ep->npeers--;
  pthread_mutex_unlock(&ep->mu);
}

/* The new peer is counted in ep->npeers from the lookup (under
 * pf_objects_mu, which pf_xfer_close checks the count and retires the
 * handle under): a close racing the create answers PF_EBUSY instead of
 * freeing the endpoint under it. */
int32_t pf_xfer_peer_create(uint32_t h, uint32_t *out_peer) {
  if (!out_peer) return pf_fail(PF_EINVAL, "pf_xfer_peer_create: out_peer is NULL");
  pthread_mutex_lock(&pf_objects_mu);
  pf_xfer_ep *ep = pf_handle_get(h, PF_K_XFER, "pf_xfer_peer_create");
  if (ep) {
    pthread_mutex_lock(&ep->mu);
    ep->npeers++;
    pthread_mutex_unlock(&ep->mu);
  }
  pthread_mutex_unlock(&pf_objects_mu);
  if (!ep) return PF_EHANDLE;
  pf_xfer_peer *p = calloc(1, sizeof *p);
  if (!p) {
    peer_unreserve(ep);
    return pf_fail(PF_ENOMEM, "pf_xfer_peer_create: out of memory");
  }
  p->ep = ep;
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv, NULL);
  for (uint32_t i = 0; i < PF_XFER_MAX_INFLIGHT; i++) {
    p->slots[i].index = i;
    /* Fresh slots are closed: nothing can enter them before they are armed. */
    atomic_store(&p->slots[i].guard, XFER_CLOSED);
    p->free_list[i] = PF_XFER_MAX_INFLIGHT - 1 - i;
  }
  p->nfree = PF_XFER_MAX_INFLIGHT;
  int32_t rc = ep->ops->peer_create(p);
  if (rc < 0) goto fail;
  p->handle = pf_handle_new(PF_K_XPEER, p);
  if (!p->handle) {
    ep->ops->peer_shutdown(p);
    ep->ops->peer_free(p);
    rc = PF_ENOMEM;
    goto fail;
  }
  pthread_mutex_lock(&ep->mu);
  p->next = ep->peers;
  ep->peers = p; /* counted in npeers since the lookup */
  pthread_mutex_unlock(&ep->mu);
  *out_peer = p->handle;
  return PF_OK;
fail:
  peer_unreserve(ep);
  pthread_cond_destroy(&p->cv);
  pthread_mutex_destroy(&p->mu);
  free(p);
  return rc;
}

/* Holds peer h from its lookup (under pf_objects_mu, which
 * pf_xfer_peer_close retires the handle under) until peer_release: a close
 * racing the call waits for it instead of freeing the peer under it. Every
 * entry point that takes a peer handle goes through here. */
static pf_xfer_peer *peer_hold(uint32_t h, const char *fn) {
  pthread_mutex_lock(&pf_objects_mu);
  pf_xfer_peer *p = pf_handle_get(h, PF_K_XPEER, fn);
  if (p) {
    pthread_mutex_lock(&p->mu);
    p->inflight += XFER_HOLD;
    pthread_mutex_unlock(&p->mu);
  }
  pthread_mutex_unlock(&pf_objects_mu);
  return p;
}

static int32_t peer_release(pf_xfer_peer *p, int32_t rc) {
  pthread_mutex_lock(&p->mu);
  p->inflight -= XFER_HOLD;
  if (p->inflight < XFER_HOLD) pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
  return rc;
}

int32_t pf_xfer_peer_info(uint32_t h, uint8_t *buf, uint32_t cap) {
  pf_xfer_peer *p = peer_hold(h, "pf_xfer_peer_info");
  if (!p) return PF_EHANDLE;
  return peer_release(p, p->ep->ops->peer_info(p, buf, cap));
}

static int32_t connect_held(pf_xfer_peer *p, uint32_t h, const uint8_t *remote, uint32_t len,
                            int32_t timeout_ms) {
  if (!remote || !len) return pf_fail(PF_EINVAL, "pf_xfer_peer_connect: remote info is empty");
  if (timeout_ms <= 0)
    return pf_fail(PF_EINVAL, "pf_xfer_peer_connect: timeout_ms %d must be > 0", timeout_ms);
  if (atomic_load(&p->connected))
    return pf_fail(PF_EINVAL, "pf_xfer_peer_connect: peer %u is already connected", h);
  if (atomic_load(&p->closing))
    return pf_fail(PF_ESHUTDOWN, "pf_xfer_peer_connect: peer %u is closing", h);
  /* One connect at a time: two would build the transport's streams over
   * each other. */
  int idle = 0;
  if (!atomic_compare_exchange_strong(&p->connecting, &idle, 1))
    return pf_fail(PF_EBUSY, "pf_xfer_peer_connect: peer %u: a connect is already under way", h);
  /* The transport gives up early (PF_ESHUTDOWN) once p->closing is set. */
  int32_t rc = p->ep->ops->peer_connect(p, remote, len, timeout_ms);
  if (rc == PF_OK && atomic_load(&p->closing)) {
    /* Connected as the close began: the close shuts the streams down. */
    rc = pf_fail(PF_ESHUTDOWN, "pf_xfer_peer_connect: peer %u was closed while it connected",
                 h);
  } else if (rc == PF_OK) {
    atomic_store(&p->connected, 1);
  }
  pthread_mutex_lock(&p->mu); /* pf_xfer_peer_error reads it under p->mu */
  if (rc < 0) pf_last_error(p->connect_msg, sizeof p->connect_msg);
  else p->connect_msg[0] = 0;
  pthread_mutex_unlock(&p->mu);
  atomic_store(&p->connecting, 0);
  return rc;
}

/* Holds the peer for the whole connect: pf_xfer_peer_close sets `closing`
 * (which the transport's waits watch), waits for the connect to give up,
 * and only then tears the transport down and frees the peer. */
int32_t pf_xfer_peer_connect(uint32_t h, const uint8_t *remote, uint32_t len,
                             int32_t timeout_ms) {
  pf_xfer_peer *p = peer_hold(h, "pf_xfer_peer_connect");
  if (!p) return PF_EHANDLE;
  return peer_release(p, connect_held(p, h, remote, len, timeout_ms));
}

_Static_assert(sizeof(pf_xfer_peer_status) == 24, "pf_xfer_peer_status layout");
_Static_assert(offsetof(pf_xfer_peer_status, broken) == 16, "pf_xfer_peer_status layout");

int32_t pf_xfer_peer_state(uint32_t h, pf_xfer_peer_status *out) {
  if (!out) return pf_fail(PF_EINVAL, "pf_xfer_peer_state: out is NULL");
  pf_xfer_peer *p = peer_hold(h, "pf_xfer_peer_state");
  if (!p) return PF_EHANDLE;
  memset(out, 0, sizeof *out);
  out->connected = atomic_load(&p->connected) ? 1u : 0u;
  /* A connect on another thread writes remote_bytes before it sets
   * `connected` and never after (a connected peer refuses a second
   * connect): read it only once `connected` is seen (before: a data race
   * with the transport's write). */
  if (out->connected) out->remote_bytes = p->remote_bytes;
  pthread_mutex_lock(&p->mu);
  /* Batches, not the calls holding the peer (this one among them). */
  out->inflight = p->inflight % XFER_HOLD;
  pthread_mutex_unlock(&p->mu);
  out->broken = atomic_load(&p->broken);
  return peer_release(p, PF_OK);
}

int32_t pf_xfer_peer_error(uint32_t h, char *buf, uint32_t cap) {
  pf_xfer_peer *p = peer_hold(h, "pf_xfer_peer_error");
  if (!p) return PF_EHANDLE;
  int32_t n;
  if (atomic_load(&p->broken)) {
    n = pf_text_out(p->broken_msg, buf, cap);
  } else {
    /* A connect on another thread writes it under p->mu. */
    pthread_mutex_lock(&p->mu);
    n = pf_text_out(p->connect_msg, buf, cap);
    pthread_mutex_unlock(&p->mu);
  }
  return peer_release(p, n);
}

int32_t pf_xfer_peer_close(uint32_t h) {
  pthread_mutex_lock(&pf_objects_mu);
  pf_xfer_peer *p = pf_handle_get(h, PF_K_XPEER, "pf_xfer_peer_close");
  if (!p) {
    pthread_mutex_unlock(&pf_objects_mu);
    return PF_EHANDLE;
  }
  pf_handle_free(h);
  pthread_mutex_unlock(&pf_objects_mu);
  pf_xfer_ep *ep = p->ep;
  atomic_store(&p->closing, 1);
  /* Calls that looked the peer up before its handle was retired finish
   * first (a connect gives up at its next look at `closing`; a submit
   * either refuses or ends the batch it armed): none of them is inside the
   * transport when it is shut down. */
  pthread_mutex_lock(&p->mu);
  while (p->inflight >= XFER_HOLD) pthread_cond_wait(&p->cv, &p->mu);
  pthread_mutex_unlock(&p->mu);
  ep->ops->peer_shutdown(p);
  end_all(p, PF_ESHUTDOWN);
  pthread_mutex_lock(&p->mu);
  while (p->inflight) pthread_cond_wait(&p->cv, &p->mu);
  pthread_mutex_unlock(&p->mu);
  /* Unlink, then wait out any timer/poller pass that may still hold p. */
  pthread_mutex_lock(&ep->mu);
  for (pf_xfer_peer **pp = &ep->peers; *pp; pp = &(*pp)->next)
    if (*pp == p) {
      *pp = p->next;
      break;
    }
  ep->npeers--;
  pthread_mutex_unlock(&ep->mu);
  pthread_rwlock_wrlock(&ep->scan);
  pthread_rwlock_unlock(&ep->scan);
  ep->ops->peer_free(p);
  for (uint32_t i = 0; i < PF_XFER_MAX_INFLIGHT; i++) {
    free(p->slots[i].chunks);
    free(p->slots[i].parts);
    free(p->slots[i].impl);
  }
  pthread_cond_destroy(&p->cv);
  pthread_mutex_destroy(&p->mu);
  free(p);
  return PF_OK;
}

/* ---- submit ------------------------------------------------------------ */
static int grow(void **arr, uint32_t *cap, uint32_t need, size_t elem) {
  if (need <= *cap) return 0;
  uint32_t n = *cap ? *cap : 64;
  while (n < need) n *= 2;
  void *a = realloc(*arr, (size_t)n * elem);
  if (!a) return -1;
  *arr = a;
  *cap = n;
  return 0;
}

/* Walks a batch's segments as maximal runs that are contiguous on both
 * sides and lie in one checksum group (a batch without groups is one
 * endless group), so a run never straddles two groups' checksums. */
typedef struct run_iter {
  const pf_xfer_seg *segs;
  uint32_t n, i;
  uint64_t in_seg;
  const uint64_t *groups;
  uint32_t ngroups, g;
  uint64_t g_left;
} run_iter;

static void runs_begin(run_iter *it, const pf_xfer_seg *segs, uint32_t n, const uint64_t *groups,
                       uint32_t ngroups) {
  *it = (run_iter){.segs = segs, .n = n, .groups = groups, .ngroups = ngroups,
                   .g_left = ngroups ? groups[0] : UINT64_MAX};
}

static int runs_next(run_iter *it, uint64_t *r, uint64_t *l, uint64_t *b, uint32_t *g) {
  if (it->i >= it->n) return 0;
  *r = it->segs[it->i].remote_off + it->in_seg;
  *l = it->segs[it->i].local_off + it->in_seg;
  *b = 0;
  *g = it->g;
  for (;;) {
    uint64_t avail = it->segs[it->i].bytes - it->in_seg;
    uint64_t take = avail < it->g_left ? avail : it->g_left;
    *b += take;
    it->in_seg += take;
    it->g_left -= take;
    if (it->in_seg == it->segs[it->i].bytes) {
      it->i++;
      it->in_seg = 0;
    }
    if (it->g_left == 0) {
      if (++it->g < it->ngroups) it->g_left = it->groups[it->g];
      return 1;
    }
    if (it->i >= it->n) return 1;
    const pf_xfer_seg *nx = &it->segs[it->i];
    if (nx->remote_off != *r + *b || nx->local_off != *l + *b) return 1;
  }
}

/* Merges adjacent segments (remote and local both contiguous, same checksum
 * group), cuts pieces of at most `stripe` bytes, and spreads them over
 * `lanes` in contiguous runs of about equal bytes (a run's imbalance is at
 * most one stripe); a run longer than max_part chunks becomes several parts. */
static int32_t plan(xfer_slot *s, const pf_xfer_seg *segs, uint32_t n, const uint64_t *groups,
                    uint32_t ngroups, uint64_t stripe, uint32_t lanes, uint32_t max_part) {
  uint64_t pieces = 0, total = 0, r, l, b;
  uint32_t g;
  run_iter it;
  runs_begin(&it, segs, n, groups, ngroups);
  while (runs_next(&it, &r, &l, &b, &g)) {
    pieces += (b + stripe - 1) / stripe;
    total += b;
  }
  if (pieces > UINT32_MAX / 2)
    return pf_fail(PF_EINVAL, "pf_xfer_submit: batch cuts into %llu pieces; too many",
                   (unsigned long long)pieces);
  if (grow((void **)&s->chunks, &s->cap_chunks, (uint32_t)pieces, sizeof(xfer_chunk)))
    return pf_fail(PF_ENOMEM, "pf_xfer_submit: out of memory for %llu pieces",
                   (unsigned long long)pieces);
  uint32_t k = 0;
  runs_begin(&it, segs, n, groups, ngroups);
  while (runs_next(&it, &r, &l, &b, &g)) {
    for (uint64_t off = 0; off < b; off += stripe) {
      uint64_t len = b - off < stripe ? b - off : stripe;
      s->chunks[k++] = (xfer_chunk){r + off, l + off, len, g, 0};
    }
  }
  s->nchunks = k;
  s->bytes = total;
  /* Lanes actually used: no lane gets less than one stripe of work. */
  uint64_t use = (total + stripe - 1) / stripe;
  if (use > lanes) use = lanes;
  if (use > k) use = k;
  if (use == 0) use = 1;
  uint32_t max_parts = k + (uint32_t)use;
  if (grow((void **)&s->parts, &s->cap_parts, max_parts, sizeof(xfer_part)))
    return pf_fail(PF_ENOMEM, "pf_xfer_submit: out of memory for parts");
  uint32_t np = 0, lane = 0;
  uint64_t acc = 0;
  xfer_part *cur = NULL;
  for (uint32_t i = 0; i < k; i++) {
    /* Next lane once this one holds its share of the bytes. */
    while (lane + 1 < use && acc >= (total * (lane + 1)) / use) {
      lane++;
      cur = NULL;
    }
    if (!cur || cur->lane != lane || cur->n == max_part) {
      cur = &s->parts[np++];
      *cur = (xfer_part){.lane = lane, .first = i, .n = 0, .bytes = 0};
    }
    cur->n++;
    cur->bytes += s->chunks[i].bytes;
    acc += s->chunks[i].bytes;
  }
  s->nparts = np;
  return PF_OK;
}

/* Takes back the batch a submit armed but could not queue, returning
 * `status` with no record: the submit runs on the JS thread, the ring's only
 * consumer, so posting a record there would wait for ever on a full ring.
 * If another thread (a peer failure's end_all) ended the batch first, that
 * thread posts its record and the submit has queued it: PF_OK. */
static int32_t submit_unwind(pf_xfer_peer *p, xfer_slot *s, int32_t status) {
  uint32_t gen = s->gen;
  uint64_t w = atomic_load_explicit(&s->guard, memory_order_acquire);
  for (;;) {
    if ((uint32_t)(w >> 32) != gen || (w & XFER_CLOSED)) {
      atomic_fetch_add(&p->ep->n_submitted, 1);
      return PF_OK;
    }
    if (atomic_compare_exchange_weak_explicit(&s->guard, &w, w | XFER_CLOSED,
                                              memory_order_acq_rel, memory_order_acquire))
      break;
  }
  /* Transport threads inside (parts queued before the failure) leave within
   * one non-blocking call, as in xfer_end. */
  while (atomic_load_explicit(&s->guard, memory_order_acquire) & XFER_INSIDE_MASK)
    sched_yield();
  slot_release(p, s);
  return status;
}

static int32_t submit_held(pf_xfer_peer *p, uint32_t h, const void *desc, uint64_t desc_bytes,
                           uint64_t tag, uint32_t *out_crcs) {
  pf_xfer_ep *ep = p->ep;
  if (!atomic_load(&p->connected))
    return pf_fail(PF_EINVAL, "pf_xfer_submit: peer %u is not connected", h);
  int broken = atomic_load(&p->broken);
  if (broken)
    return pf_fail(PF_EIO, "pf_xfer_submit: peer %u is broken (%s); close it and reconnect",
                   h, p->broken_msg);
  if (pf_ring_is_shutdown(ep->ring))
    return pf_fail(PF_ESHUTDOWN, "pf_xfer_submit: the completion ring is shut down");
  if (!desc || desc_bytes < sizeof(pf_xfer_header))
    return pf_fail(PF_EINVAL, "pf_xfer_submit: descriptor of %llu bytes is shorter than its "
                   "%zu-byte header", (unsigned long long)desc_bytes, sizeof(pf_xfer_header));
  /* Segments and groups are u64s read in place: a misaligned read is
   * undefined behaviour. */
  if ((uintptr_t)desc & 7u)
    return pf_fail(PF_EINVAL, "pf_xfer_submit: descriptor at %p is not 8-byte aligned", desc);
  const pf_xfer_header *hd = desc;
  const pf_xfer_seg *segs = (const pf_xfer_seg *)(hd + 1);
  if (hd->op > PF_XFER_WRITE_IMM)
    return pf_fail(PF_EINVAL, "pf_xfer_submit: op %u; expected 0 (read), 1 (write) or 2 "
                   "(write_imm)", hd->op);
  if (hd->num_segs == 0 || hd->num_segs > PF_XFER_MAX_SEGS)
    return pf_fail(PF_EINVAL, "pf_xfer_submit: num_segs %u; expected 1..%u", hd->num_segs,
                   PF_XFER_MAX_SEGS);
  if (hd->num_groups > PF_XFER_MAX_SEGS)
    return pf_fail(PF_EINVAL, "pf_xfer_submit: num_groups %u; expected 0..%u", hd->num_groups,
                   PF_XFER_MAX_SEGS);
  uint64_t need = sizeof *hd + (uint64_t)hd->num_segs * sizeof(pf_xfer_seg) +
                  (uint64_t)hd->num_groups * sizeof(uint64_t);
  if (desc_bytes != need)
    return pf_fail(PF_EINVAL, "pf_xfer_submit: descriptor is %llu bytes; %u segments and %u "
                   "checksum groups need %llu", (unsigned long long)desc_bytes, hd->num_segs,
                   hd->num_groups, (unsigned long long)need);
  if (hd->num_groups && hd->op != PF_XFER_READ)
    return pf_fail(PF_EINVAL, "pf_xfer_submit: checksum groups are for read batches (op %u)",
                   hd->op);
  if (hd->num_groups && !out_crcs)
    return pf_fail(PF_EINVAL, "pf_xfer_submit: %u checksum groups but out_crcs is NULL",
                   hd->num_groups);
  if (hd->timeout_ms == 0 || hd->timeout_ms > XFER_MAX_TIMEOUT_MS)
    return pf_fail(PF_EINVAL, "pf_xfer_submit: timeout_ms %u; expected 1..%u", hd->timeout_ms,
                   XFER_MAX_TIMEOUT_MS);
  if (hd->reserved || (hd->op != PF_XFER_WRITE_IMM && hd->imm))
    return pf_fail(PF_EINVAL, "pf_xfer_submit: reserved must be 0 and imm is only for write_imm");
  uint64_t local = ep->pool->bytes, remote = p->remote_bytes, total = 0;
  for (uint32_t i = 0; i < hd->num_segs; i++) {
    const pf_xfer_seg *g = &segs[i];
    total += g->bytes; /* a sum that wrapped belongs to a batch refused below */
    if (g->bytes == 0)
      return pf_fail(PF_EINVAL, "pf_xfer_submit: segment %u has 0 bytes", i);
    if (g->local_off > local || g->bytes > local - g->local_off)
      return pf_fail(PF_ERANGE, "pf_xfer_submit: segment %u: local_off %llu + bytes %llu "
                     "exceeds the local pool's %llu bytes", i,
                     (unsigned long long)g->local_off, (unsigned long long)g->bytes,
                     (unsigned long long)local);
    if (g->remote_off > remote || g->bytes > remote - g->remote_off)
      return pf_fail(PF_ERANGE, "pf_xfer_submit: segment %u: remote_off %llu + bytes %llu "
                     "exceeds the remote pool's %llu bytes", i,
                     (unsigned long long)g->remote_off, (unsigned long long)g->bytes,
                     (unsigned long long)remote);
  }
  const uint64_t *groups = (const uint64_t *)(segs + hd->num_segs);
  uint64_t grouped = 0;
  for (uint32_t g = 0; g < hd->num_groups; g++) {
    if (groups[g] == 0 || groups[g] > total - grouped)
      return pf_fail(PF_EINVAL, "pf_xfer_submit: checksum group %u of %llu bytes: groups must "
                     "be > 0 and cover the segments' %llu bytes exactly", g,
                     (unsigned long long)groups[g], (unsigned long long)total);
    grouped += groups[g];
  }
  if (hd->num_groups && grouped != total)
    return pf_fail(PF_EINVAL, "pf_xfer_submit: checksum groups cover %llu bytes; the segments "
                   "%llu", (unsigned long long)grouped, (unsigned long long)total);
  pthread_mutex_lock(&p->mu);
  if (atomic_load(&p->closing)) {
    pthread_mutex_unlock(&p->mu);
    return pf_fail(PF_ESHUTDOWN, "pf_xfer_submit: peer %u is closing", h);
  }
  if (p->nfree == 0) {
    pthread_mutex_unlock(&p->mu);
    return pf_fail(PF_EOVERFLOW, "pf_xfer_submit: peer %u has %u batches in flight (the most)",
                   h, PF_XFER_MAX_INFLIGHT);
  }
  xfer_slot *s = &p->slots[p->free_list[--p->nfree]];
  p->inflight++;
  pthread_mutex_unlock(&p->mu);

  int32_t rc = plan(s, segs, hd->num_segs, groups, hd->num_groups, ep->cfg.stripe_bytes,
                    p->lanes, ep->ops->max_part_chunks);
  if (rc < 0) {
    pthread_mutex_lock(&p->mu);
    p->free_list[p->nfree++] = s->index;
    p->inflight--;
    pthread_mutex_unlock(&p->mu);
    return rc;
  }
  s->op = hd->op;
  s->imm = hd->imm;
  s->ngroups = hd->num_groups;
  s->crc_out = hd->num_groups ? out_crcs : NULL;
  s->tag = tag;
  s->submit_ns = pf_now_ns();
  uint64_t deadline = s->submit_ns + (uint64_t)hd->timeout_ms * 1000000ull;
  atomic_store_explicit(&s->deadline_ns, deadline, memory_order_relaxed);
  atomic_store(&s->expiring, 0);
  atomic_store(&s->parts_left, s->nparts + (hd->op == PF_XFER_WRITE_IMM ? 1u : 0u));
  s->gen = s->gen + 1 ? s->gen + 1 : 1;
  /* Publish: everything above is visible to whoever enters with this gen. */
  atomic_store_explicit(&s->guard, (uint64_t)s->gen << 32, memory_order_release);
  atomic_store_explicit(&s->armed, 1, memory_order_release);
  /* The timer sleeps until the earliest deadline it saw: wake it if this
   * one comes first, or if it is scanning and may have missed this slot
   * (the scanning mark is 0, below every deadline: compared as a wake, it
   * never kicked, and a short batch armed behind a scan waited out the
   * longer wake the scan planned). */
  atomic_thread_fence(memory_order_seq_cst);
  uint64_t wake = atomic_load(&ep->timer_wake_ns);
  if (wake == XFER_TIMER_SCANNING || deadline < wake) timer_kick(ep);
  /* A peer that broke since the check above ended its batches without this
   * one if end_all looked before the slot was armed (and a dead stream never
   * sends its parts); a close that began since then waits for this call
   * before its end_all. Either way the batch is taken back now, not left to
   * its deadline. The fence above orders the arming before these loads, as
   * xfer_peer_fail sets `broken` and pf_xfer_peer_close `closing` before
   * end_all looks. */
  if (atomic_load(&p->closing))
    return submit_unwind(p, s, pf_fail(PF_ESHUTDOWN, "pf_xfer_submit: peer %u is closing", h));
  if (atomic_load(&p->broken))
    return submit_unwind(p, s, pf_fail(PF_EIO, "pf_xfer_submit: peer %u broke as the batch was "
                                       "queued (%s); close it and reconnect", h, p->broken_msg));
  rc = ep->ops->submit(p, s);
  if (rc < 0) {
    char why[PF_ERROR_TEXT_BYTES];
    pf_last_error(why, sizeof why);
    return submit_unwind(p, s, pf_fail(rc, "pf_xfer_submit: peer %u: the %s transport could "
                                       "not queue the batch: %s", h, ep->ops->name, why));
  }
  atomic_fetch_add(&ep->n_submitted, 1);
  return PF_OK;
}

/* Holds the peer (peer_hold) from its lookup to the return, so a close
 * racing the submit waits for it instead of freeing the peer under it. */
int32_t pf_xfer_submit(uint32_t h, const void *desc, uint64_t desc_bytes, uint64_t tag,
                       uint32_t *out_crcs) {
  pf_xfer_peer *p = peer_hold(h, "pf_xfer_submit");
  if (!p) return PF_EHANDLE;
  return peer_release(p, submit_held(p, h, desc, desc_bytes, tag, out_crcs));
}
