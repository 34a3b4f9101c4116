/* Regression test (docs/native.md, "Lifetimes"): a peer close racing the
 * peer calls other than the submit. pf_xfer.c is included with
 * pf_text_out hooked, over a real TCP endpoint or the stub transport; the
 * close runs on another thread (as the nonblocking FFI call does) while the
 * call is under way. Built with ASan, which names any use of the freed
 * peer. Usage: MODE, where MODE is
 *   connect  a connect waits for the hello of a listener that never
 *            answers; the close must make it give up at once with
 *            PF_ESHUTDOWN naming the peer, and only then free the peer;
 *   handshake  the same while the connect waits in its TCP handshake (the
 *            listener's accept queue is full: its SYN goes unanswered);
 *   twice    a second connect while the first waits is refused (PF_EBUSY),
 *            instead of building the streams over the first one's;
 *   info     the close runs inside the transport's peer_info;
 *   error    the close runs inside pf_xfer_peer_error, before it copies
 *            the peer's text;
 *   create   the endpoint's close runs inside pf_xfer_peer_create (in the
 *            transport's peer_create): it answers PF_EBUSY, the peer being
 *            counted from the create's lookup (before: it freed the endpoint
 *            under the create).
 * Before the fix these calls held nothing: the close freed the peer under
 * them (connect: the connect then read the freed peer as its socket shut). */
#define _GNU_SOURCE
#include "pf_xfer_internal.h"
#include "check.h"
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
static int hook_armed;
static uint32_t hook_peer;
static int close_rc = 99;
static int32_t hook_text_out(const char *text, char *buf, uint32_t cap);
#define pf_text_out(t, b, c) hook_text_out(t, b, c)
#include "pf_xfer.c"
#undef pf_text_out
#include "stub_xfer.h"

static void *closer(void *arg) {
  (void)arg;
  close_rc = pf_xfer_peer_close(hook_peer);
  return NULL;
}
/* Runs pf_xfer_peer_close on another thread and gives it up to `ms`. */
static int close_meanwhile(const char *during, long ms) {
  int done = run_within(closer, ms);
  printf("close during %s: %s (rc %d)\n", during, done ? "finished" : "still waiting for it",
         close_rc);
  return done;
}
static int32_t hook_text_out(const char *text, char *buf, uint32_t cap) {
  if (hook_armed) {
    hook_armed = 0;
    close_meanwhile("pf_xfer_peer_error", 300);
  }
  return pf_text_out(text, buf, cap);
}
static int32_t hook_peer_info(pf_xfer_peer *p, uint8_t *buf, uint32_t cap) {
  (void)buf;
  (void)cap;
  if (hook_armed) {
    hook_armed = 0;
    close_meanwhile("pf_xfer_peer_info", 300);
  }
  /* What a transport's info reads (tcp: the endpoint's address). */
  return (int32_t)p->ep->cfg.port;
}

/* The close must end once the hooked call returned. */
static void wait_close(void) {
  for (int i = 0; i < 200 && close_rc == 99; i++) usleep(10000);
  printf("pf_xfer_peer_close: %d\n", close_rc);
}

static int hooked(const char *mode) {
  pf_ring *ring;
  hook_peer = stub_peer(16, 2, 1 << 20, 64, &ring);
  if (!strcmp(mode, "info")) {
    pf_xfer_peer *p = pf_handle_get(hook_peer, PF_K_XPEER, "test");
    static xfer_ops ops;
    ops = *p->ep->ops;
    ops.peer_info = hook_peer_info;
    p->ep->ops = &ops;
    hook_armed = 1;
    int32_t rc = pf_xfer_peer_info(hook_peer, NULL, 0);
    printf("info: %d\n", rc);
  } else {
    char text[64];
    hook_armed = 1;
    int32_t rc = pf_xfer_peer_error(hook_peer, text, sizeof text);
    printf("error: %d\n", rc);
  }
  CHECK(hook_armed == 0);
  wait_close();
  return close_rc != 0;
}

/* ---- a connect to a listener that never answers its hello ------------- */
static char remote[64];
static int32_t connect_rc = 99;
static char connect_err[512];

static void *connector(void *arg) {
  (void)arg;
  connect_rc = pf_xfer_peer_connect(hook_peer, (const uint8_t *)remote, strlen(remote), 1500);
  pf_last_error(connect_err, sizeof connect_err);
  return NULL;
}

/* Listens on 127.0.0.1 and never accepts: the kernel completes the
 * handshake, takes the hello into its buffer, and nothing answers. `full`:
 * its accept queue is filled first, so the kernel drops the connect's SYN
 * and the connect waits in its handshake (the socket not yet its stream's). */
