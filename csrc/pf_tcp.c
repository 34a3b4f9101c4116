/*
 * pf_tcp.c — the transfer contract over TCP: the default transport where no
 * RDMA device exists.
 *
 * Shape. A peer is N streams (sockets) to the remote endpoint's listener;
 * pf_xfer.c cuts a batch into parts, one or more per stream. Each stream has
 * a sender thread (request frames, and WRITE payloads straight from the pool
 * with sendmsg over iovecs: no user-space copy) and a receiver thread (READ
 * payloads straight into the pool with recvmsg over iovecs, and acks). The
 * listening side runs one serving thread per accepted connection: it checks
 * every segment against its own pool before it sends a READ's bytes or lands
 * a WRITE's, so a peer that lies about our pool size gets PF_ERANGE.
 *
 * Wire format (little-endian; every frame starts with pf_tcp_frame):
 *
 *   client -> server   HELLO  aux = protocol version, part = stream index
 *   server -> client   HELLO  bytes = the server's pool size
 *   client -> server   READ   slot, gen, part, nseg; then nseg x {off, bytes}
 *   server -> client   READ_RESP  slot, gen, part, status, bytes; then the
 *                              bytes of the segments in order (none if the
 *                              status is not PF_OK)
 *   client -> server   WRITE  slot, gen, part, nseg, bytes; segs; payload
 *   server -> client   ACK    slot, gen, part, status (after the payload
 *                              landed in the server's pool)
 *   client -> server   IMM    slot, gen, aux = immediate, bytes = the
 *                              batch's bytes; sent on stream 0 only after
 *                              every WRITE part of the batch was acked, so
 *                              the target's PF_DONE_XFER_IMM record follows
 *                              the data on every stream
 *   server -> client   ACK    for the IMM
 *   client -> server   BLAST  bytes, part = stream index: the server sends
 *                              that many raw bytes (aux PF_BLAST_WIDE: the
 *                              stream's own range of its pool) and closes
 *                              (pf_tcp_blast, benchmarks only)
 *   server -> client   REFUSE status = PF_EBUSY (the endpoint serves its
 *                              cap of connections) or PF_ENOMEM (out of
 *                              descriptors, memory or threads), bytes =
 *                              connections served, aux = the cap; sent in
 *                              place of the HELLO, unasked, and the server
 *                              closes the connection
 *
 * Deadlines and late bytes: (slot, gen) in each response names the batch.
 * The receiver enters the slot (pf_xfer_internal.h) for each burst of
 * non-blocking recvmsg into the pool and polls outside it; a response whose
 * batch has ended (timed out, failed, closed) is read into a scratch buffer
 * and counted as late bytes. The stream stays usable. A WRITE whose batch
 * ends while its payload is half sent cannot finish its frame, so that stream
 * (and the peer) is failed: the target never acks or posts an IMM for it.
 *
 * MSG_ZEROCOPY is not used: it only pays for large sends on real NICs, the
 * pool range would have to stay untouched until the kernel's notification
 * (which a timed-out batch cannot promise), and on loopback the kernel
 * copies anyway.
 */
#define _GNU_SOURCE
#include "pf_xfer_internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define TCP_MAGIC 0x31584650u /* "PFX1" */
#define TCP_VERSION 1u
enum { OP_HELLO = 1, OP_READ = 2, OP_WRITE = 3, OP_IMM = 4, OP_READ_RESP = 5, OP_ACK = 6,
       OP_BLAST = 7, OP_REFUSE = 8 };
/* Part number of the IMM frame (data parts are numbered from 0). */
#define IMM_PART 0xffffffffu
/* Chunks per frame: bounds a serving connection's segment buffer (1 MiB). */
#define TCP_MAX_FRAME_SEGS 65536u
/* iovecs per sendmsg/recvmsg call (IOV_MAX is 1024): 256 x 32 KiB blocks
 * = 8 MiB, more than a socket buffer holds, so one call per wakeup. */
#define TCP_BURST_IOV 256
/* How often blocked threads look at their stop flag. */
#define TCP_POLL_MS 50
/* Receive buffer for bytes nobody wants (late data, refused WRITEs). */
#define TCP_SCRATCH (256u << 10)
/* Bytes a blast connection receives per recv (iperf's default is 128 KiB). */
#define BLAST_BUF (1u << 20)
/* While a payload streams in, the receiver asks the kernel to wake it only
 * once this much has arrived (SO_RCVLOWAT; lowered for a part's tail): a
 * wakeup then moves a large burst for one poll and one recvmsg. */
#define TCP_RCVLOWAT (256u << 10)
/* A dead peer that never resets the connection is noticed after this. */
#define TCP_USER_TIMEOUT_MS 30000
/* The serving side's deadline for any one wait inside a request (the rest
 * of a frame, a WRITE's payload) or a reply (a READ's payload, a blast): no
 * byte moved for this long and the connection is closed, logged with the
 * peer's address and stream. Progress restarts it (nginx's send_timeout):
 * a slow reader is served, one that stops reading cannot hold the serving
 * thread. Only the wait for the next request on an open stream is unbounded
 * (a peer's streams idle between batches). Env PEGAFLOW_TCP_STALL_MS
 * overrides it per endpoint (1 .. TCP_MAX_STALL_MS). */
#define TCP_STALL_MS 10000u
#define TCP_MAX_STALL_MS 3600000u
/* Connections an endpoint serves at once, each with its own thread (a peer
 * opens `streams`, 1..64, default 4: 4096 serve 1024 peers at the default,
 * 64 at the most streams). Without a cap anyone who reaches the port could
 * open connections until threads or memory ran out; one over it is accepted
 * and refused at once (REFUSE, close), so the requester fails its connect
 * naming the cap instead of waiting. Env PEGAFLOW_TCP_MAX_CONNS overrides it
 * per endpoint (1 .. TCP_MAX_CONNS_LIMIT). */
#define TCP_MAX_CONNS 4096u
#define TCP_MAX_CONNS_LIMIT 65536u
/* How long the acceptor waits (on its wake descriptor: a close still ends it
 * at once) after an accept failed and no connection could be taken off the
 * backlog: a pending connection keeps the listener readable, so accepting
 * again at once would spin a core for as long as the shortage lasts. */
#define TCP_ACCEPT_BACKOFF_MS 100

typedef struct pf_tcp_frame {
  uint32_t magic;
  uint16_t op;
  int16_t status;
  uint32_t slot;
  uint32_t gen;
  uint32_t part;
  uint32_t nseg;
  uint64_t bytes;
  uint32_t aux;
  uint32_t reserved;
} pf_tcp_frame;
_Static_assert(sizeof(pf_tcp_frame) == 40, "wire frame is 40 bytes");

typedef struct wire_seg {
  uint64_t off;
  uint64_t bytes;
} wire_seg;

/* ---- socket helpers ---------------------------------------------------- */
static void tune_socket(int fd, uint32_t sock_buf) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (sock_buf) {
    int b = (int)sock_buf;
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &b, sizeof b);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof b);
  }
  unsigned ut = TCP_USER_TIMEOUT_MS;
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ut, sizeof ut);
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
}

/* Waits until fd is ready for `events`, *stop is set or `deadline` (pf_now_ns
 * clock; 0 = none) passes; 1 ready, 0 stop, -1 error (errno), -3 deadline. */
static int wait_fd(int fd, short events, atomic_int *stop, uint64_t deadline) {
  struct pollfd pfd = {.fd = fd, .events = events};
  for (;;) {
    if (stop && atomic_load(stop)) return 0;
    int ms = TCP_POLL_MS, last = 0;
    if (deadline) {
      int64_t left_ns = (int64_t)(deadline - pf_now_ns());
      /* One last look once it passed: a descriptor that is ready has not
       * stalled (this process may itself have been stopped past the
       * deadline). Whole ms rounded up: rounded down, a wait ended up to
       * 1 ms before its deadline (tests/native/c/tcp_wait_deadline.c). */
      if (left_ns <= 0) {
        last = 1;
        ms = 0;
      } else if (left_ns < (int64_t)ms * 1000000) {
        ms = (int)((left_ns + 999999) / 1000000);
      }
    }
    int r = poll(&pfd, 1, ms);
    if (r > 0) return 1;
    if (r < 0 && errno != EINTR) return -1;
    if (last) return -3;
  }
}

/* Sends all of buf (blocking semantics over a non-blocking loop). 0 ok,
 * -1 error/EOF (errno), -2 stopped. */
