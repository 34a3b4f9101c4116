/* Regression test (docs/native.md, "Transfer batches end once"): a part that
 * lands is counted against its own batch only. The transport thread used to
 * count a landed part after leaving the slot; the timer could end the batch
 * in between and JS submit the next batch into the same slot, whose count the
 * late part then lowered, so that batch ended PF_OK one part early. Replays
 * exactly that order through the real pf_xfer_submit / xfer_end /
 * xfer_part_done and pf_tcp.c's on_ack (included here, its xfer_leave
 * hooked), with a stub transport whose submit queues nothing.
 * `xfer_parts` checks the receive path, `xfer_parts ack` the WRITE ack. */
#define _GNU_SOURCE
#include "pf_xfer_internal.h"
#include "check.h"
/* pf_tcp.c's xfer_leave calls go through this hook: it lets "other threads"
 * run exactly when the transport thread has left the slot. */
static void (*leave_hook)(void);
static void test_leave(xfer_slot *s) {
  xfer_leave(s);
  void (*h)(void) = leave_hook;
  leave_hook = NULL;
  if (h) h();
}
#define xfer_leave(s) test_leave(s)
#include "pf_tcp.c"
#undef xfer_leave

#include "stub_xfer.h"

static pf_ring *ring;
static uint64_t seen;
/* Status of the record with `tag` posted since the last look; 1 = none. */
static int32_t record(uint64_t tag) {
  uint8_t *mem = ring->mem;
  uint64_t head = atomic_load((_Atomic uint64_t *)mem);
  int32_t st = 1;
  for (; seen < head; seen++) {
    pf_completion *c = (pf_completion *)(mem + PF_RING_HEADER_BYTES) + (seen % ring->capacity);
    if (c->tag == tag) st = c->status;
  }
  atomic_store((_Atomic uint64_t *)(mem + 8), head);
  return st;
}

static uint32_t g_peer, g_op;
static int32_t submit(uint32_t peer, uint32_t op, uint64_t tag, int nsegs);
static pf_xfer_peer *g_p;
static void timer_then_js(void) {
  xfer_slot *s = &g_p->slots[0];
  CHECK(xfer_end(g_p, s, s->gen, PF_ETIMEDOUT) == 1);
  CHECK(submit(g_peer, g_op, 2, 2) == 0);
}
static int32_t submit(uint32_t peer, uint32_t op, uint64_t tag, int nsegs) {
  struct { pf_xfer_header h; pf_xfer_seg s[2]; } d = {
      .h = {.op = op, .num_segs = (uint32_t)nsegs, .timeout_ms = 60000},
      .s = {{0, 0, 4096}, {65536, 65536, 4096}}}; /* not adjacent: 2 parts */
  return pf_xfer_submit(peer, &d, sizeof d.h + (size_t)nsegs * sizeof d.s[0], tag, NULL);
}

int main(int argc, char **argv) {
  int use_ack = argc > 1 && !strcmp(argv[1], "ack");
  uint32_t peer = stub_peer(1, 1, 1 << 20, 64, &ring);
  pf_xfer_peer *p = pf_handle_get(peer, PF_K_XPEER, "t");
  uint32_t op = use_ack ? PF_XFER_WRITE : PF_XFER_READ;

  /* Batch A, one part, in slot 0. */
  CHECK(submit(peer, op, 1, 1) == 0);
  xfer_slot *s = &p->slots[0];
  uint32_t genA = s->gen;
  CHECK(atomic_load(&s->armed));
  g_p = p; g_peer = peer; g_op = op;
  tcp_stream st0 = {.p = p};
  if (use_ack) {
    /* The rx thread handles A's ack; the timer ends A and JS submits B right
     * after on_ack leaves the slot (the hook). */
    leave_hook = timer_then_js;
    pf_tcp_frame f = {.magic = TCP_MAGIC, .op = OP_ACK, .slot = 0, .gen = genA, .part = 0};
    on_ack(&st0, &f);
    CHECK(record(1) == PF_ETIMEDOUT);
    CHECK(s->gen != genA && s->nparts == 2);
    goto after_stale;
  }
  /* Transport thread: A's only part lands... */
  CHECK(xfer_enter(s, genA));
  xfer_leave(s);
  /* ...and before it counts the part, the timer ends A. */
  CHECK(xfer_end(p, s, genA, PF_ETIMEDOUT) == 1);
  CHECK(record(1) == PF_ETIMEDOUT);
  /* JS sees A's record and submits B (two parts); it reuses slot 0. */
  CHECK(submit(peer, op, 2, 2) == 0);
  CHECK(s->gen != genA && s->nparts == 2);
  /* The transport thread now counts A's part, with A's generation. */
  xfer_part_done(p, s, genA);
after_stale:;
  uint32_t genB = s->gen;
  /* B's first part completes; its second has not. */
  if (use_ack) {
    tcp_stream st = {.p = p};
    pf_tcp_frame f = {.magic = TCP_MAGIC, .op = OP_ACK, .slot = 0, .gen = genB, .part = 0};
    on_ack(&st, &f);
  } else {
    xfer_part_done(p, s, genB);
  }
  int32_t b = record(2);
  printf("%s: after 1 of B's 2 parts: B %s (parts_left %u)\n", use_ack ? "on_ack" : "xfer_part_done",
         b == 1 ? "still in flight (correct)" : b == 0 ? "ENDED PF_OK (BUG)" : "ended with error",
         atomic_load(&s->parts_left));
  if (b != 1) return 1;
  if (use_ack) {
    tcp_stream st = {.p = p};
    pf_tcp_frame f = {.magic = TCP_MAGIC, .op = OP_ACK, .slot = 0, .gen = genB, .part = 1};
    on_ack(&st, &f);
  } else {
    xfer_part_done(p, s, genB);
  }
  b = record(2);
  printf("after B's 2nd part: B %s\n", b == 0 ? "ended PF_OK (correct)" : "NOT ended (BUG)");
  return b == 0 ? 0 : 1;
}
