/* Regression test (docs/native.md, "Transfer batches end once"): a submit
 * wakes the deadline timer when the timer could sleep past its deadline.
 * The timer marks itself scanning (timer_wake_ns = XFER_TIMER_SCANNING)
 * while it collects the armed slots; a slot armed after the collection is
 * not in the wake it then plans, so a submit that sees the timer scanning
 * must kick it (it rescans). Before the fix the submit compared its deadline
 * with the scanning mark (0) and never kicked: a 200 ms batch submitted
 * during the scan of a 30 s one waited out the 30 s (tests/xfer/tcp_test.ts
 * saw it once under load). The stub endpoint has no timer thread: the test
 * sets the timer's state by hand and reads whether the submit kicked.
 * Prints one line per case; exits 0 when each is as expected. */
#define _GNU_SOURCE
#include "pf_xfer_internal.h"
#include "check.h"
#include <stdio.h>
#include "pf_xfer.c"
#include "stub_xfer.h"

/* Submits a 200 ms batch with the timer's planned wake at `wake_ns`;
 * returns whether the submit kicked the timer. */
static int kicked(uint32_t peer, uint64_t wake_ns, uint64_t tag) {
  pf_xfer_peer *p = pf_handle_get(peer, PF_K_XPEER, "kicked");
  pf_xfer_ep *ep = p->ep;
  pthread_mutex_lock(&ep->timer_mu);
  ep->timer_kick = 0;
  atomic_store(&ep->timer_wake_ns, wake_ns);
  pthread_mutex_unlock(&ep->timer_mu);
  struct {
    pf_xfer_header h;
    pf_xfer_seg s;
  } b = {.h = {.op = PF_XFER_READ, .num_segs = 1, .timeout_ms = 200},
         .s = {.remote_off = 0, .local_off = tag * 4096, .bytes = 4096}};
  CHECK(pf_xfer_submit(peer, &b, sizeof b, tag, NULL) == 0);
  pthread_mutex_lock(&ep->timer_mu);
  int k = ep->timer_kick;
  pthread_mutex_unlock(&ep->timer_mu);
  return k;
}

int main(void) {
  pf_ring *ring;
  uint32_t peer = stub_peer(16, 2, 1 << 20, 64, &ring);
  uint64_t now = pf_now_ns();
  int scanning = kicked(peer, XFER_TIMER_SCANNING, 1);
  int later = kicked(peer, now + 30000000000ull, 2);
  int idle = kicked(peer, XFER_TIMER_IDLE, 3);
  int sooner = kicked(peer, now + 1000000ull, 4);
  printf("timer scanning: %s\n", scanning ? "kicked (correct)" : "not kicked (WRONG)");
  printf("timer to wake in 30 s: %s\n", later ? "kicked (correct)" : "not kicked (WRONG)");
  printf("timer idle: %s\n", idle ? "kicked (correct)" : "not kicked (WRONG)");
  printf("timer to wake in 1 ms: %s\n", sooner ? "kicked (WRONG)" : "not kicked (correct)");
  return !(scanning && later && idle && !sooner);
}
