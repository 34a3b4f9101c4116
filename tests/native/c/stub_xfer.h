/* The transfer race tests' scaffolding: a transfer endpoint over a stub
 * transport whose submit queues nothing (no thread sends or receives; a test
 * plays the transport's threads itself, in the order it wants), on a host
 * engine's pool and a completion ring. Include after pf_xfer_internal.h. */
#ifndef PF_TEST_STUB_XFER_H
#define PF_TEST_STUB_XFER_H
#include <stdint.h>
#include <stdlib.h>
#include "check.h"

static int32_t stub_peer_create(pf_xfer_peer *p) { (void)p; return PF_OK; }
static void stub_nop(pf_xfer_peer *p) { (void)p; }
static int32_t stub_submit(pf_xfer_peer *p, xfer_slot *s) { (void)p; (void)s; return PF_OK; }

/* A connected peer of a stub endpoint: `part_chunks` chunks per part at most,
 * `lanes` streams, a pool of `pool_bytes` (the peer's remote side the same
 * size) and a ring of `ring_cap` records. Returns the peer handle; *ring_out
 * is the ring (the tests read its records themselves). */
static uint32_t stub_peer(uint32_t part_chunks, uint32_t lanes, uint64_t pool_bytes,
                          uint32_t ring_cap, pf_ring **ring_out) {
  static xfer_ops ops;
  ops = (xfer_ops){.name = "stub", .peer_create = stub_peer_create,
                   .peer_shutdown = stub_nop, .peer_free = stub_nop,
                   .submit = stub_submit, .max_part_chunks = part_chunks,
                   .crc_on_receive = 1};
  uint32_t eng, pool, rh, peer;
  CHECK(pf_engine_open(PF_BACKEND_HOST, 0, 1, &eng) == 0);
  CHECK(pf_pool_create(eng, pool_bytes, 0, 0, NULL, &pool) == 0);
  CHECK(pf_ring_create(ring_cap, &rh) == 0);
  pf_ring *ring = pf_handle_get(rh, PF_K_RING, "stub_peer");
  pf_xfer_ep *ep = calloc(1, sizeof *ep);
  CHECK(ep != NULL);
  ep->ops = &ops;
  ep->pool = pf_handle_get(pool, PF_K_POOL, "stub_peer");
  ep->ring = ring;
  ep->cfg.stripe_bytes = 1 << 20;
  pthread_mutex_init(&ep->mu, NULL);
  pthread_mutex_init(&ep->timer_mu, NULL);
  pthread_cond_init(&ep->timer_cv, NULL);
  pthread_rwlock_init(&ep->scan, NULL);
  atomic_store(&ep->timer_wake_ns, UINT64_MAX - 1); /* no timer: the tests end batches */
  ep->handle = pf_handle_new(PF_K_XFER, ep);
  CHECK(pf_xfer_peer_create(ep->handle, &peer) == 0);
  pf_xfer_peer *p = pf_handle_get(peer, PF_K_XPEER, "stub_peer");
  p->remote_bytes = pool_bytes;
  p->lanes = lanes;
  atomic_store(&p->connected, 1);
  *ring_out = ring;
  return peer;
}
#endif