static int send_all(int fd, const void *buf, size_t len, atomic_int *stop) {
  const uint8_t *b = buf;
  while (len) {
    ssize_t n = send(fd, b, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      b += n;
      len -= (size_t)n;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      int r = wait_fd(fd, POLLOUT, stop, 0);
      if (r == 0) return -2;
      if (r < 0) return -1;
      continue;
    }
    return -1;
  }
  return 0;
}

/* Receives exactly len bytes by `deadline` (pf_now_ns clock; 0 = none). 0 ok,
 * -1 error (errno; 0 = EOF), -2 stopped, -3 the deadline passed first. */
static int recv_all(int fd, void *buf, size_t len, atomic_int *stop, uint64_t deadline) {
  uint8_t *b = buf;
  while (len) {
    ssize_t n = recv(fd, b, len, MSG_DONTWAIT);
    if (n > 0) {
      b += n;
      len -= (size_t)n;
      continue;
    }
    if (n == 0) {
      errno = 0;
      return -1;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      int r = wait_fd(fd, POLLIN, stop, deadline);
      if (r == 0) return -2;
      if (r < 0) return r;
      continue;
    }
    return -1;
  }
  return 0;
}

static const char *eof_text(void) { return errno ? strerror(errno) : "connection closed by peer"; }

/* Parses "host:port" / "[v6]:port" into addr. */
static int32_t parse_hostport(const char *fn, const char *text, struct sockaddr_storage *ss,
                              socklen_t *sl) {
  char host[256];
  const char *colon = strrchr(text, ':');
  if (!colon || colon == text || !colon[1])
    return pf_fail(PF_EINVAL, "%s: address \"%s\" is not host:port", fn, text);
  size_t hl = (size_t)(colon - text);
  if (text[0] == '[' && hl >= 2 && text[hl - 1] == ']') {
    text++;
    hl -= 2;
  }
  if (hl >= sizeof host) return pf_fail(PF_EINVAL, "%s: host in \"%s\" is too long", fn, text);
  memcpy(host, text, hl);
  host[hl] = 0;
  char *end;
  long port = strtol(colon + 1, &end, 10);
  if (*end || port <= 0 || port > 65535)
    return pf_fail(PF_EINVAL, "%s: port \"%s\" is not in 1..65535", fn, colon + 1);
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
  int e = getaddrinfo(host, NULL, &hints, &res);
  if (e || !res) return pf_fail(PF_EINVAL, "%s: cannot resolve \"%s\": %s", fn, host, gai_strerror(e));
  memcpy(ss, res->ai_addr, res->ai_addrlen);
  *sl = res->ai_addrlen;
  if (ss->ss_family == AF_INET) ((struct sockaddr_in *)ss)->sin_port = htons((uint16_t)port);
  else ((struct sockaddr_in6 *)ss)->sin6_port = htons((uint16_t)port);
  freeaddrinfo(res);
  return PF_OK;
}

/* Non-blocking connect by `deadline` (pf_now_ns clock), giving up when
 * *stop is set (NULL = never); returns a non-blocking socket. */
static int32_t connect_to(const char *fn, const struct sockaddr_storage *ss, socklen_t sl,
                          uint32_t sock_buf, uint64_t deadline, atomic_int *stop,
                          const char *what, int *out_fd) {
  int fd = socket(ss->ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return pf_fail(PF_EIO, "%s: socket: %s", fn, strerror(errno));
  tune_socket(fd, sock_buf);
  if (connect(fd, (const struct sockaddr *)ss, sl) < 0 && errno != EINPROGRESS) {
    int e = errno;
    close(fd);
    return pf_fail(PF_EIO, "%s: connect to %s: %s", fn, what, strerror(e));
  }
  int r = wait_fd(fd, POLLOUT, stop, deadline);
  int e = errno;
  if (r == 0) {
    close(fd);
    return pf_fail(PF_ESHUTDOWN, "%s: connect to %s: closed while connecting", fn, what);
  }
  if (r == -3) {
    close(fd);
    return pf_fail(PF_ETIMEDOUT, "%s: connect to %s: no answer by the deadline", fn, what);
  }
  int err = 0;
  socklen_t el = sizeof err;
  getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
  if (r < 0 || err) {
    close(fd);
    return pf_fail(PF_EIO, "%s: connect to %s: %s", fn, what, strerror(r < 0 ? e : err));
  }
  *out_fd = fd;
  return PF_OK;
}

/* ---- the listening side ------------------------------------------------ */
typedef struct tcp_conn {
  pf_xfer_ep *ep;
  int fd;
  uint32_t id;
  uint32_t stream;        /* the peer's stream index (its HELLO's part) */
  char addr[64];          /* the peer's address, "ip:port" (log lines) */
  const char *doing;      /* what the connection waits on (log lines) */
  uint64_t doing_bytes;
  pthread_t thread;
  atomic_int done;
  struct tcp_conn *next;
} tcp_conn;

typedef struct tcp_ep {
  int lfd;
  int wake;               /* eventfd: wakes the accept loop at close */
  /* A descriptor held in reserve (/dev/null; -1 = none): out of descriptors,
   * the acceptor gives it up for a moment to take a pending connection off
   * the backlog and refuse it (libev's and nginx's way). */
  int spare;
  pthread_t acceptor;
  atomic_int stop;
  uint32_t stall_ms;      /* TCP_STALL_MS, or PEGAFLOW_TCP_STALL_MS */
  uint32_t max_conns;     /* TCP_MAX_CONNS, or PEGAFLOW_TCP_MAX_CONNS */
  /* Since the last connection served (the acceptor's own; log lines: the
   * first of a burst is logged, the rest counted). */
  uint64_t burst_refused, burst_failed;
  pthread_mutex_t mu;
  tcp_conn *conns;
  uint32_t next_id;
} tcp_ep;

/* Waits for `events` on a serving connection, at most the endpoint's stall
 * time: 1 ready, 0 the endpoint is closing, -1 error (errno), -3 stalled. */
static int serve_wait(tcp_conn *c, short events) {
  tcp_ep *t = c->ep->impl;
  return wait_fd(c->fd, events, &t->stop, pf_now_ns() + (uint64_t)t->stall_ms * 1000000ull);
}

/* Moves len bytes between buf and the connection (to_socket: send), each
 * wait bounded by the stall time. 0 ok, -1 error or EOF (errno; 0 = EOF),
 * -2 the endpoint is closing, -3 stalled. */
static int serve_io(tcp_conn *c, void *buf, size_t len, int to_socket) {
  uint8_t *b = buf;
  while (len) {
    ssize_t n = to_socket ? send(c->fd, b, len, MSG_NOSIGNAL | MSG_DONTWAIT)
                          : recv(c->fd, b, len, MSG_DONTWAIT);
    if (n > 0) {
      b += n;
      len -= (size_t)n;
      continue;
    }
    if (n == 0) {
      errno = 0;
      return -1;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    int r = serve_wait(c, to_socket ? POLLOUT : POLLIN);
    if (r != 1) return r == 0 ? -2 : r;
  }
  return 0;
}

static int serve_reply(tcp_conn *c, uint16_t op, const pf_tcp_frame *req, int32_t status,
                       uint64_t bytes) {
  pf_tcp_frame r = {.magic = TCP_MAGIC, .op = op, .status = (int16_t)status,
                    .slot = req->slot, .gen = req->gen, .part = req->part, .bytes = bytes};
  c->doing = "sending a reply";
  c->doing_bytes = sizeof r;
  return serve_io(c, &r, sizeof r, 1);
}

/* Moves the pool bytes of segs[0..n) to (send) or from (recv) the socket,
 * with iovecs straight over the pool. 0 ok, <0 like serve_io. */
static int serve_payload(tcp_conn *c, const wire_seg *segs, uint32_t n, int to_socket) {
  uint8_t *pool = c->ep->pool->host;
  uint32_t i = 0;
  uint64_t done_in_seg = 0;
  while (i < n) {
    struct iovec iov[TCP_BURST_IOV];
    int k = 0;
    uint64_t skip = done_in_seg;
    for (uint32_t j = i; j < n && k < TCP_BURST_IOV; j++, k++) {
      iov[k].iov_base = pool + segs[j].off + skip;
      iov[k].iov_len = segs[j].bytes - skip;
      skip = 0;
    }
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)k};
    ssize_t m = to_socket ? sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT)
                          : recvmsg(c->fd, &mh, MSG_DONTWAIT);
    if (m == 0 && !to_socket) {
      errno = 0;
      return -1;
    }
    if (m < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        int r = serve_wait(c, to_socket ? POLLOUT : POLLIN);
        if (r != 1) return r == 0 ? -2 : r;
        continue;
      }
      return -1;
    }
    uint64_t left = (uint64_t)m;
    while (left) {
      uint64_t room = segs[i].bytes - done_in_seg;
      if (left < room) {
        done_in_seg += left;
        left = 0;
      } else {
        left -= room;
        done_in_seg = 0;
        i++;
      }
    }
  }
  return 0;
}

