/* Regression test (docs/native.md, "Every transfer peer call holds its
 * peer"), built with ThreadSanitizer: pf_xfer_peer_state polled on one
 * thread while pf_xfer_peer_connect runs on another (the FFI runs connect
 * off the JS thread; metrics and XferPeer.state() read the state on it).
 * The stub transport's connect writes the remote pool's size as TCP's does,
 * then takes a while to start its streams. Before the fix the state read
 * p->remote_bytes with nothing ordering it after that write: TSan reports a
 * data race and the program exits 66. */
#define _GNU_SOURCE
#include "pf_xfer_internal.h"
#include "check.h"
#include <stdio.h>
#include <unistd.h>

#include "stub_xfer.h"
static atomic_int stop;
static uint32_t peer;
static uint64_t seen;

static int32_t slow_connect(pf_xfer_peer *p, const uint8_t *remote, uint32_t len, int32_t ms) {
  (void)remote;
  (void)len;
  (void)ms;
  usleep(20000);
  p->remote_bytes = 1 << 20; /* learned from the hello, as pf_tcp.c does */
  p->lanes = 2;
  usleep(20000); /* starting the stream threads */
  return PF_OK;
}
static void *poll_state(void *arg) {
  (void)arg;
  while (!atomic_load(&stop)) {
    pf_xfer_peer_status st;
    CHECK(pf_xfer_peer_state(peer, &st) == PF_OK);
    if (st.remote_bytes) seen = st.remote_bytes;
  }
  return NULL;
}

int main(void) {
  pf_ring *ring;
  uint32_t first = stub_peer(16, 2, 1 << 20, 64, &ring);
  pf_xfer_peer *fp = pf_handle_get(first, PF_K_XPEER, "main");
  static xfer_ops ops;
  ops = *fp->ep->ops;
  ops.peer_connect = slow_connect;
  fp->ep->ops = &ops;
  CHECK(pf_xfer_peer_create(fp->ep->handle, &peer) == PF_OK);
  pthread_t t;
  pthread_create(&t, NULL, poll_state, NULL);
  usleep(5000);
  int32_t rc = pf_xfer_peer_connect(peer, (const uint8_t *)"stub", 4, 1000);
  usleep(5000);
  atomic_store(&stop, 1);
  pthread_join(t, NULL);
  pf_xfer_peer_status st;
  CHECK(pf_xfer_peer_state(peer, &st) == PF_OK);
  printf("connect: %d; state: connected %u, remote_bytes %llu (polled: %llu)\n", rc,
         st.connected, (unsigned long long)st.remote_bytes, (unsigned long long)seen);
  return rc == PF_OK && st.connected && st.remote_bytes == 1 << 20 ? 0 : 1;
}