static int silent_listener(int full) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  CHECK(bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && listen(fd, full ? 0 : 16) == 0);
  socklen_t al = sizeof a;
  CHECK(getsockname(fd, (struct sockaddr *)&a, &al) == 0);
  snprintf(remote, sizeof remote, "127.0.0.1:%u", ntohs(a.sin_port));
  for (int i = 0; full && i < 2; i++) {
    /* Left open: they fill the queue (non-blocking: the 2nd may wait too). */
    int c = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    CHECK(connect(c, (struct sockaddr *)&a, sizeof a) == 0 || errno == EINPROGRESS);
    usleep(20000);
  }
  return fd;
}

static int connecting(const char *mode) {
  uint32_t eng, pool, ring, ep;
  CHECK(pf_engine_open(PF_BACKEND_HOST, 0, 1, &eng) == 0);
  CHECK(pf_pool_create(eng, 1 << 20, 0, 0, NULL, &pool) == 0);
  CHECK(pf_ring_create(64, &ring) == 0);
  pf_xfer_config cfg = {.transport = PF_XFER_TCP, .streams = 2};
  strcpy(cfg.bind_addr, "127.0.0.1");
  CHECK(pf_xfer_open(pool, ring, &cfg, sizeof cfg, &ep) == 0);
  CHECK(pf_xfer_peer_create(ep, &hook_peer) == 0);
  int lfd = silent_listener(!strcmp(mode, "handshake"));
  pthread_t t;
  pthread_create(&t, NULL, connector, NULL);
  usleep(200000); /* the connect now waits for stream 0's hello */
  if (!strcmp(mode, "twice")) {
    int32_t rc = pf_xfer_peer_connect(hook_peer, (const uint8_t *)remote, strlen(remote), 300);
    char e[512];
    pf_last_error(e, sizeof e);
    printf("second connect: %d %s\n", rc, e);
    if (rc != PF_EBUSY) return 1;
  }
  int done = close_meanwhile("connect", 900);
  pthread_join(t, NULL);
  printf("connect: %d %s\n", connect_rc, connect_err);
  wait_close();
  close(lfd);
  if (!done || close_rc != 0 || connect_rc != PF_ESHUTDOWN) return 1;
  int32_t rc = pf_xfer_close(ep);
  printf("pf_xfer_close: %d\n", rc);
  return rc != 0;
}

/* ---- an endpoint closed while a peer is created on it ---------------- */
static uint32_t hook_ep;
static int ep_close_rc = 99;
static int32_t (*real_peer_create)(pf_xfer_peer *p);

static void *ep_closer(void *arg) {
  (void)arg;
  ep_close_rc = pf_xfer_close(hook_ep);
  return NULL;
}
static int32_t hook_peer_create(pf_xfer_peer *p) {
  int done = run_within(ep_closer, 300);
  printf("endpoint close during pf_xfer_peer_create: %s (rc %d)\n",
         done ? "finished" : "still waiting for it", ep_close_rc);
  return real_peer_create(p);
}

static int creating(void) {
  uint32_t eng, pool, ring, peer;
  CHECK(pf_engine_open(PF_BACKEND_HOST, 0, 1, &eng) == 0);
  CHECK(pf_pool_create(eng, 1 << 20, 0, 0, NULL, &pool) == 0);
  CHECK(pf_ring_create(64, &ring) == 0);
  pf_xfer_config cfg = {.transport = PF_XFER_TCP, .streams = 1};
  strcpy(cfg.bind_addr, "127.0.0.1");
  CHECK(pf_xfer_open(pool, ring, &cfg, sizeof cfg, &hook_ep) == 0);
  pf_xfer_ep *ep = pf_handle_get(hook_ep, PF_K_XFER, "test");
  static xfer_ops ops;
  ops = *ep->ops;
  real_peer_create = ops.peer_create;
  ops.peer_create = hook_peer_create;
  ep->ops = &ops;
  int32_t rc = pf_xfer_peer_create(hook_ep, &peer);
  printf("peer create: %d\n", rc);
  for (int i = 0; i < 200 && ep_close_rc == 99; i++) usleep(10000);
  if (rc != 0 || ep_close_rc != PF_EBUSY) return 1;
  pf_xfer_stats st;
  CHECK(pf_xfer_info(hook_ep, &st) == 0);
  printf("peers: %u\n", st.peers);
  CHECK(pf_xfer_peer_close(peer) == 0);
  rc = pf_xfer_close(hook_ep);
  printf("pf_xfer_close: %d\n", rc);
  return rc != 0 || st.peers != 1;
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "connect";
  if (!strcmp(mode, "connect") || !strcmp(mode, "handshake") || !strcmp(mode, "twice"))
    return connecting(mode);
  if (!strcmp(mode, "info") || !strcmp(mode, "error")) return hooked(mode);
  if (!strcmp(mode, "create")) return creating();
  fprintf(stderr, "usage: xfer_peer_close [connect|handshake|twice|info|error|create]\n");
  return 2;
}