static int discard(tcp_conn *c, uint64_t bytes, uint8_t *scratch) {
  while (bytes) {
    size_t n = bytes < TCP_SCRATCH ? (size_t)bytes : TCP_SCRATCH;
    int r = serve_io(c, scratch, n, 0);
    if (r) return r;
    bytes -= n;
  }
  return 0;
}

/* Sends `bytes` raw bytes from the pool: the first BLAST_BUF bytes over and
 * over (iperf's way), or, `wide`, stream `stream`'s own `bytes` of the pool
 * (stream i from offset i * bytes, wrapping at its end): like a READ, every
 * stream moves distinct memory. <0 like serve_io. */
static int serve_blast(tcp_conn *c, uint64_t bytes, int wide, uint32_t stream) {
  uint64_t pool = c->ep->pool->bytes;
  uint64_t span = wide ? pool : (pool < BLAST_BUF ? pool : BLAST_BUF);
  uint64_t at = wide ? (uint64_t)stream * bytes % pool : 0;
  c->doing = "sending a blast";
  c->doing_bytes = bytes;
  while (bytes) {
    uint64_t room = span - at;
    size_t n = bytes < room ? (size_t)bytes : (size_t)room;
    int r = serve_io(c, c->ep->pool->host + at, n, 1);
    if (r) return r;
    bytes -= n;
    at = (at + n) % span;
  }
  return 0;
}

/* Says why a serving connection is dropped for a stall (a peer must not be
 * able to hold a serving thread by not reading or not finishing a frame). */
static void serve_stalled(tcp_conn *c) {
  tcp_ep *t = c->ep->impl;
  fprintf(stderr, "pegaflow: transfer endpoint port %u: connection %u from %s (stream %u): no "
          "progress for %u ms while %s (%llu bytes); connection closed\n", c->ep->listen_port,
          c->id, c->addr, c->stream, t->stall_ms, c->doing, (unsigned long long)c->doing_bytes);
}

/* Serves one READ or WRITE whose header is f. 0 ok, <0 drop the connection
 * (-3: it stalled). */
static int serve_data(tcp_conn *c, const pf_tcp_frame *f, wire_seg *segs, uint8_t *scratch) {
  pf_xfer_ep *ep = c->ep;
  uint64_t pool_bytes = ep->pool->bytes;
  c->doing = "receiving a segment list";
  c->doing_bytes = (uint64_t)f->nseg * sizeof *segs;
  int r = f->nseg ? serve_io(c, segs, (size_t)f->nseg * sizeof *segs, 0) : 0;
  if (r) return r;
  /* Our own bounds, whatever the peer believes our pool to be. */
  int32_t status = f->nseg ? PF_OK : PF_EINVAL;
  uint64_t total = 0;
  for (uint32_t i = 0; i < f->nseg; i++) {
    const wire_seg *s = &segs[i];
    if (!s->bytes || s->off > pool_bytes || s->bytes > pool_bytes - s->off) status = PF_ERANGE;
    total += s->bytes;
  }
  if (f->op == OP_READ) {
    if (status != PF_OK) return serve_reply(c, OP_READ_RESP, f, status, 0);
    if ((r = serve_reply(c, OP_READ_RESP, f, PF_OK, total))) return r;
    c->doing = "sending a READ's payload";
    c->doing_bytes = total;
    if ((r = serve_payload(c, segs, f->nseg, 1))) return r;
    atomic_fetch_add(&ep->bytes_served, total);
    return 0;
  }
  if (f->bytes != total) return -1; /* framing lie: cannot skip it safely */
  c->doing = "receiving a WRITE's payload";
  c->doing_bytes = total;
  if (status != PF_OK) {
    r = discard(c, f->bytes, scratch);
  } else if (!(r = serve_payload(c, segs, f->nseg, 0))) {
    atomic_fetch_add(&ep->bytes_landed, total);
  }
  return r ? r : serve_reply(c, OP_ACK, f, status, 0);
}

/* Serves a connection's first frame (HELLO or BLAST); 1 = go on serving
 * frames, 0 = done, <0 drop it (-3: it stalled). */
static int serve_first(tcp_conn *c) {
  pf_tcp_frame f;
  c->doing = "waiting for its first frame";
  c->doing_bytes = sizeof f;
  int r = serve_io(c, &f, sizeof f, 0);
  if (r) return r;
  if (f.magic != TCP_MAGIC) return -1;
  c->stream = f.part;
  if (f.op == OP_BLAST) {
    r = serve_blast(c, f.bytes, f.aux & PF_BLAST_WIDE, f.part);
    return r ? r : 0;
  }
  if (f.op != OP_HELLO || f.aux != TCP_VERSION) return -1;
  pf_tcp_frame hello = {.magic = TCP_MAGIC, .op = OP_HELLO, .bytes = c->ep->pool->bytes,
                        .aux = TCP_VERSION, .part = f.part};
  c->doing = "sending its hello";
  r = serve_io(c, &hello, sizeof hello, 1);
  return r ? r : 1;
}

static void *serve_main(void *arg) {
  pthread_setname_np(pthread_self(), "pf-tcp-serve"); /* top, perf, /proc: whose CPU */
  tcp_conn *c = arg;
  pf_xfer_ep *ep = c->ep;
  tcp_ep *t = ep->impl;
  wire_seg *segs = malloc(TCP_MAX_FRAME_SEGS * sizeof *segs);
  uint8_t *scratch = malloc(TCP_SCRATCH);
  pf_tcp_frame f;
  int r = segs && scratch ? serve_first(c) : -1;
  while (r == 1) {
    /* Between requests a stream may idle for good; once a frame's first
     * byte is here, the rest of it is due within the stall time. */
    r = wait_fd(c->fd, POLLIN, &t->stop, 0);
    if (r != 1) break;
    c->doing = "receiving a frame header";
    c->doing_bytes = sizeof f;
    if ((r = serve_io(c, &f, sizeof f, 0))) break;
    r = 1;
    /* A frame we cannot parse leaves the stream out of sync: drop it. */
    if (f.magic != TCP_MAGIC || f.nseg > TCP_MAX_FRAME_SEGS) break;
    if (f.op == OP_IMM) {
      if (f.nseg) break;
      pf_completion rec = {.tag = ep->cfg.imm_tag, .kind = PF_DONE_XFER_IMM, .index = c->id,
                           .status = PF_OK, .aux = f.aux, .value = f.bytes};
      pf_ring_post(ep->ring, &rec);
      r = serve_reply(c, OP_ACK, &f, PF_OK, 0);
    } else if (f.op == OP_READ || f.op == OP_WRITE) {
      r = serve_data(c, &f, segs, scratch);
    } else {
      break;
    }
    if (r == 0) r = 1;
  }
  if (r == -3) serve_stalled(c);
  free(segs);
  free(scratch);
  atomic_fetch_sub(&ep->conns_open, 1);
  atomic_store(&c->done, 1);
  return NULL;
}

static void reap_conns(tcp_ep *t, int all) {
  pthread_mutex_lock(&t->mu);
  tcp_conn **pp = &t->conns;
  while (*pp) {
    tcp_conn *c = *pp;
    if (all) shutdown(c->fd, SHUT_RDWR);
    if (all || atomic_load(&c->done)) {
      *pp = c->next;
      pthread_mutex_unlock(&t->mu);
      pthread_join(c->thread, NULL);
      close(c->fd);
      free(c);
      pthread_mutex_lock(&t->mu);
      pp = &t->conns;
      continue;
    }
    pp = &c->next;
  }
  pthread_mutex_unlock(&t->mu);
}

/* "ip:port" ("[v6]:port") of an accepted peer, for log lines. */
static void format_addr(const struct sockaddr_storage *ss, char *out, size_t cap) {
  char ip[INET6_ADDRSTRLEN] = "?";
  unsigned port = 0;
  if (ss->ss_family == AF_INET) {
    const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
    inet_ntop(AF_INET, &a->sin_addr, ip, sizeof ip);
    port = ntohs(a->sin_port);
  } else if (ss->ss_family == AF_INET6) {
    const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
    inet_ntop(AF_INET6, &a->sin6_addr, ip, sizeof ip);
    port = ntohs(a->sin6_port);
  }
  snprintf(out, cap, ss->ss_family == AF_INET6 ? "[%s]:%u" : "%s:%u", ip, port);
}

