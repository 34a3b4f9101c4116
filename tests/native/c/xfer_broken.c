/* Regression test (docs/native.md, "Transfer batches end once"): a peer that
 * breaks (xfer_peer_fail on a stream thread) while JS submits. A submit that
 * passed its `broken` check before the failure but armed its slot after
 * end_all looked used to be ended by nobody but its deadline's timer. Stub
 * transport (it queues nothing, like a dead stream); 2,000 failures at random
 * points of 200 submits each; counts the batches left in flight. */
#include "pf_xfer_internal.h"
#include "check.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int32_t stub_peer_create(pf_xfer_peer *p) { (void)p; return PF_OK; }
static void stub_nop(pf_xfer_peer *p) { (void)p; }
static int32_t stub_submit(pf_xfer_peer *p, xfer_slot *s) { (void)p; (void)s; return PF_OK; }
static const xfer_ops stub_ops = {.name = "stub", .peer_create = stub_peer_create,
                                  .peer_shutdown = stub_nop, .peer_free = stub_nop,
                                  .submit = stub_submit, .max_part_chunks = 1 << 16,
                                  .crc_on_receive = 1};
static pf_ring *ring;
static void drain(void) {
  uint8_t *mem = ring->mem;
  atomic_store((_Atomic uint64_t *)(mem + 8), atomic_load((_Atomic uint64_t *)mem));
}
static pf_xfer_peer *P;
static atomic_int go;
static void *failer(void *arg) {
  unsigned spin = (unsigned)(uintptr_t)arg;
  while (!atomic_load(&go)) {}
  for (volatile unsigned i = 0; i < spin; i++) {}
  xfer_peer_fail(P, PF_EIO, "stream 0: receive: connection reset");
  return NULL;
}
#define NSEG 2048
int main(void) {
  uint32_t eng, pool, rh, peer;
  CHECK(pf_engine_open(PF_BACKEND_HOST, 0, 1, &eng) == 0);
  CHECK(pf_pool_create(eng, 64 << 20, 0, 0, NULL, &pool) == 0);
  CHECK(pf_ring_create(1 << 12, &rh) == 0);
  ring = pf_handle_get(rh, PF_K_RING, "t");
  pf_xfer_ep *ep = calloc(1, sizeof *ep);
  ep->ops = &stub_ops;
  ep->pool = pf_handle_get(pool, PF_K_POOL, "t");
  ep->ring = ring;
  ep->cfg.stripe_bytes = 1 << 20;
  pthread_mutex_init(&ep->mu, NULL);
  pthread_mutex_init(&ep->timer_mu, NULL);
  pthread_cond_init(&ep->timer_cv, NULL);
  pthread_rwlock_init(&ep->scan, NULL);
  atomic_store(&ep->timer_wake_ns, UINT64_MAX - 1);
  ep->handle = pf_handle_new(PF_K_XFER, ep);
  CHECK(pf_xfer_peer_create(ep->handle, &peer) == 0);
  P = pf_handle_get(peer, PF_K_XPEER, "t");
  P->remote_bytes = 64 << 20;
  P->lanes = 4;
  atomic_store(&P->connected, 1);
  size_t db = sizeof(pf_xfer_header) + NSEG * sizeof(pf_xfer_seg);
  pf_xfer_header *h = calloc(1, db);
  *h = (pf_xfer_header){.op = PF_XFER_READ, .num_segs = NSEG, .timeout_ms = 60000};
  pf_xfer_seg *sg = (pf_xfer_seg *)(h + 1);
  for (int i = 0; i < NSEG; i++) sg[i] = (pf_xfer_seg){(uint64_t)i * 8192, (uint64_t)i * 8192, 4096};
  int stranded = 0, iters = 2000;
  for (int it = 0; it < iters; it++) {
    pthread_t t;
    atomic_store(&go, 0);
    pthread_create(&t, NULL, failer, (void *)(uintptr_t)(rand() % 200000));
    atomic_store(&go, 1);
    int k, rc = 0;
    for (k = 0; k < 200; k++)
      if ((rc = pf_xfer_submit(peer, h, db, 1, NULL)) != 0) break;
    if (it < 5) printf("it %d: %d submits, rc %d\n", it, k, rc);
    pthread_join(t, NULL);
    for (uint32_t i = 0; i < PF_XFER_MAX_INFLIGHT; i++) {
      xfer_slot *s = &P->slots[i];
      uint64_t w = atomic_load(&s->guard);
      if (atomic_load(&s->armed) && !(w & XFER_CLOSED)) {
        stranded++;
        if (it < 5) printf("  slot %u stranded\n", i);
        xfer_end(P, s, (uint32_t)(w >> 32), PF_ETIMEDOUT); /* what the timer would do */
      }
    }
    drain();
    atomic_store(&P->broken, 0);
  }
  printf("%d of %d peer failures left a batch in flight for the timer to end\n", stranded, iters);
  return stranded ? 1 : 0;
}
