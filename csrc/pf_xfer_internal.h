/*
 * pf_xfer_internal.h — what the transfer layer's files share: the endpoint,
 * peer and batch-slot objects, the slot guard that enforces the deadline
 * rule, and the table of operations a transport (TCP, RDMA) implements.
 * pf_xfer.c owns validation, planning, deadlines and completions; a
 * transport only moves the planned parts and reports them.
 */
#ifndef PF_XFER_INTERNAL_H
#define PF_XFER_INTERNAL_H

#include "pf_internal.h"
#include "pf_xfer.h"

/* Handle kinds of the transfer layer (pf_internal.h's enum pf_kind holds
 * the core's; these sit far above it so neither list has to know the other). */
enum pf_xfer_kind { PF_K_XFER = 32, PF_K_XPEER = 33 };

/*
 * Slot guard: one 64-bit word per batch slot,
 *
 *   bits 63..32  generation of the batch the slot holds now
 *   bit  31      CLOSED: the batch has ended (or is ending); nobody may enter
 *   bits 30..0   threads inside the batch (touching its local pool ranges)
 *
 * A thread may write into (or read from) a batch's local pool ranges only
 * between xfer_enter(slot, gen) == 1 and xfer_leave(slot). Ending a batch
 * sets CLOSED and then waits for the count to drain before its record is
 * posted, so once the caller sees the record, no byte of that batch touches
 * the pool again: late data fails xfer_enter (closed, or a newer
 * generation) and is discarded. Threads inside never block: they use
 * non-blocking socket calls and poll outside the guard.
 */
#define XFER_CLOSED (1ull << 31)
#define XFER_INSIDE_MASK (XFER_CLOSED - 1)

typedef struct xfer_chunk {
  uint64_t remote_off;
  uint64_t local_off;
  uint64_t bytes;
  uint32_t group; /* checksum group (batches with groups) */
  uint32_t crc;   /* pf_crc32c_raw state of the bytes landed so far, from 0 */
} xfer_chunk;

/* A run of chunks that travels as one unit on one lane (TCP: one frame on
 * one stream; RDMA: one chain of work requests on one QP). */
typedef struct xfer_part {
  uint32_t lane;
  uint32_t first; /* index into chunks */
  uint32_t n;
  uint32_t pad;
  uint64_t bytes;
} xfer_part;

typedef struct xfer_slot {
  _Atomic uint64_t guard;
  uint32_t index;
  uint32_t gen;       /* generation of the batch armed last */
  uint32_t op;        /* pf_xfer_op */
  uint32_t imm;
  uint64_t tag;
  uint64_t submit_ns;
  /* Atomic: the timer reads it from a slot that a submit may be re-arming
   * (relaxed; the generation check decides what the timer ends). */
  _Atomic uint64_t deadline_ns;
  uint64_t bytes;
  atomic_uint parts_left; /* data parts not yet landed / acknowledged */
  atomic_int armed;       /* 1 from submit until the record is posted */
  atomic_int expiring;    /* RDMA: timeout seen, waiting for the flush */
  xfer_chunk *chunks;
  uint32_t nchunks, cap_chunks;
  uint32_t ngroups;       /* checksum groups; 0 = none */
  uint32_t *crc_out;      /* the caller's, written by xfer_end on PF_OK */
  xfer_part *parts;
  uint32_t nparts, cap_parts;
  void *impl;             /* transport per-slot state */
} xfer_slot;

struct pf_xfer_ep;

typedef struct pf_xfer_peer {
  uint32_t handle;
  struct pf_xfer_ep *ep;
  struct pf_xfer_peer *next;  /* ep->peers list (under ep->mu) */
  pthread_mutex_t mu;         /* free list, inflight */
  pthread_cond_t cv;          /* inflight reached 0 */
  atomic_int connected;
  atomic_int closing;
  atomic_int connecting;      /* a pf_xfer_peer_connect is under way */
  atomic_int broken;          /* PF_E* that broke the peer, 0 = healthy */
  char broken_msg[256];       /* why; whole once `broken` is seen set, then fixed
                                 (xfer_peer_mark_broken writes it first) */
  char connect_msg[512];      /* why the last connect failed (under mu) */
  uint64_t remote_bytes;      /* remote pool size (the connect writes it before
                                 setting `connected`; read it only after) */
  uint32_t lanes;             /* streams (TCP) or QPs (RDMA) */
  uint32_t nfree;
  uint32_t inflight;
  uint32_t free_list[PF_XFER_MAX_INFLIGHT];
  xfer_slot slots[PF_XFER_MAX_INFLIGHT];
  void *impl;
} pf_xfer_peer;