/* Turns an accepted connection away at once: a REFUSE frame (40 bytes into
 * a fresh socket's empty buffer: never waits), then close, so the requester
 * fails its connect naming the reason instead of waiting for a hello.
 * Counted; the first of a burst is logged with the peer's address (a flood
 * is one line, not one per connection). */
static void refuse_conn(pf_xfer_ep *ep, int fd, const char *addr, int32_t status,
                        const char *why) {
  tcp_ep *t = ep->impl;
  uint64_t open_now = atomic_load(&ep->conns_open);
  pf_tcp_frame f = {.magic = TCP_MAGIC, .op = OP_REFUSE, .status = (int16_t)status,
                    .bytes = open_now, .aux = t->max_conns};
  (void)!send(fd, &f, sizeof f, MSG_NOSIGNAL | MSG_DONTWAIT);
  close(fd);
  atomic_fetch_add(&ep->conns_refused, 1);
  if (t->burst_refused++ == 0)
    fprintf(stderr, "pegaflow: transfer endpoint port %u: connection from %s refused: %s "
            "(%llu connections served, cap %u); further refusals are counted, not logged, "
            "until one is served\n", ep->listen_port, addr, why, (unsigned long long)open_now,
            t->max_conns);
}

/* A connection is being served: a burst of refusals or failed accepts
 * before it has ended (one line for it). */
static void burst_end(pf_xfer_ep *ep) {
  tcp_ep *t = ep->impl;
  if (!t->burst_refused && !t->burst_failed) return;
  fprintf(stderr, "pegaflow: transfer endpoint port %u: serving connections again after "
          "refusing %llu and failing to accept %llu\n", ep->listen_port,
          (unsigned long long)t->burst_refused, (unsigned long long)t->burst_failed);
  t->burst_refused = t->burst_failed = 0;
}

/* Errors accept(2) passes on from a pending connection that it consumed (the
 * man page: retry as for EAGAIN): nothing is left in the backlog for them. */
static int accept_transient(int e) {
  return e == EAGAIN || e == EWOULDBLOCK || e == EINTR || e == ECONNABORTED || e == EPROTO ||
         e == ENETDOWN || e == ENOPROTOOPT || e == EHOSTDOWN || e == ENONET ||
         e == EHOSTUNREACH || e == EOPNOTSUPP || e == ENETUNREACH;
}

/* accept4 failed with `e` (not transient). Out of descriptors, the reserve
 * one is given up to take the pending connection off the backlog and refuse
 * it: 1. Else (no reserve, out of memory, a broken listener) 0: the caller
 * backs off, since the connection still pending keeps the listener readable
 * and accepting again at once would spin. Logged once per burst. */
static int accept_failed(pf_xfer_ep *ep, int e) {
  tcp_ep *t = ep->impl;
  atomic_fetch_add(&ep->accept_errors, 1);
  if (t->spare < 0) t->spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if ((e == EMFILE || e == ENFILE) && t->spare >= 0) {
    close(t->spare);
    struct sockaddr_storage from;
    socklen_t fl = sizeof from;
    int fd = accept4(t->lfd, (struct sockaddr *)&from, &fl, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      char addr[64], why[96];
      format_addr(&from, addr, sizeof addr);
      snprintf(why, sizeof why, "out of file descriptors (accept: %s)", strerror(e));
      refuse_conn(ep, fd, addr, PF_ENOMEM, why); /* closes fd: room for the reserve again */
    }
    t->spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) return 1;
  }
  if (t->burst_failed++ == 0)
    fprintf(stderr, "pegaflow: transfer endpoint port %u: accept failed: %s; accepting again "
            "every %u ms until it succeeds (failures are counted, not logged)\n",
            ep->listen_port, strerror(e), TCP_ACCEPT_BACKOFF_MS);
  return 0;
}

/* Serves an accepted connection on its own thread, or refuses it (over the
 * cap, out of memory or threads). */
static void serve_conn(pf_xfer_ep *ep, int fd, const struct sockaddr_storage *from) {
  tcp_ep *t = ep->impl;
  char addr[64];
  format_addr(from, addr, sizeof addr);
  /* conns_open only grows here (serving threads lower it): no race past the cap. */
  if (atomic_load(&ep->conns_open) >= t->max_conns) {
    refuse_conn(ep, fd, addr, PF_EBUSY, "the endpoint serves its cap of connections "
                "(PEGAFLOW_TCP_MAX_CONNS)");
    return;
  }
  tune_socket(fd, ep->cfg.sock_buf);
  tcp_conn *c = calloc(1, sizeof *c);
  if (!c) {
    refuse_conn(ep, fd, addr, PF_ENOMEM, "out of memory");
    return;
  }
  c->ep = ep;
  c->fd = fd;
  memcpy(c->addr, addr, sizeof c->addr);
  pthread_mutex_lock(&t->mu);
  c->id = ++t->next_id;
  atomic_fetch_add(&ep->conns_open, 1);
  int e = pthread_create(&c->thread, NULL, serve_main, c);
  if (e) {
    atomic_fetch_sub(&ep->conns_open, 1);
    pthread_mutex_unlock(&t->mu);
    free(c);
    char why[96];
    snprintf(why, sizeof why, "cannot start a serving thread: %s", strerror(e));
    refuse_conn(ep, fd, addr, PF_ENOMEM, why);
    return;
  }
  c->next = t->conns;
  t->conns = c;
  pthread_mutex_unlock(&t->mu);
  burst_end(ep);
}

static void *accept_main(void *arg) {
  pthread_setname_np(pthread_self(), "pf-tcp-accept");
  pf_xfer_ep *ep = arg;
  tcp_ep *t = ep->impl;
  struct pollfd pfd[2] = {{.fd = t->lfd, .events = POLLIN}, {.fd = t->wake, .events = POLLIN}};
  while (!atomic_load(&t->stop)) {
    int r = poll(pfd, 2, 1000);
    reap_conns(t, 0);
    if (r <= 0 || !(pfd[0].revents & POLLIN)) continue;
    struct sockaddr_storage from;
    socklen_t fl = sizeof from;
    int fd = accept4(t->lfd, (struct sockaddr *)&from, &fl, SOCK_NONBLOCK | SOCK_CLOEXEC);
    int e = errno;
    if (fd >= 0) {
      serve_conn(ep, fd, &from);
    } else if (!accept_transient(e) && !accept_failed(ep, e)) {
      poll(&pfd[1], 1, TCP_ACCEPT_BACKOFF_MS); /* the wake descriptor: a close ends it */
    }
  }
  return NULL;
}

