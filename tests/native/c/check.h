/* The race tests' one check: evaluated in every build (never compiled out
 * like assert), and a failure names the expression and its line. */
#ifndef PF_TEST_CHECK_H
#define PF_TEST_CHECK_H
#include <stdio.h>
#include <stdlib.h>
#define CHECK(expr)                                                            \
  do {                                                                         \
    if (!(expr)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #expr); \
      exit(2);                                                                 \
    }                                                                          \
  } while (0)

#include <pthread.h>
#include <time.h>
/* Runs fn on another thread and gives it up to `ms` (< 1000): 1 when it
 * finished, 0 when it is still running then (left running, detached). The
 * race programs run a close meanwhile a hooked call waits at its stop point. */
static inline int run_within(void *(*fn)(void *), long ms) {
  pthread_t t;
  pthread_create(&t, NULL, fn, NULL);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_nsec += ms * 1000000L;
  if (ts.tv_nsec >= 1000000000) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000;
  }
  int e = pthread_timedjoin_np(t, NULL, &ts);
  if (e) pthread_detach(t);
  return e == 0;
}
#endif
