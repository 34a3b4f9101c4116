/* Regression test (docs/native.md, "Transfer batches end once"): the TCP
 * transport's waits (connect, hello, a stalled stream: pf_tcp.c's wait_fd)
 * never end before their deadline. wait_fd turned the time left into whole
 * ms rounded down, and took 0 ms left as "one last look": with 1.5 ms left it
 * polled 1 ms, then saw 0 and gave up, ~0.5 ms early; with 0.9 ms left, at
 * once. Waits on a socket that never becomes readable, with deadlines of a
 * whole and a fraction of a ms, and counts those that ended early. Prints
 * one line; exits 0. */
#define _GNU_SOURCE
#include "pf_xfer_internal.h"
#include "check.h"
#include <stdio.h>
#include <sys/socket.h>
#include "pf_tcp.c"


int main(void) {
  int sv[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
  int early = 0, cases = 40;
  for (int i = 0; i < cases; i++) {
    uint64_t budget = 300000ull + (uint64_t)i * 97000ull; /* 0.3 .. 4.1 ms */
    uint64_t t0 = pf_now_ns();
    int r = wait_fd(sv[0], POLLIN, NULL, t0 + budget);
    uint64_t took = pf_now_ns() - t0;
    CHECK(r == -3);
    if (took < budget) {
      if (early++ < 3) printf("deadline %.3f ms: ended after %.3f ms\n", budget / 1e6, took / 1e6);
    }
  }
  printf("%d of %d deadlines ended early\n", early, cases);
  close(sv[0]);
  close(sv[1]);
  return 0;
}