static int32_t tcp_open(pf_xfer_ep *ep) {
  const char *fn = "pf_xfer_open(tcp)";
  const char *bind_addr = ep->cfg.bind_addr[0] ? ep->cfg.bind_addr : "0.0.0.0";
  struct sockaddr_storage ss;
  memset(&ss, 0, sizeof ss);
  socklen_t sl;
  struct sockaddr_in *v4 = (struct sockaddr_in *)&ss;
  struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)&ss;
  if (inet_pton(AF_INET, bind_addr, &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons((uint16_t)ep->cfg.port);
    sl = sizeof *v4;
  } else if (inet_pton(AF_INET6, bind_addr, &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons((uint16_t)ep->cfg.port);
    sl = sizeof *v6;
  } else {
    return pf_fail(PF_EINVAL, "%s: bind_addr \"%s\" is not an IPv4 or IPv6 literal", fn,
                   bind_addr);
  }
  uint32_t stall_ms, max_conns;
  int32_t rc = xfer_env_limit(fn, "PEGAFLOW_TCP_STALL_MS", TCP_STALL_MS, TCP_MAX_STALL_MS,
                              " (ms)", &stall_ms);
  if (rc == PF_OK)
    rc = xfer_env_limit(fn, "PEGAFLOW_TCP_MAX_CONNS", TCP_MAX_CONNS, TCP_MAX_CONNS_LIMIT,
                        " (connections)", &max_conns);
  if (rc < 0) return rc;
  tcp_ep *t = calloc(1, sizeof *t);
  if (!t) return pf_fail(PF_ENOMEM, "%s: out of memory", fn);
  t->stall_ms = stall_ms;
  t->max_conns = max_conns;
  t->lfd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (t->lfd < 0) {
    free(t);
    return pf_fail(PF_EIO, "%s: socket: %s", fn, strerror(errno));
  }
  int one = 1;
  setsockopt(t->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  /* Accepted sockets inherit buffer sizes set before listen. */
  tune_socket(t->lfd, ep->cfg.sock_buf);
  if (bind(t->lfd, (struct sockaddr *)&ss, sl) < 0 || listen(t->lfd, 256) < 0) {
    int e = errno;
    close(t->lfd);
    free(t);
    return pf_fail(PF_EIO, "%s: cannot listen on %s port %u: %s", fn, bind_addr, ep->cfg.port,
                   strerror(e));
  }
  struct sockaddr_storage got;
  socklen_t gl = sizeof got;
  getsockname(t->lfd, (struct sockaddr *)&got, &gl);
  ep->listen_port = ntohs(got.ss_family == AF_INET ? ((struct sockaddr_in *)&got)->sin_port
                                                    : ((struct sockaddr_in6 *)&got)->sin6_port);
  t->wake = eventfd(0, EFD_CLOEXEC);
  if (t->wake < 0) {
    /* Without it a close would wait out the acceptor's 1 s poll. */
    int e = errno;
    close(t->lfd);
    free(t);
    return pf_fail(PF_EIO, "%s: eventfd (the accept loop's wake-up): %s", fn, strerror(e));
  }
  t->spare = open("/dev/null", O_RDONLY | O_CLOEXEC); /* none: accept_failed backs off */
  pthread_mutex_init(&t->mu, NULL);
  ep->impl = t;
  int e = pthread_create(&t->acceptor, NULL, accept_main, ep);
  if (e) {
    if (t->spare >= 0) close(t->spare);
    close(t->wake);
    close(t->lfd);
    pthread_mutex_destroy(&t->mu);
    free(t);
    ep->impl = NULL;
    return pf_fail(PF_ENOMEM, "%s: cannot start the accept thread: %s", fn, strerror(e));
  }
  return PF_OK;
}

static void tcp_close(pf_xfer_ep *ep) {
  tcp_ep *t = ep->impl;
  atomic_store(&t->stop, 1);
  eventfd_write(t->wake, 1);
  pthread_join(t->acceptor, NULL);
  reap_conns(t, 1);
  close(t->lfd);
  close(t->wake);
  if (t->spare >= 0) close(t->spare);
  pthread_mutex_destroy(&t->mu);
  free(t);
}

/* ---- the connecting side ----------------------------------------------- */
typedef struct tx_item {
  uint32_t slot, gen, part;
} tx_item;

typedef struct tcp_stream {
  pf_xfer_peer *p;
  uint32_t idx;
  int fd;
  int started;
  pthread_t tx, rx;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  tx_item *q;
  uint32_t qhead, qlen, qcap;
  uint8_t *frame;   /* header + segment list being sent */
  uint8_t *scratch; /* late bytes land here */
  int lowat;        /* SO_RCVLOWAT in force (1 = the kernel's default) */
} tcp_stream;

typedef struct tcp_peer {
  tcp_stream *st;
  uint32_t n;
  atomic_int stop;
  char remote[160];
} tcp_peer;

static int32_t enqueue(tcp_stream *st, uint32_t slot, uint32_t gen, uint32_t part) {
  pthread_mutex_lock(&st->mu);
  if (st->qlen == st->qcap) {
    uint32_t ncap = st->qcap ? st->qcap * 2 : 64;
    tx_item *q = malloc((size_t)ncap * sizeof *q);
    if (!q) {
      pthread_mutex_unlock(&st->mu);
      return pf_fail(PF_ENOMEM, "pf_xfer_submit: out of memory for the send queue");
    }
    for (uint32_t i = 0; i < st->qlen; i++) q[i] = st->q[(st->qhead + i) % st->qcap];
    free(st->q);
    st->q = q;
    st->qhead = 0;
    st->qcap = ncap;
  }
  st->q[(st->qhead + st->qlen) % st->qcap] = (tx_item){slot, gen, part};
  st->qlen++;
  pthread_cond_signal(&st->cv);
  pthread_mutex_unlock(&st->mu);
  return PF_OK;
}

static void stream_fail(tcp_stream *st, const char *what, const char *why) {
  tcp_peer *tp = st->p->impl;
  if (atomic_load(&tp->stop)) {
    xfer_peer_fail(st->p, PF_ESHUTDOWN, "peer closed");
    return;
  }
  xfer_peer_fail(st->p, PF_EIO, "stream %u to %s: %s: %s", st->idx, tp->remote, what, why);
  /* A broken peer takes no more work: shut every stream so the serving
   * side sees the end at once (a half-sent frame is dropped there). The
   * descriptors are closed when the peer is freed. */
  for (uint32_t i = 0; i < tp->n; i++) shutdown(tp->st[i].fd, SHUT_RDWR);
}

/* The chunk cursor of a payload: chunk i, in_chunk bytes into it. Both
 * directions move a payload as bursts of iovecs straight into or out of the
 * pool; these two own how a burst is cut and how the cursor moves. */

/* Fills iov[] from the cursor up to `end` (at most TCP_BURST_IOV entries);
 * returns the count, and the bytes they cover in *bytes (when not NULL). */
static int chunks_burst(uint8_t *pool, const xfer_chunk *chunks, uint32_t i, uint32_t end,
                        uint64_t in_chunk, struct iovec *iov, uint64_t *bytes) {
  int k = 0;
  uint64_t skip = in_chunk, sum = 0;
  for (uint32_t j = i; j < end && k < TCP_BURST_IOV; j++, k++) {
    iov[k].iov_base = pool + chunks[j].local_off + skip;
    iov[k].iov_len = chunks[j].bytes - skip;
    sum += iov[k].iov_len;
    skip = 0;
  }
  if (bytes) *bytes = sum;
  return k;
}

/* Continues each chunk's checksum state over the `moved` bytes that just
 * landed from the cursor on: they are still in this core's cache, so the
 * READ needs no second pass over memory (pf_xfer.h, checksum groups). */
static void chunks_checksum(const uint8_t *pool, xfer_chunk *chunks, uint32_t i,
                            uint64_t in_chunk, uint64_t moved) {
  while (moved) {
    xfer_chunk *c = &chunks[i++];
    uint64_t n = c->bytes - in_chunk < moved ? c->bytes - in_chunk : moved;
    c->crc = pf_crc32c_raw(c->crc, pool + c->local_off + in_chunk, n);
    moved -= n;
    in_chunk = 0;
  }
}

/* Moves the cursor forward by `moved` bytes (what one sendmsg/recvmsg did). */
static void chunks_advance(const xfer_chunk *chunks, uint32_t *i, uint64_t *in_chunk,
                           uint64_t moved) {
  while (moved) {
    uint64_t room = chunks[*i].bytes - *in_chunk;
    if (moved < room) {
      *in_chunk += moved;
      moved = 0;
    } else {
      moved -= room;
      *in_chunk = 0;
      (*i)++;
    }
  }
}

/* Sends a WRITE part's payload from the pool, entering the slot per burst. */
static int send_payload(tcp_stream *st, xfer_slot *s, uint32_t gen, uint32_t first, uint32_t n) {
  tcp_peer *tp = st->p->impl;
  uint8_t *pool = st->p->ep->pool->host;
  uint32_t i = first, end = first + n;
  uint64_t in_chunk = 0;
  while (i < end) {
    /* Wait for room, but notice within a poll period when the batch ends
     * meanwhile (a frozen target never makes room): the frame cannot be
     * finished, so the stream is given up at once. */
    struct pollfd pfd = {.fd = st->fd, .events = POLLOUT};
    int r;
    while ((r = poll(&pfd, 1, TCP_POLL_MS)) == 0 || (r < 0 && errno == EINTR)) {
      if (atomic_load(&tp->stop)) return -2;
      if (!xfer_live(s, gen)) return -3;
    }
    if (r < 0) return -1;
    if (!xfer_enter(s, gen)) return -3;
    for (;;) {
      struct iovec iov[TCP_BURST_IOV];
      int k = chunks_burst(pool, s->chunks, i, end, in_chunk, iov, NULL);
      struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)k};
      ssize_t m = sendmsg(st->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (m < 0) {
        int e = errno;
        xfer_leave(s);
        if (e == EAGAIN || e == EWOULDBLOCK || e == EINTR) break;
        errno = e;
        return -1;
      }
      chunks_advance(s->chunks, &i, &in_chunk, (uint64_t)m);
      if (i == end || !xfer_live(s, gen)) {
        xfer_leave(s);
        break;
      }
    }
  }
  return 0;
}

static void *tx_main(void *arg) {
  pthread_setname_np(pthread_self(), "pf-tcp-tx");
  tcp_stream *st = arg;
  pf_xfer_peer *p = st->p;
  tcp_peer *tp = p->impl;
  for (;;) {
    pthread_mutex_lock(&st->mu);
    while (!st->qlen && !atomic_load(&tp->stop)) pthread_cond_wait(&st->cv, &st->mu);
    if (atomic_load(&tp->stop)) {
      pthread_mutex_unlock(&st->mu);
      break;
    }
    tx_item it = st->q[st->qhead];
    st->qhead = (st->qhead + 1) % st->qcap;
    st->qlen--;
    pthread_mutex_unlock(&st->mu);

    xfer_slot *s = &p->slots[it.slot];
    if (!xfer_enter(s, it.gen)) continue; /* ended before it was sent */
    pf_tcp_frame *f = (pf_tcp_frame *)st->frame;
    *f = (pf_tcp_frame){.magic = TCP_MAGIC, .slot = it.slot, .gen = it.gen, .part = it.part};
    uint32_t first = 0, n = 0;
    if (it.part == IMM_PART) {
      f->op = OP_IMM;
      f->aux = s->imm;
      f->bytes = s->bytes;
    } else {
      const xfer_part *pt = &s->parts[it.part];
      first = pt->first;
      n = pt->n;
      f->op = s->op == PF_XFER_READ ? OP_READ : OP_WRITE;
      f->nseg = n;
      f->bytes = s->op == PF_XFER_READ ? 0 : pt->bytes;
      wire_seg *ws = (wire_seg *)(f + 1);
      for (uint32_t j = 0; j < n; j++)
        ws[j] = (wire_seg){s->chunks[first + j].remote_off, s->chunks[first + j].bytes};
    }
    int is_write = f->op == OP_WRITE;
    xfer_leave(s);
    size_t len = sizeof *f + (size_t)n * sizeof(wire_seg);
    int r = send_all(st->fd, st->frame, len, &tp->stop);
    if (r == 0 && is_write) r = send_payload(st, s, it.gen, first, n);
    if (r == -2) break;
    if (r == -3) {
      stream_fail(st, "write payload", "its batch ended while the payload was being sent");
      break;
    }
    if (r < 0) {
      stream_fail(st, "send", strerror(errno));
      break;
    }
  }
  return NULL;
}

static void set_lowat(tcp_stream *st, int v) {
  if (st->lowat == v) return;
  setsockopt(st->fd, SOL_SOCKET, SO_RCVLOWAT, &v, sizeof v);
  st->lowat = v;
}

/* Receives a READ part's payload into the pool (or the scratch buffer once
 * the batch has ended). Returns 1 if every byte landed in a live batch, 0 if
 * some were discarded, <0 on stream errors. */
static int recv_payload(tcp_stream *st, xfer_slot *s, uint32_t gen, uint32_t part,
                        uint64_t total) {
  tcp_peer *tp = st->p->impl;
  pf_xfer_ep *ep = st->p->ep;
  uint8_t *pool = ep->pool->host;
  uint32_t i = 0, end = 0;
  int landed_all = 1, located = 0;
  uint64_t in_chunk = 0, left_total = total;
  /* Poll only once the socket looked drained (EAGAIN or a short read): a
   * wakeup then costs one poll and one recvmsg, like a blocking recv. */
  int drained = 0;
  while (left_total) {
    if (drained) {
      int want = left_total < TCP_RCVLOWAT ? (int)left_total : (int)TCP_RCVLOWAT;
      set_lowat(st, want);
      int r = wait_fd(st->fd, POLLIN, &tp->stop, 0);
      if (r == 0) return -2;
      if (r < 0) return -1;
      drained = 0;
    }
    if (landed_all && xfer_enter(s, gen)) {
      if (!located) {
        if (part >= s->nparts || s->parts[part].bytes != total) {
          xfer_leave(s);
          errno = EPROTO;
          return -1;
        }
        i = s->parts[part].first;
        end = i + s->parts[part].n;
        located = 1;
      }
      for (;;) {
        struct iovec iov[TCP_BURST_IOV];
        uint64_t want;
        int k = chunks_burst(pool, s->chunks, i, end, in_chunk, iov, &want);
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)k};
        ssize_t m = recvmsg(st->fd, &mh, MSG_DONTWAIT);
        if (m <= 0) {
          int e = m == 0 ? 0 : errno;
          xfer_leave(s);
          if (m < 0 && (e == EAGAIN || e == EWOULDBLOCK || e == EINTR)) {
            drained = 1;
            break;
          }
          errno = e;
          return -1;
        }
        left_total -= (uint64_t)m;
        if (s->ngroups) chunks_checksum(pool, s->chunks, i, in_chunk, (uint64_t)m);
        chunks_advance(s->chunks, &i, &in_chunk, (uint64_t)m);
        if ((uint64_t)m < want) drained = 1;
        if (!left_total || drained || !xfer_live(s, gen)) {
          xfer_leave(s);
          break;
        }
      }
    } else {
      /* The batch ended: what is left of this response is late. */
      landed_all = 0;
      size_t want = left_total < TCP_SCRATCH ? (size_t)left_total : TCP_SCRATCH;
      ssize_t m = recv(st->fd, st->scratch, want, MSG_DONTWAIT);
      if (m == 0) {
        errno = 0;
        return -1;
      }
      if (m < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
          drained = 1;
          continue;
        }
        return -1;
      }
      if ((size_t)m < want) drained = 1;
      left_total -= (uint64_t)m;
      atomic_fetch_add(&ep->late_bytes, (uint64_t)m);
    }
  }
  return landed_all;
}

