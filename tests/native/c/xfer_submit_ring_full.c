/* Regression test (docs/native.md, "Transfer batches end once"): a submit
 * that must end its own batch while the completion ring is full. The submit
 * runs on the JS thread, the ring's only consumer, so waiting there for ring
 * room never ends (before: the Deno process hung). pf_xfer.c is included with
 * pf_now_ns hooked (the submit stamps its batch with it, after taking its
 * slot and before arming it). Usage: MODE, where MODE is
 *   transport  the transport refuses the batch (its submit fails, as an
 *              out-of-memory send queue does);
 *   broken     the peer breaks (a stream thread's xfer_peer_fail) between the
 *              submit's check and the arming of its slot.
 * Either way the submit must return the error naming the peer, at once,
 * post nothing and give its slot back. */
#define _GNU_SOURCE
#include "pf_xfer_internal.h"
#include "check.h"
#include <stdio.h>
#include <string.h>
static int hook_armed;
static uint64_t hook_now_ns(void);
#define pf_now_ns() hook_now_ns()
#include "pf_xfer.c"
#undef pf_now_ns
#include "stub_xfer.h"

static pf_xfer_peer *P;
static uint32_t peer;
static int32_t submit_rc = 99;
static char submit_err[512];

static uint64_t hook_now_ns(void) {
  if (hook_armed) {
    hook_armed = 0;
    xfer_peer_fail(P, PF_EIO, "stream 1 to 10.0.0.2:7010: receive: connection reset by peer");
  }
  return pf_now_ns();
}
static int32_t refusing_submit(pf_xfer_peer *p, xfer_slot *s) {
  (void)p;
  (void)s;
  return pf_fail(PF_ENOMEM, "pf_xfer_submit: out of memory for the send queue");
}
static void *submitter(void *arg) {
  (void)arg;
  struct {
    pf_xfer_header h;
    pf_xfer_seg s;
  } b = {.h = {.op = PF_XFER_READ, .num_segs = 1, .timeout_ms = 60000},
         .s = {.remote_off = 0, .local_off = 0, .bytes = 4096}};
  submit_rc = pf_xfer_submit(peer, &b, sizeof b, 7, NULL);
  pf_last_error(submit_err, sizeof submit_err);
  return NULL;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "transport";
  if (strcmp(mode, "transport") && strcmp(mode, "broken")) {
    fprintf(stderr, "usage: xfer_submit_ring_full [transport|broken]\n");
    return 2;
  }
  pf_ring *ring;
  peer = stub_peer(16, 2, 1 << 20, 16, &ring);
  P = pf_handle_get(peer, PF_K_XPEER, "main");
  static xfer_ops ops;
  ops = *P->ep->ops;
  if (mode[0] == 't') ops.submit = refusing_submit;
  P->ep->ops = &ops;
  /* Fill the ring: nobody drains it while the submit runs, as on the JS
   * thread, whose own call is what would drain it. */
  for (uint64_t i = 0; i < ring->capacity; i++) {
    pf_completion c = {.tag = 1000 + i, .kind = PF_DONE_XFER, .status = PF_OK};
    CHECK(pf_ring_post(ring, &c) == PF_OK);
  }
  hook_armed = mode[0] == 'b';
  int done = run_within(submitter, 500);
  printf("submit %s: %d %s\n", done ? "returned" : "still waiting for ring room", submit_rc,
         done && submit_rc ? submit_err : "");
  if (!done) return 1;
  uint64_t head = atomic_load((_Atomic uint64_t *)ring->mem);
  pthread_mutex_lock(&P->mu);
  uint32_t nfree = P->nfree, inflight = P->inflight;
  pthread_mutex_unlock(&P->mu);
  printf("records: %llu, free slots %u, in flight %u, submitted %llu\n",
         (unsigned long long)head, nfree, inflight,
         (unsigned long long)atomic_load(&P->ep->n_submitted));
  CHECK(head == ring->capacity);
  CHECK(nfree == PF_XFER_MAX_INFLIGHT && inflight == 0);
  CHECK(atomic_load(&P->ep->n_submitted) == 0);
  return submit_rc == (mode[0] == 't' ? PF_ENOMEM : PF_EIO) ? 0 : 1;
}
