/* Regression test (docs/native.md, "Lifetimes"): a close racing a call
 * already past its lookup. pf_uring.c is included with calloc and fdatasync
 * hooked; when the call reaches the hook, the close runs and the call goes
 * on after it (up to 300 ms). Built with ASan, which names any use of a
 * freed uring or file. Usage: FILE MODE, where MODE is
 *   submit      pf_uring_close (off the JS thread) during pf_io_submit: the
 *               close waits for the submit, which is refused;
 *   sync-uring  pf_uring_close during pf_file_sync (off the JS thread): the
 *               close waits for the sync, which succeeds;
 *   sync-file   pf_file_close (the JS thread) during pf_file_sync: refused
 *               with PF_EBUSY, then closes once the sync ended. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>
#include <string.h>
#include <unistd.h>
static int hook_armed;
static unsigned hook_uring, hook_file;
static int close_rc = 99, file_close_rc = 99;
static void *hook_calloc(size_t n, size_t sz);
static int hook_fdatasync(int fd);
#define calloc(n, s) hook_calloc(n, s)
#define fdatasync(fd) hook_fdatasync(fd)
#include "pf_uring.c"
#undef calloc
#undef fdatasync
#include "check.h"

static void *closer(void *arg) {
  (void)arg;
  close_rc = pf_uring_close(hook_uring, NULL, 0);
  return NULL;
}
/* Runs pf_uring_close on another thread and gives it up to 300 ms. */
static void close_meanwhile(const char *during) {
  int done = run_within(closer, 300);
  printf("close during %s: %s (rc %d)\n", during, done ? "finished" : "still waiting for it",
         close_rc);
}
static void *hook_calloc(size_t n, size_t sz) {
  if (hook_armed == 1 && n == 1 && sz == sizeof(io_batch)) {
    hook_armed = 0;
    close_meanwhile("submit");
  }
  return calloc(n, sz);
}
static int hook_fdatasync(int fd) {
  if (hook_armed == 2) close_meanwhile("sync");
  if (hook_armed == 3) {
    file_close_rc = pf_file_close(hook_file);
    printf("file close during sync: %d\n", file_close_rc);
  }
  hook_armed = 0;
  return fdatasync(fd);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: uring_close FILE [submit|sync-uring|sync-file]\n");
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
  const char *mode = argc > 2 ? argv[2] : "submit";
  hook_uring = u;
  hook_file = f;
  int32_t rc, want_rc;
  if (!strcmp(mode, "submit")) {
    hook_armed = 1;
    rc = pf_io_submit(u, &b, sizeof b, 1);
    want_rc = PF_ESHUTDOWN;
  } else if (!strcmp(mode, "sync-uring") || !strcmp(mode, "sync-file")) {
    hook_armed = mode[5] == 'u' ? 2 : 3;
    rc = pf_file_sync(f, NULL, 0);
    want_rc = PF_OK;
  } else {
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
  }
  char e[256];
  pf_last_error(e, sizeof e);
  printf("call: %d %s\n", rc, rc ? e : "");
  if (hook_armed == 0 && !strcmp(mode, "sync-file")) {
    CHECK(file_close_rc == PF_EBUSY);
    CHECK(pf_file_close(f) == PF_OK); /* the sync ended: now it closes */
    close_rc = pf_uring_close(u, NULL, 0);
  }
  /* The close must end, and leave the pool and ring free to destroy. */
  for (int i = 0; i < 100 && close_rc == 99; i++) usleep(10000);
  printf("pf_uring_close: %d\n", close_rc);
  int32_t pd = pf_pool_destroy(pool), rd = pf_ring_destroy(ring);
  printf("pool destroy %d, ring destroy %d\n", pd, rd);
  return close_rc != 0 || rc != want_rc || pd != 0 || rd != 0;
}