static void on_ack(tcp_stream *st, const pf_tcp_frame *f) {
  pf_xfer_peer *p = st->p;
  xfer_slot *s = &p->slots[f->slot];
  if (f->status != PF_OK) {
    xfer_end(p, s, f->gen, f->status);
    return;
  }
  if (!xfer_enter(s, f->gen)) return; /* ended already */
  int imm = s->op == PF_XFER_WRITE_IMM;
  /* Counted before leaving: afterwards the slot may hold another batch
   * (xfer_part_done says why). */
  unsigned left = atomic_fetch_sub(&s->parts_left, 1) - 1;
  xfer_leave(s);
  if (left == 0) {
    xfer_end(p, s, f->gen, PF_OK);
  } else if (imm && left == 1 && f->part != IMM_PART) {
    /* Every data part landed at the target: now the immediate. */
    tcp_peer *tp = p->impl;
    if (enqueue(&tp->st[0], f->slot, f->gen, IMM_PART) < 0)
      xfer_end(p, s, f->gen, PF_ENOMEM);
  }
}

static void *rx_main(void *arg) {
  pthread_setname_np(pthread_self(), "pf-tcp-rx");
  tcp_stream *st = arg;
  pf_xfer_peer *p = st->p;
  tcp_peer *tp = p->impl;
  pf_tcp_frame f;
  for (;;) {
    int r = recv_all(st->fd, &f, sizeof f, &tp->stop, 0);
    if (r == -2) break;
    if (r < 0) {
      stream_fail(st, "receive", eof_text());
      break;
    }
    if (f.magic != TCP_MAGIC || f.slot >= PF_XFER_MAX_INFLIGHT ||
        (f.op != OP_ACK && f.op != OP_READ_RESP)) {
      stream_fail(st, "receive", "malformed frame from the server");
      break;
    }
    xfer_slot *s = &p->slots[f.slot];
    if (f.op == OP_ACK) {
      on_ack(st, &f);
      continue;
    }
    if (f.status != PF_OK) {
      xfer_end(p, s, f.gen, f.status);
      continue;
    }
    r = recv_payload(st, s, f.gen, f.part, f.bytes);
    set_lowat(st, 1); /* frame headers are 40 bytes */
    if (r == -2) break;
    if (r < 0) {
      stream_fail(st, "read payload", errno == EPROTO ? "response does not match its request"
                                                      : eof_text());
      break;
    }
    if (r == 1) xfer_part_done(p, s, f.gen);
  }
  return NULL;
}

static int32_t tcp_peer_create(pf_xfer_peer *p) {
  tcp_peer *tp = calloc(1, sizeof *tp);
  if (!tp) return pf_fail(PF_ENOMEM, "pf_xfer_peer_create: out of memory");
  p->impl = tp;
  return PF_OK;
}

static int32_t tcp_peer_info(pf_xfer_peer *p, uint8_t *buf, uint32_t cap) {
  pf_xfer_ep *ep = p->ep;
  char text[128];
  const char *host = ep->cfg.bind_addr[0] ? ep->cfg.bind_addr : "0.0.0.0";
  int v6 = strchr(host, ':') != NULL;
  int n = snprintf(text, sizeof text, v6 ? "[%s]:%u" : "%s:%u", host, ep->listen_port);
  if (buf && cap) memcpy(buf, text, (size_t)n < cap ? (size_t)n : cap);
  return n;
}

