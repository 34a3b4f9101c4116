/* Regression test (docs/native.md, "Lifetimes"): a peer close racing a
 * submit already past its lookup. pf_xfer.c is included with two calls of
 * pf_xfer_submit hooked; when the submit reaches the hook, pf_xfer_peer_close
 * runs on another thread (as the nonblocking FFI call does) and the submit
 * goes on after it (up to 300 ms). Built with ASan, which names any use of
 * the freed peer. Usage: MODE, where MODE is
 *   lookup  the close runs between the submit's lookup and its taking a
 *           slot: the close waits for the submit, which is refused
 *           (PF_ESHUTDOWN);
 *   armed   the close runs after the submit took its slot, before it is
 *           armed (end_all does not see it): the submit takes its batch back
 *           and returns PF_ESHUTDOWN with no record (posting one on the JS
 *           thread could wait for ever on a full ring: xfer_submit_ring_full.c),
 *           and the close waits for that.
 * Before the fix the submit held nothing: the close freed the peer under it. */
#define _GNU_SOURCE
#include "pf_xfer_internal.h"
#include "check.h"
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
static int hook_armed; /* 1: at the ring check (lookup); 2: at the stamp (armed) */
static uint32_t hook_peer;
static int close_rc = 99;
static int hook_ring_is_shutdown(pf_ring *r);
static uint64_t hook_now_ns(void);
#define pf_ring_is_shutdown(r) hook_ring_is_shutdown(r)
#define pf_now_ns() hook_now_ns()
#include "pf_xfer.c"
#undef pf_ring_is_shutdown
#undef pf_now_ns
#include "stub_xfer.h"

static void *closer(void *arg) {
  (void)arg;
  close_rc = pf_xfer_peer_close(hook_peer);
  return NULL;
}
/* Runs pf_xfer_peer_close on another thread and gives it up to 300 ms. */
static void close_meanwhile(const char *during) {
  int done = run_within(closer, 300);
  printf("close during %s: %s (rc %d)\n", during, done ? "finished" : "still waiting for it",
         close_rc);
}
static int hook_ring_is_shutdown(pf_ring *r) {
  if (hook_armed == 1) {
    hook_armed = 0;
    close_meanwhile("submit (after its lookup)");
  }
  return pf_ring_is_shutdown(r);
}
static uint64_t hook_now_ns(void) {
  if (hook_armed == 2) {
    hook_armed = 0;
    close_meanwhile("submit (slot taken, not armed)");
  }
  return pf_now_ns();
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "lookup";
  if (strcmp(mode, "lookup") && strcmp(mode, "armed")) {
    fprintf(stderr, "usage: xfer_submit_close [lookup|armed]\n");
    return 2;
  }
  pf_ring *ring;
  hook_peer = stub_peer(16, 2, 1 << 20, 64, &ring);
  struct {
    pf_xfer_header h;
    pf_xfer_seg s;
  } b = {.h = {.op = PF_XFER_READ, .num_segs = 1, .timeout_ms = 1000},
         .s = {.remote_off = 0, .local_off = 0, .bytes = 4096}};
  hook_armed = mode[0] == 'l' ? 1 : 2;
  int32_t rc = pf_xfer_submit(hook_peer, &b, sizeof b, 7, NULL);
  char e[256];
  pf_last_error(e, sizeof e);
  printf("submit: %d %s\n", rc, rc ? e : "");
  CHECK(hook_armed == 0);
  /* The close must end once the submit returned. */
  for (int i = 0; i < 100 && close_rc == 99; i++) usleep(10000);
  printf("pf_xfer_peer_close: %d\n", close_rc);
  /* The records posted (the ring's head word; records from offset
   * PF_RING_HEADER_BYTES), as xfer_parts reads them. */
  uint64_t n = atomic_load((_Atomic uint64_t *)ring->mem);
  pf_completion *c = (pf_completion *)((uint8_t *)ring->mem + PF_RING_HEADER_BYTES);
  printf("records: %llu", (unsigned long long)n);
  for (uint64_t i = 0; i < n && i < ring->capacity; i++)
    printf(" (tag %llu status %d)", (unsigned long long)c[i].tag, c[i].status);
  printf("\n");
  if (close_rc != 0) return 1;
  return rc != PF_ESHUTDOWN || n != 0;
}
