/*
 * rdma_races.c — races of the RDMA transport that need one thread stopped at
 * an exact point, forced here by calling the transport's own entry points in
 * that order, over fake_ibverbs.c (path in argv[2]). Built with
 * ThreadSanitizer against csrc/ by rdma_races_test.ts; exits 0 when the
 * behaviour is right (TSan fails it with exit 66 at a data race). Modes:
 *
 *   stale-expire  The timer picked batch A as due, then A ended and batch B
 *                 took its slot before the timer's expire call ran: the
 *                 expire for A must leave B and the peer alone.
 *   broken-msg    One thread breaks the peer (a batch's deadline passes)
 *                 while another, seeing the peer broken, reads why: the
 *                 reason must be whole when the flag is seen (TSan).
 */
#define _GNU_SOURCE
#include "check.h" /* tests/native/c */
#include "pf_xfer_internal.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>


typedef struct node {
  uint32_t eng, pool, ring, ep, peer;
  pf_xfer_ep *e;
  pf_xfer_peer *p;
} node;

static void node_open(node *n) {
  CHECK(pf_engine_open(PF_BACKEND_HOST, 0, 1, &n->eng) == 0);
  CHECK(pf_pool_create(n->eng, 1 << 20, 0, 0, NULL, &n->pool) == 0);
  CHECK(pf_ring_create(64, &n->ring) == 0);
  pf_xfer_config cfg = {.transport = PF_XFER_RDMA, .streams = 1, .stripe_bytes = 4096};
  int32_t rc = pf_xfer_open(n->pool, n->ring, &cfg, sizeof cfg, &n->ep);
  if (rc) {
    char why[512];
    pf_last_error(why, sizeof why);
    fprintf(stderr, "pf_xfer_open(rdma): %d %s\n", rc, why);
    exit(2);
  }
  CHECK(pf_xfer_peer_create(n->ep, &n->peer) == 0);
  n->e = pf_handle_get(n->ep, PF_K_XFER, "rdma_races");
  n->p = pf_handle_get(n->peer, PF_K_XPEER, "rdma_races");
}

static void connect_pair(node *a, node *b) {
  uint8_t ia[1024], ib[1024];
  int32_t la = pf_xfer_peer_info(a->peer, ia, sizeof ia), lb = pf_xfer_peer_info(b->peer, ib,
                                                                               sizeof ib);
  CHECK(la > 0 && lb > 0);
  CHECK(pf_xfer_peer_connect(a->peer, ib, (uint32_t)lb, 1000) == 0);
  CHECK(pf_xfer_peer_connect(b->peer, ia, (uint32_t)la, 1000) == 0);
}

/* Submits a one-segment READ of 4 KiB; returns its slot (the one armed). */
static xfer_slot *submit_read(node *a, uint32_t timeout_ms, uint64_t tag) {
  struct {
    pf_xfer_header h;
    pf_xfer_seg s;
  } b = {.h = {.op = PF_XFER_READ, .num_segs = 1, .timeout_ms = timeout_ms},
         .s = {.remote_off = 0, .local_off = 0, .bytes = 4096}};
  pthread_mutex_lock(&a->p->mu);
  uint32_t next = a->p->free_list[a->p->nfree - 1]; /* the slot the submit takes */
  pthread_mutex_unlock(&a->p->mu);
  int32_t rc = pf_xfer_submit(a->peer, &b, sizeof b, tag, NULL);
  if (rc) {
    char why[512];
    pf_last_error(why, sizeof why);
    fprintf(stderr, "submit: %d %s\n", rc, why);
    exit(2);
  }
  return &a->p->slots[next];
}

static uint64_t ended(node *a) {
  return atomic_load(&a->e->n_ok) + atomic_load(&a->e->n_failed) +
         atomic_load(&a->e->n_timedout);
}

static void wait_ended(node *a, uint64_t n) {
  for (int i = 0; i < 5000 && ended(a) < n; i++) usleep(1000);
  CHECK(ended(a) >= n);
}

static void (*fake_hold)(int32_t);
static int32_t (*fake_release)(void);

static node A, B;
static xfer_slot *S;
static uint32_t GEN;

static void *expire_thread(void *arg) {
  (void)arg;
  A.e->ops->expire(A.p, S, GEN);
  return NULL;
}

int main(int argc, char **argv) {
  if (argc != 3 || (strcmp(argv[1], "stale-expire") && strcmp(argv[1], "broken-msg"))) {
    fprintf(stderr, "usage: rdma_races stale-expire|broken-msg FAKE_IBVERBS_SO\n");
    return 2;
  }
  setenv("PEGAFLOW_LIBIBVERBS", argv[2], 1);
  void *fake = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL); /* the copy the transport loads */
  CHECK(fake != NULL);
  *(void **)&fake_hold = dlsym(fake, "fake_hold");
  *(void **)&fake_release = dlsym(fake, "fake_release");
  CHECK(fake_hold && fake_release);
  node_open(&A);
  node_open(&B);
  connect_pair(&A, &B);

  if (argv[1][0] == 's') {
    /* Batch A ends OK; batch B takes the same slot and stays on the wire. */
    xfer_slot *sa = submit_read(&A, 60000, 1);
    uint32_t gen_a = sa->gen;
    wait_ended(&A, 1);
    fake_hold(1);
    xfer_slot *sb = submit_read(&A, 60000, 2);
    CHECK(sb == sa && sb->gen != gen_a);
    /* The timer's late expire for A, which it picked before A ended. */
    S = sa;
    GEN = gen_a;
    expire_thread(NULL);
    int broken = atomic_load(&A.p->broken), expiring = atomic_load(&sb->expiring);
    printf("after a late expire of the ended batch: peer broken %d, new batch expiring %d\n",
           broken, expiring);
    fake_release();
    wait_ended(&A, 2);
    printf("new batch: ok %llu, failed %llu, timed out %llu\n",
           (unsigned long long)atomic_load(&A.e->n_ok),
           (unsigned long long)atomic_load(&A.e->n_failed),
           (unsigned long long)atomic_load(&A.e->n_timedout));
    CHECK(broken == 0 && expiring == 0);
    CHECK(atomic_load(&A.e->n_ok) == 2);
  } else {
    /* A batch on the wire passes its deadline on one thread while this one
     * sees the peer broken and reads why. */
    fake_hold(1);
    S = submit_read(&A, 60000, 3);
    GEN = S->gen;
    pthread_t t;
    CHECK(pthread_create(&t, NULL, expire_thread, NULL) == 0);
    while (!atomic_load(&A.p->broken)) {
    }
    char why[512];
    CHECK(pf_xfer_peer_error(A.peer, why, sizeof why) > 0);
    pthread_join(t, NULL);
    printf("peer broken %d: %s\n", atomic_load(&A.p->broken), why);
    CHECK(strstr(why, "passed its 60000 ms deadline"));
    wait_ended(&A, 1);
    CHECK(atomic_load(&A.e->n_timedout) == 1);
  }
  fake_release();
  CHECK(pf_xfer_peer_close(A.peer) == 0);
  CHECK(pf_xfer_peer_close(B.peer) == 0);
  CHECK(pf_xfer_close(A.ep) == 0);
  CHECK(pf_xfer_close(B.ep) == 0);
  puts("closed");
  return 0;
}
