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

#include "stub_xfer.h"
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
  uint32_t peer = stub_peer(1 << 16, 4, 64 << 20, 1 << 12, &ring);
  P = pf_handle_get(peer, PF_K_XPEER, "t");
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