typedef struct xfer_ops {
  const char *name;
  int32_t (*open)(struct pf_xfer_ep *ep);
  void (*close)(struct pf_xfer_ep *ep);
  int32_t (*peer_create)(pf_xfer_peer *p);
  int32_t (*peer_info)(pf_xfer_peer *p, uint8_t *buf, uint32_t cap);
  /* Sets p->remote_bytes and p->lanes on success. */
  int32_t (*peer_connect)(pf_xfer_peer *p, const uint8_t *remote, uint32_t len,
                          int32_t timeout_ms);
  /* Stops the peer's traffic: afterwards no thread of the transport enters
   * a slot of p; batches still armed are ended by the caller. */
  void (*peer_shutdown)(pf_xfer_peer *p);
  void (*peer_free)(pf_xfer_peer *p);
  /* The slot is armed and planned; queue its parts. Never blocks. */
  int32_t (*submit)(pf_xfer_peer *p, xfer_slot *s);
  /* The deadline of (s, gen) passed. NULL = end it with PF_ETIMEDOUT. */
  void (*expire)(pf_xfer_peer *p, xfer_slot *s, uint32_t gen);
  /* Most chunks one part may carry. */
  uint32_t max_part_chunks;
  /* 1: the transport updates each chunk's crc as its bytes land (TCP);
   * 0: xfer_end checksums the landed chunks in one pass (RDMA). */
  int crc_on_receive;
} xfer_ops;

typedef struct pf_xfer_ep {
  uint32_t handle;
  const xfer_ops *ops;
  pf_pool *pool;
  pf_ring *ring;
  pf_xfer_config cfg;
  /* Lock order and the no-JS-block rule: ep->mu guards the peers list and
   * is only ever held briefly, never across a ring post (a full ring waits
   * for the JS thread, which may itself be waiting for ep->mu). Threads that
   * use listed peers beyond that (the timer, the RDMA poller) hold `scan`
   * for reading; pf_xfer_peer_close unlinks a peer under ep->mu and then
   * takes `scan` for writing once, so no such thread still holds it. */
  pthread_mutex_t mu;
  pthread_rwlock_t scan;
  pf_xfer_peer *peers;
  uint32_t npeers;
  pthread_t timer;
  pthread_mutex_t timer_mu;
  pthread_cond_t timer_cv;
  int timer_stop;
  int timer_kick;                /* a submit's deadline comes first: scan again */
  atomic_ullong timer_wake_ns;   /* when the timer looks next (pf_xfer.c) */
  atomic_ullong n_submitted, n_ok, n_failed, n_timedout, late_bytes;
  atomic_ullong conns_open, bytes_served, bytes_landed;
  atomic_ullong conns_refused, accept_errors; /* TCP's listening side (pf_tcp.c) */
  uint32_t listen_port;
  void *impl;
} pf_xfer_ep;

extern const xfer_ops pf_tcp_ops;
extern const xfer_ops pf_rdma_ops;

/* Enters batch (s, gen) if it is still live; 0 = ended or superseded. */
static inline int xfer_enter(xfer_slot *s, uint32_t gen) {
  uint64_t w = atomic_load_explicit(&s->guard, memory_order_acquire);
  for (;;) {
    if ((uint32_t)(w >> 32) != gen || (w & XFER_CLOSED)) return 0;
    if (atomic_compare_exchange_weak_explicit(&s->guard, &w, w + 1,
                                              memory_order_acq_rel,
                                              memory_order_acquire))
      return 1;
  }
}
static inline void xfer_leave(xfer_slot *s) {
  atomic_fetch_sub_explicit(&s->guard, 1, memory_order_release);
}
/* Still live (a hint: entering is what counts). */
static inline int xfer_live(xfer_slot *s, uint32_t gen) {
  uint64_t w = atomic_load_explicit(&s->guard, memory_order_acquire);
  return (uint32_t)(w >> 32) == gen && !(w & XFER_CLOSED);
}

/* Ends batch (s, gen) with `status` unless it already ended: closes the
 * guard, waits until no thread is inside, posts the PF_DONE_XFER record and
 * returns the slot to the free list. Returns 1 if this call ended it. The
 * caller must not be inside the slot. */
int xfer_end(pf_xfer_peer *p, xfer_slot *s, uint32_t gen, int32_t status);
/* One part of (s, gen) is done; ends the batch OK after the last one. A
 * no-op once (s, gen) has ended. The caller must not be inside the slot. */
void xfer_part_done(pf_xfer_peer *p, xfer_slot *s, uint32_t gen);
/* Marks p broken with status and message unless it already is (first caller
 * wins; 1 = this call did). On return `broken` is set and broken_msg whole:
 * the message is written before the flag is published, under p->mu, so a
 * reader that sees the flag may read the message without a lock. Ends no
 * batch. Never call it holding p->mu. */
int xfer_peer_mark_broken(pf_xfer_peer *p, int32_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Marks p broken with status/message (xfer_peer_mark_broken) and ends every
 * batch in flight with PF_ESHUTDOWN if the peer is closing, else status. */
void xfer_peer_fail(pf_xfer_peer *p, int32_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* An endpoint limit from the environment: `name` unset or empty = `def`,
 * else a decimal in 1..max, anything else PF_EINVAL naming it (`unit` is
 * appended to the expected range, e.g. " (ms)"). (pf_tcp.c has its own
 * copy, env_limit, from before this one.) */
int32_t xfer_env_limit(const char *fn, const char *name, uint32_t def, uint32_t max,
                       const char *unit, uint32_t *out);
/* Slot by wire index (NULL if out of range). */
static inline xfer_slot *xfer_slot_at(pf_xfer_peer *p, uint32_t index) {
  return index < PF_XFER_MAX_INFLIGHT ? &p->slots[index] : NULL;
}

#endif /* PF_XFER_INTERNAL_H */
