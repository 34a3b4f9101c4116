/* Regression test (docs/native.md, "Lifetimes"): the cuda backend's kernel
 * tables live in a ring arena; a table that does not fit before the arena's
 * end wraps to the next lap, and its reservation waits while older tables
 * are in use. The wait counted the skipped stretch [head, next lap) as in
 * use, and the tail never moves past the head: with every table freed
 * (tail == head) a wrapped table larger than the head's offset in the arena
 * waited for ever, and the engine's submitter thread with it (so every later
 * batch). An empty arena no longer waits. No GPU is needed: arena_reserve
 * uses only the engine's mutex, condition and arena words. Prints one line;
 * exits 0 when the table was reserved within 1 s. */
#define _GNU_SOURCE
#include "check.h"
#include "pf_cuda.c"
#include <stdio.h>
#include <time.h>

static cuda_engine *ce;
static uint64_t want, got_off, got_vend;
static int done;

static void *reserver(void *arg) {
  (void)arg;
  CHECK(arena_reserve(ce, want, &got_off, &got_vend) == PF_OK);
  pthread_mutex_lock(&ce->mu);
  done = 1;
  pthread_mutex_unlock(&ce->mu);
  return NULL;
}

int main(void) {
  const uint64_t MiB = 1ull << 20;
  ce = calloc(1, sizeof *ce);
  CHECK(ce != NULL);
  pthread_mutex_init(&ce->mu, NULL);
  pthread_cond_init(&ce->cv, NULL);
  /* Earlier tables took 30 MiB and were all freed. */
  ce->arena_head = ce->arena_tail = 30 * MiB;
  want = 40 * MiB; /* 30 + 40 > the arena's 64: wraps to the next lap */
  pthread_t th;
  CHECK(pthread_create(&th, NULL, reserver, NULL) == 0);
  int ok = 0;
  for (int i = 0; i < 20 && !ok; i++) {
    struct timespec ts = {0, 50 * 1000 * 1000};
    nanosleep(&ts, NULL);
    pthread_mutex_lock(&ce->mu);
    ok = done;
    pthread_cond_broadcast(&ce->cv); /* as a release would */
    pthread_mutex_unlock(&ce->mu);
  }
  if (!ok) {
    printf("empty arena, a 40 MiB table after 30 MiB: still waiting after 1 s (WRONG)\n");
    return 1; /* the reserver is stuck for good: exit without joining it */
  }
  CHECK(pthread_join(th, NULL) == 0);
  printf("empty arena, a 40 MiB table after 30 MiB: reserved at offset %llu MiB, lap end %llu MiB "
         "(correct)\n", (unsigned long long)(got_off / MiB), (unsigned long long)(got_vend / MiB));
  return !(got_off == 0 && got_vend == 64 * MiB + want);
}
