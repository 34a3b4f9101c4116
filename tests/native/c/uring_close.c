/* Regression test (docs/native.md, "Lifetimes"): pf_uring_close, which runs
 * off the JS thread, racing a pf_io_submit already past its lookup of the
 * uring. pf_uring.c is included with calloc hooked: when pf_io_submit
 * allocates its batch, the hook runs pf_uring_close on a second thread and
 * gives it up to 300 ms before the submit goes on. The close must wait for
 * the submit (which is then refused) and free nothing under it (built with
 * ASan, which names any use of the freed uring or file). Usage: FILE. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>
static int hook_armed;
static unsigned hook_uring;
static int close_rc = 99;
static void *hook_calloc(size_t n, size_t sz);
#define calloc(n, s) hook_calloc(n, s)
#include "pf_uring.c"
#undef calloc
#include "check.h"

static void *closer(void *arg) {
  (void)arg;
  close_rc = pf_uring_close(hook_uring);
  return NULL;
}
static void *hook_calloc(size_t n, size_t sz) {
  if (hook_armed && n == 1 && sz == sizeof(io_batch)) {
    hook_armed = 0;
    pthread_t t;
    pthread_create(&t, NULL, closer, NULL);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 300000000;
    if (ts.tv_nsec >= 1000000000) { ts.tv_sec++; ts.tv_nsec -= 1000000000; }
    int e = pthread_timedjoin_np(t, NULL, &ts);
    printf("close during submit: %s (rc %d)\n", e == 0 ? "finished" : "still waiting for the submit",
           close_rc);
    if (e) pthread_detach(t);
  }
  return calloc(n, sz);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: uring_close FILE\n");
    return 2;
  }
  uint32_t eng, pool, ring, u, f;
  CHECK(pf_engine_open(PF_BACKEND_HOST, 0, 1, &eng) == 0);
  CHECK(pf_pool_create(eng, 1 << 20, 0, 0, NULL, &pool) == 0);
  CHECK(pf_ring_create(64, &ring) == 0);
  CHECK(pf_uring_open(pool, ring, 8, 4, &u) == 0);
  CHECK(pf_file_open(u, argv[1], PF_FILE_CREATE, &f) == 0);
  struct { pf_io_batch_header h; pf_io_desc d; pf_io_ext x; } b = {
      .h = {.num_ops = 1, .num_exts = 1},
      .d = {.file = f, .op = PF_IO_WRITE, .first_ext = 0, .num_ext = 1},
      .x = {.pool_off = 0, .bytes = 4096}};
  hook_armed = 1;
  hook_uring = u;
  int32_t rc = pf_io_submit(u, &b, sizeof b, 1);
  char e[256];
  pf_last_error(e, sizeof e);
  printf("pf_io_submit: %d %s\n", rc, rc ? e : "");
  /* The close must end, and leave the pool and ring free to destroy. */
  for (int i = 0; i < 100 && close_rc == 99; i++) usleep(10000);
  printf("pf_uring_close: %d\n", close_rc);
  int32_t pd = pf_pool_destroy(pool), rd = pf_ring_destroy(ring);
  printf("pool destroy %d, ring destroy %d\n", pd, rd);
  return close_rc != 0 || rc == 0 || pd != 0 || rd != 0;
}