static void stream_stop_all(pf_xfer_peer *p) {
  tcp_peer *tp = p->impl;
  atomic_store(&tp->stop, 1);
  for (uint32_t i = 0; i < tp->n; i++) {
    tcp_stream *st = &tp->st[i];
    pthread_mutex_lock(&st->mu);
    pthread_cond_broadcast(&st->cv);
    pthread_mutex_unlock(&st->mu);
  }
  for (uint32_t i = 0; i < tp->n; i++) {
    tcp_stream *st = &tp->st[i];
    if (st->started) {
      pthread_join(st->tx, NULL);
      pthread_join(st->rx, NULL);
      st->started = 0;
    }
  }
}

/* Why stream `i`'s hello was not answered with a hello (got: recv_all's
 * result; errno set by it): the endpoint refused the connection (its REFUSE
 * frame), closed it first (a refusal whose frame was lost, or not a PegaFlow
 * endpoint), or answered something else. */
static int32_t hello_refused(const char *fn, uint32_t i, const char *remote, int got,
                             const pf_tcp_frame *ans) {
  if (got < 0)
    return pf_fail(PF_EIO, "%s: stream %u to %s: the endpoint closed the connection before "
                   "its hello (%s): over its connection cap, out of descriptors, or not a "
                   "PegaFlow transfer endpoint", fn, i, remote, eof_text());
  if (ans->magic == TCP_MAGIC && ans->op == OP_REFUSE && ans->status == PF_EBUSY)
    return pf_fail(PF_EBUSY, "%s: stream %u to %s: refused: the endpoint serves %llu "
                   "connections, its cap (PEGAFLOW_TCP_MAX_CONNS there) is %u", fn, i, remote,
                   (unsigned long long)ans->bytes, ans->aux);
  if (ans->magic == TCP_MAGIC && ans->op == OP_REFUSE)
    return pf_fail(PF_EIO, "%s: stream %u to %s: refused: the endpoint is out of file "
                   "descriptors, memory or threads (status %d)", fn, i, remote, ans->status);
  return pf_fail(PF_EIO, "%s: stream %u to %s: not a PegaFlow transfer endpoint (or "
                 "protocol version differs from %u)", fn, i, remote, TCP_VERSION);
}

static int32_t tcp_peer_connect(pf_xfer_peer *p, const uint8_t *remote, uint32_t len,
                                int32_t timeout_ms) {
  const char *fn = "pf_xfer_peer_connect(tcp)";
  tcp_peer *tp = p->impl;
  pf_xfer_ep *ep = p->ep;
  if (len >= sizeof tp->remote)
    return pf_fail(PF_EINVAL, "%s: remote address of %u bytes is too long", fn, len);
  memcpy(tp->remote, remote, len);
  tp->remote[len] = 0;
  struct sockaddr_storage ss;
  socklen_t sl;
  int32_t rc = parse_hostport(fn, tp->remote, &ss, &sl);
  if (rc < 0) return rc;
  uint32_t n = ep->cfg.streams;
  tp->st = calloc(n, sizeof *tp->st);
  if (!tp->st) return pf_fail(PF_ENOMEM, "%s: out of memory", fn);
  tp->n = n;
  uint64_t remote_bytes = 0;
  uint64_t deadline = pf_now_ns() + (uint64_t)timeout_ms * 1000000ull;
  for (uint32_t i = 0; i < n; i++) {
    tcp_stream *st = &tp->st[i];
    st->p = p;
    st->idx = i;
    st->fd = -1;
    st->lowat = 1;
    pthread_mutex_init(&st->mu, NULL);
    pthread_cond_init(&st->cv, NULL);
  }
  /* A close of the peer meanwhile (pf_xfer_peer_close sets `closing`, then
   * waits for this call) ends every wait below within TCP_POLL_MS. */
  atomic_int *closing = &p->closing;
  for (uint32_t i = 0; i < n; i++) {
    tcp_stream *st = &tp->st[i];
    rc = connect_to(fn, &ss, sl, ep->cfg.sock_buf, deadline, closing, tp->remote, &st->fd);
    if (rc == PF_ETIMEDOUT)
      rc = pf_fail(PF_ETIMEDOUT, "%s: stream %u to %s: no connection within %d ms", fn, i,
                   tp->remote, timeout_ms);
    if (rc == PF_ESHUTDOWN)
      rc = pf_fail(PF_ESHUTDOWN, "%s: peer %u was closed while stream %u connected to %s", fn,
                   p->handle, i, tp->remote);
    if (rc < 0) goto fail;
    pf_tcp_frame hello = {.magic = TCP_MAGIC, .op = OP_HELLO, .part = i, .aux = TCP_VERSION};
    pf_tcp_frame ans;
    int sent = send_all(st->fd, &hello, sizeof hello, closing);
    /* The whole answer by the deadline: a listener that is not a PegaFlow
     * endpoint may send part of a frame and then nothing. */
    int got = sent < 0 ? sent : recv_all(st->fd, &ans, sizeof ans, closing, deadline);
    if (got == -2) {
      rc = pf_fail(PF_ESHUTDOWN, "%s: peer %u was closed while stream %u to %s waited for "
                   "its hello", fn, p->handle, i, tp->remote);
      goto fail;
    }
    if (sent < 0) {
      rc = pf_fail(PF_EIO, "%s: stream %u to %s: hello: %s", fn, i, tp->remote, strerror(errno));
      goto fail;
    }
    if (got == -3) {
      rc = pf_fail(PF_ETIMEDOUT, "%s: stream %u to %s: no hello within %d ms", fn, i,
                   tp->remote, timeout_ms);
      goto fail;
    }
    if (got < 0 || ans.magic != TCP_MAGIC || ans.op != OP_HELLO || ans.aux != TCP_VERSION) {
      rc = hello_refused(fn, i, tp->remote, got, &ans);
      goto fail;
    }
    if (i > 0 && ans.bytes != remote_bytes) {
      rc = pf_fail(PF_EIO, "%s: stream %u to %s reports a pool of %llu bytes; stream 0 "
                   "reported %llu", fn, i, tp->remote, (unsigned long long)ans.bytes,
                   (unsigned long long)remote_bytes);
      goto fail;
    }
    remote_bytes = ans.bytes;
    st->frame = malloc(sizeof(pf_tcp_frame) + TCP_MAX_FRAME_SEGS * sizeof(wire_seg));
    st->scratch = malloc(TCP_SCRATCH);
    if (!st->frame || !st->scratch) {
      rc = pf_fail(PF_ENOMEM, "%s: out of memory", fn);
      goto fail;
    }
  }
  p->remote_bytes = remote_bytes;
  p->lanes = n;
  for (uint32_t i = 0; i < n; i++) {
    tcp_stream *st = &tp->st[i];
    if (pthread_create(&st->tx, NULL, tx_main, st)) {
      rc = pf_fail(PF_ENOMEM, "%s: cannot start stream threads", fn);
      goto fail;
    }
    if (pthread_create(&st->rx, NULL, rx_main, st)) {
      atomic_store(&tp->stop, 1);
      pthread_mutex_lock(&st->mu);
      pthread_cond_broadcast(&st->cv);
      pthread_mutex_unlock(&st->mu);
      pthread_join(st->tx, NULL);
      rc = pf_fail(PF_ENOMEM, "%s: cannot start stream threads", fn);
      goto fail;
    }
    st->started = 1;
  }
  return PF_OK;
fail:
  stream_stop_all(p);
  atomic_store(&tp->stop, 0);
  for (uint32_t i = 0; i < n; i++) {
    tcp_stream *st = &tp->st[i];
    if (st->fd >= 0) close(st->fd);
    free(st->frame);
    free(st->scratch);
    pthread_cond_destroy(&st->cv);
    pthread_mutex_destroy(&st->mu);
  }
  free(tp->st);
  tp->st = NULL;
  tp->n = 0;
  return rc;
}

static void tcp_peer_shutdown(pf_xfer_peer *p) {
  tcp_peer *tp = p->impl;
  for (uint32_t i = 0; i < tp->n; i++)
    if (tp->st[i].fd >= 0) shutdown(tp->st[i].fd, SHUT_RDWR);
  stream_stop_all(p);
}

static void tcp_peer_free(pf_xfer_peer *p) {
  tcp_peer *tp = p->impl;
  if (!tp) return;
  for (uint32_t i = 0; i < tp->n; i++) {
    tcp_stream *st = &tp->st[i];
    if (st->fd >= 0) close(st->fd);
    free(st->q);
    free(st->frame);
    free(st->scratch);
    pthread_cond_destroy(&st->cv);
    pthread_mutex_destroy(&st->mu);
  }
  free(tp->st);
  free(tp);
  p->impl = NULL;
}

static int32_t tcp_submit(pf_xfer_peer *p, xfer_slot *s) {
  tcp_peer *tp = p->impl;
  for (uint32_t i = 0; i < s->nparts; i++) {
    int32_t rc = enqueue(&tp->st[s->parts[i].lane], s->index, s->gen, i);
    if (rc < 0) return rc;
  }
  return PF_OK;
}

const xfer_ops pf_tcp_ops = {
    .name = "tcp",
    .open = tcp_open,
    .close = tcp_close,
    .peer_create = tcp_peer_create,
    .peer_info = tcp_peer_info,
    .peer_connect = tcp_peer_connect,
    .peer_shutdown = tcp_peer_shutdown,
    .peer_free = tcp_peer_free,
    .submit = tcp_submit,
    .expire = NULL,
    .max_part_chunks = TCP_MAX_FRAME_SEGS,
    .crc_on_receive = 1,
};

/* ---- raw throughput (benchmarks) ---------------------------------------- */
/* Longest blast deadline: a batch's (pf_xfer.c's XFER_MAX_TIMEOUT_MS). */
#define BLAST_MAX_TIMEOUT_MS 3600000u
/* A blast's blocking recv gives up this often to look at its deadline
 * (SO_RCVTIMEO): the receive stays iperf's plain blocking recv. */
#define BLAST_WAKE_MS TCP_POLL_MS

typedef struct blast_arg {
  struct sockaddr_storage ss;
  socklen_t sl;
  uint64_t bytes;
  uint8_t *buf;
  uint64_t span;
  uint64_t deadline; /* pf_now_ns clock */
  uint32_t timeout_ms;
  uint32_t flags;
  uint32_t stream;
  uint32_t sock_buf;
  int32_t rc;
  char err[256];
} blast_arg;

/* Receives a stream's bytes with plain blocking recv, as iperf does, by
 * the deadline; returns the bytes still missing (errno 0 at EOF). */
static uint64_t blast_recv(blast_arg *a, int fd, int *timed_out) {
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  struct timeval tv = {.tv_sec = 0, .tv_usec = BLAST_WAKE_MS * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  uint64_t left = a->bytes, at = 0;
  while (left) {
    if (pf_now_ns() >= a->deadline) {
      *timed_out = 1;
      break;
    }
    uint64_t room = a->span - at;
    ssize_t m = recv(fd, a->buf + at, left < room ? left : room, 0);
    if (m > 0) {
      left -= (uint64_t)m;
      at = (at + (uint64_t)m) % a->span;
      continue;
    }
    if (m < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
    if (m == 0) errno = 0;
    break;
  }
  return left;
}

static void *blast_main(void *arg) {
  pthread_setname_np(pthread_self(), "pf-tcp-blast");
  blast_arg *a = arg;
  int fd;
  int32_t rc = connect_to("pf_tcp_blast", &a->ss, a->sl, a->sock_buf, a->deadline, NULL,
                          "blast", &fd);
  if (rc < 0) {
    a->rc = rc;
    pf_last_error(a->err, sizeof a->err);
    return NULL;
  }
  pf_tcp_frame f = {.magic = TCP_MAGIC, .op = OP_BLAST, .bytes = a->bytes, .aux = a->flags,
                    .part = a->stream};
  /* 40 bytes into a fresh socket's empty buffer: never waits. */
  if (send_all(fd, &f, sizeof f, NULL) < 0) {
    a->rc = PF_EIO;
    snprintf(a->err, sizeof a->err, "sending its request: %s", strerror(errno));
    close(fd);
    return NULL;
  }
  int timed_out = 0;
  uint64_t left = blast_recv(a, fd, &timed_out);
  if (timed_out) {
    a->rc = PF_ETIMEDOUT;
    snprintf(a->err, sizeof a->err, "%llu of %llu bytes still missing at its %u ms deadline "
             "(the sender stalled or is not a PegaFlow transfer listener)",
             (unsigned long long)left, (unsigned long long)a->bytes, a->timeout_ms);
  } else if (left) {
    a->rc = PF_EIO;
    snprintf(a->err, sizeof a->err, "stream ended with %llu of %llu bytes missing: %s",
             (unsigned long long)left, (unsigned long long)a->bytes, eof_text());
  }
  close(fd);
  return NULL;
}

static int32_t blast_run(const char *addr, uint32_t streams, uint64_t bytes_per_stream,
                         uint32_t pool, uint32_t sock_buf, uint32_t timeout_ms,
                         uint64_t *out_ns) {
  if (!addr || !out_ns) return pf_fail(PF_EINVAL, "pf_tcp_blast: addr or out_ns is NULL");
  if (streams == 0 || streams > 64 || bytes_per_stream == 0)
    return pf_fail(PF_EINVAL, "pf_tcp_blast: streams %u (1..64) and bytes %llu (> 0)", streams,
                   (unsigned long long)bytes_per_stream);
  if (timeout_ms == 0 || timeout_ms > BLAST_MAX_TIMEOUT_MS)
    return pf_fail(PF_EINVAL, "pf_tcp_blast: timeout_ms %u; expected 1..%u", timeout_ms,
                   BLAST_MAX_TIMEOUT_MS);
  struct sockaddr_storage ss;
  socklen_t sl;
  int32_t rc = parse_hostport("pf_tcp_blast", addr, &ss, &sl);
  if (rc < 0) return rc;
  pf_pool *p = NULL;
  if (pool) {
    pthread_mutex_lock(&pf_objects_mu);
    p = pf_handle_get(pool, PF_K_POOL, "pf_tcp_blast(pool)");
    if (p) atomic_fetch_add(&p->inflight, 1);
    pthread_mutex_unlock(&pf_objects_mu);
    if (!p) return PF_EHANDLE;
  }
  blast_arg *a = calloc(streams, sizeof *a);
  pthread_t *th = calloc(streams, sizeof *th);
  uint8_t *own = p ? NULL : malloc((size_t)streams * BLAST_BUF);
  if (!a || !th || (!p && !own)) {
    rc = pf_fail(PF_ENOMEM, "pf_tcp_blast: out of memory");
    goto out;
  }
  /* With a pool, stream i fills its own slice of it: the memory a transfer
   * lands in. Without, 1 MiB per stream, as iperf does. */
  uint64_t slice = p ? p->bytes / streams : BLAST_BUF;
  uint64_t span = slice < bytes_per_stream ? slice : bytes_per_stream;
  if (span == 0) {
    rc = pf_fail(PF_EINVAL, "pf_tcp_blast: pool too small for %u streams", streams);
    goto out;
  }
  uint64_t t0 = pf_now_ns();
  uint64_t deadline = t0 + (uint64_t)timeout_ms * 1000000ull;
  for (uint32_t i = 0; i < streams; i++) {
    a[i] = (blast_arg){.ss = ss, .sl = sl, .bytes = bytes_per_stream, .sock_buf = sock_buf,
                       .span = span, .flags = p ? PF_BLAST_WIDE : 0, .stream = i,
                       .deadline = deadline, .timeout_ms = timeout_ms,
                       .buf = p ? p->host + i * slice : own + (size_t)i * BLAST_BUF};
  }
  uint32_t started = 0;
  for (uint32_t i = 0; i < streams; i++) {
    if (pthread_create(&th[i], NULL, blast_main, &a[i])) break;
    started++;
  }
  for (uint32_t i = 0; i < started; i++) pthread_join(th[i], NULL);
  *out_ns = pf_now_ns() - t0;
  rc = started == streams ? PF_OK : pf_fail(PF_ENOMEM, "pf_tcp_blast: cannot start threads");
  for (uint32_t i = 0; i < started && rc == PF_OK; i++)
    if (a[i].rc) rc = pf_fail(a[i].rc, "pf_tcp_blast: stream %u to %s: %s", i, addr, a[i].err);
out:
  if (p) atomic_fetch_sub(&p->inflight, 1);
  free(own);
  free(a);
  free(th);
  return rc;
}

int32_t pf_tcp_blast(const char *addr, uint32_t streams, uint64_t bytes_per_stream,
                     uint32_t pool, uint32_t sock_buf, uint32_t timeout_ms, uint64_t *out_ns,
                     char *err, uint32_t err_cap) {
  return pf_error_out(blast_run(addr, streams, bytes_per_stream, pool, sock_buf, timeout_ms,
                                out_ns),
                      err, err_cap);
}
