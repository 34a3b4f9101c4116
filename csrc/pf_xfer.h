/*
 * pf_xfer.h — the cross-node transfer layer's ABI (included by pegaflow.h;
 * same conventions: i32 status, u32 handles, batches only).
 *
 * One contract for every transport. An *endpoint* registers this node's
 * pinned pool with a transport (TCP or RDMA verbs) and posts completions to
 * an existing completion ring. A *peer* is this endpoint's connection to one
 * remote endpoint; batches of one-sided operations are submitted on a peer:
 *
 *   READ       remote pool -> local pool   (the peer-fetch tier)
 *   WRITE      local pool  -> remote pool  (layer-wise push)
 *   WRITE_IMM  WRITE, then a 32-bit immediate delivered to the target as a
 *              PF_DONE_XFER_IMM record once every byte of the batch is in
 *              place in the target's pool
 *
 * Every segment is bounds-checked against the local pool and against the
 * remote pool's size (learned at connect) before anything moves; the side
 * that serves a READ or lands a WRITE checks its own bounds again, so a buggy
 * or malicious peer gets PF_ERANGE, never a wild read or write.
 *
 * Deadlines: each batch carries a timeout. A batch that has not completed by
 * then fails with PF_ETIMEDOUT, and from the moment its record is posted no
 * byte of it is written into the local pool any more (TCP: late data is
 * recognised by its (slot, generation) and discarded; RDMA: the peer's QPs are
 * moved to the error state and the record waits for the flush). The caller may
 * free or reuse the batch's pool ranges as soon as it sees the record.
 *
 * Connecting, for both transports: A = pf_xfer_peer_create(ep); the bytes of
 * pf_xfer_peer_info(A) travel to the remote node in the policy layer's
 * handshake; pf_xfer_peer_connect(A, remote_bytes) completes it.
 *   TCP:  info = "host:port" of the endpoint's listener (text); the remote
 *         side serves every connection on its listener, it needs no peer.
 *   RDMA: info = this peer's QP numbers, PSNs, LIDs/GIDs, rkeys and pool
 *         address (pf_rdma_info below); both sides create a peer and connect
 *         it with the other's info (RC QPs are point to point).
 */
#ifndef PF_XFER_H
#define PF_XFER_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum pf_xfer_transport { PF_XFER_TCP = 1, PF_XFER_RDMA = 2 };
enum pf_xfer_op { PF_XFER_READ = 0, PF_XFER_WRITE = 1, PF_XFER_WRITE_IMM = 2 };

/* Completion kinds of the transfer layer (pf_completion.kind). 8.. so that
 * kinds added to pegaflow.h's list (5, 6, 7) never collide with these. */
enum pf_xfer_completion_kind {
  /* A transfer batch ended (one per batch, always). tag = the submit's tag,
   * index = pf_xfer_op, status = PF_OK / PF_ERANGE (the serving side refused
   * a segment) / PF_ETIMEDOUT / PF_EIO (connection lost) / PF_ESHUTDOWN
   * (peer closed), aux = wire parts (TCP frames / RDMA work requests) the
   * batch was split into, value = ns from submit to end. */
  PF_DONE_XFER = 8,
  /* On the target of a WRITE_IMM, after the batch's bytes are in its pool:
   * tag = the endpoint's imm_tag, index = the serving connection's id (TCP)
   * or peer handle (RDMA), aux = the immediate, value = the batch's bytes as
   * the sender declared them (TCP) or 0 (RDMA). */
  PF_DONE_XFER_IMM = 9,
};

/* Endpoint configuration (pf_xfer_open copies it). */
typedef struct pf_xfer_config {
  uint32_t transport;    /* pf_xfer_transport */
  uint32_t streams;      /* TCP sockets per peer / RDMA QPs per NIC per peer,
                            1..64 */
  uint32_t sock_buf;     /* TCP SO_SNDBUF/SO_RCVBUF bytes; 0 = leave the
                            kernel's autotuning on (it grows to the
                            tcp_rmem/tcp_wmem maximum, which a fixed size
                            would cap at rmem_max/wmem_max) */
  uint32_t stripe_bytes; /* a segment longer than this is cut into pieces
                            spread over the streams (0 = 1 MiB; >= 4 KiB) */
  uint64_t imm_tag;      /* tag of PF_DONE_XFER_IMM records */
  uint32_t port;         /* TCP listen port (0 = any free port) */
  uint32_t flags;        /* reserved, 0 */
  char bind_addr[64];    /* TCP listen address, IPv4/IPv6 literal
                            ("" = 0.0.0.0) */
  char nics[256];        /* RDMA: comma-separated device names, optionally
                            "name:port" ("" = every device found) */
} pf_xfer_config;

/* Opens an endpoint over `pool`, posting to `ring`. TCP: binds and starts
 * listening and serving (READs from the pool, WRITEs into it). RDMA: loads
 * libibverbs.so.1 (dlopen; env PEGAFLOW_LIBIBVERBS overrides the name),
 * opens the NICs, registers the pool on each (LOCAL_WRITE | REMOTE_READ |
 * REMOTE_WRITE) and starts the CQ poller; PF_ENODEV with a message naming
 * what is missing (the library, any device, a listed NIC). The pool and ring
 * count the endpoint as a user until pf_xfer_close. */
int32_t pf_xfer_open(uint32_t pool, uint32_t ring, const pf_xfer_config *cfg,
                     uint64_t cfg_bytes, uint32_t *out_ep);
/* What pf_xfer_info reports (96 bytes). */
typedef struct pf_xfer_stats {
  uint32_t transport;   /* offset 0: pf_xfer_transport */
  uint32_t listen_port; /* offset 4: TCP listen port (0 for RDMA) */
  uint32_t streams;     /* offset 8 */
  uint32_t peers;       /* offset 12: peers open */
  uint64_t submitted;   /* offset 16: batches submitted */
  uint64_t ok;          /* offset 24: batches ended ok */
  uint64_t failed;      /* offset 32 */
  uint64_t timed_out;   /* offset 40 */
  /* offset 48: TCP: bytes of timed-out or cancelled batches that arrived
   * and were dropped. */
  uint64_t late_bytes;
  uint64_t serving_connections; /* offset 56: TCP connections served */
  uint64_t bytes_served; /* offset 64: READ payload sent to peers */
  uint64_t bytes_landed; /* offset 72: bytes peers' WRITEs landed here */
  /* offset 80: TCP connections accepted and refused at once (a REFUSE frame,
   * then close): over the cap (PEGAFLOW_TCP_MAX_CONNS), or out of
   * descriptors, memory or threads to serve them. */
  uint64_t conns_refused;
  /* offset 88: TCP accepts that failed (out of descriptors or kernel memory;
   * transient network errors of one pending connection are not counted). */
  uint64_t accept_errors;
} pf_xfer_stats;
int32_t pf_xfer_info(uint32_t ep, pf_xfer_stats *out);
/* Stops listening, closes serving connections, releases the pool and ring.
 * PF_EBUSY while peers are open. Blocks until its threads exit. */
int32_t pf_xfer_close(uint32_t ep);

/* Creates an unconnected peer on `ep` (RDMA: its QPs, in INIT). */
int32_t pf_xfer_peer_create(uint32_t ep, uint32_t *out_peer);
/* Copies the bytes to hand to the remote side into buf (cap bytes); returns
 * the full length (call with cap 0 to size). */
int32_t pf_xfer_peer_info(uint32_t peer, uint8_t *buf, uint32_t cap);
/* Connects `peer` to the remote described by remote[0..len) (see above);
 * waits at most timeout_ms. On return the remote pool's size is known and
 * submits are bounds-checked against it. */
int32_t pf_xfer_peer_connect(uint32_t peer, const uint8_t *remote, uint32_t len,
                             int32_t timeout_ms);
/* What pf_xfer_peer_state reports (24 bytes). */
typedef struct pf_xfer_peer_status {
  uint32_t connected;    /* offset 0: 1 once connected */
  uint32_t inflight;     /* offset 4: batches in flight */
  uint64_t remote_bytes; /* offset 8: the remote pool's size */
  int32_t broken;        /* offset 16: the PF_E* that broke it, 0 = none */
  uint32_t reserved;
} pf_xfer_peer_status;
int32_t pf_xfer_peer_state(uint32_t peer, pf_xfer_peer_status *out);
/* Copies the text of the peer's last failure (a failed connect, or what
 * broke it) into buf; returns the full length (0 = none). For callers whose
 * pf_xfer_peer_connect ran on another thread (pf_last_error is per thread). */
int32_t pf_xfer_peer_error(uint32_t peer, char *buf, uint32_t cap);
/* Fails every batch in flight with PF_ESHUTDOWN (their records are posted
 * before this returns and none writes into the pool afterwards), closes the
 * connection and frees the peer. */
int32_t pf_xfer_peer_close(uint32_t peer);

/*
 * A transfer batch lives in one caller-owned buffer (copied before
 * pf_xfer_submit returns):
 *
 *   pf_xfer_header                    (24 bytes)
 *   pf_xfer_seg  segs[num_segs]       (24 bytes each)
 *   uint64_t     group_bytes[num_groups]  (READ with checksums only)
 *
 * READ moves remote_off -> local_off; WRITE/WRITE_IMM local_off ->
 * remote_off. Segments need not be sorted; adjacent ones are merged and long
 * ones striped over the peer's streams/QPs.
 *
 * Checksum groups (READ only): the batch's payload, in segment order, is cut
 * into num_groups runs of group_bytes[g] bytes (each > 0, summing to the
 * segments' bytes); out_crcs[g] receives the CRC32C (pf_crc32c) of run g's
 * bytes as they landed in the local pool, written before the batch's
 * PF_DONE_XFER record is posted and only when its status is PF_OK. TCP
 * computes it on the receiving thread as each burst lands (the bytes are
 * still in cache; no second pass over memory); RDMA in one pass before the
 * record. Runs never merge across a group boundary, so each wire chunk lies
 * in one group and the per-chunk checksums are combined in order.
 */
typedef struct pf_xfer_header {
  uint32_t op;         /* pf_xfer_op */
  uint32_t num_segs;   /* 1 .. PF_XFER_MAX_SEGS */
  uint32_t timeout_ms; /* 1 .. 3,600,000 */
  uint32_t imm;        /* WRITE_IMM: the immediate; else 0 */
  uint32_t num_groups; /* READ: checksum groups, 0 .. PF_XFER_MAX_SEGS (0 = none) */
  uint32_t reserved;   /* 0 */
} pf_xfer_header;

typedef struct pf_xfer_seg {
  uint64_t remote_off; /* byte offset in the remote pool */
  uint64_t local_off;  /* byte offset in the local pool */
  uint64_t bytes;      /* > 0 */
} pf_xfer_seg;

#define PF_XFER_MAX_SEGS (1u << 20)
/* Batches in flight per peer; the next submit fails with PF_EOVERFLOW. */
#define PF_XFER_MAX_INFLIGHT 256u

/* Validates and queues a batch; returns 0 once queued (never blocks on the
 * network, nor on ring room: it runs on the JS thread, the ring's consumer).
 * Exactly one PF_DONE_XFER record with `tag` follows a 0; an error means no
 * record, also for a batch the call armed and then took back (the peer broke
 * or began closing meanwhile, the transport could not queue it). out_crcs:
 * num_groups u32, NULL when num_groups is 0; the caller keeps it valid and
 * untouched until the record (it is written from a transport thread). */
int32_t pf_xfer_submit(uint32_t peer, const void *desc, uint64_t desc_bytes,
                       uint64_t tag, uint32_t *out_crcs);

/* The raw TCP throughput of a path, for benchmarks (what iperf measures):
 * opens `streams` plain connections to the TCP endpoint at host:port `addr`,
 * asks its listener to send `bytes_per_stream` unframed bytes on each, and
 * receives them with blocking recv (no framing, no bounds checks). pool = 0:
 * both ends cycle over 1 MiB per stream (cache-resident, as iperf does).
 * pool = a pool handle: stream i receives into its own 1/streams slice of
 * that pool and the server sends stream i's bytes from its own pool at
 * offset i * bytes_per_stream, wrapping at the end (PF_BLAST_WIDE): every
 * stream moves distinct memory, as a real transfer does.
 * Deadline: every stream must have connected and received all its bytes
 * within timeout_ms (1 .. 3,600,000, a batch's range) of the call, else
 * PF_ETIMEDOUT naming the stream and the bytes missing (a sender that
 * stalls, or a listener that never answers, cannot hang it).
 * Synchronous (declare it nonblocking in FFI); out_ns = first connect to
 * last byte. On failure the text goes to err (err_cap bytes, NUL-ended;
 * NULL/0 = none), as pf_last_error belongs to the thread that ran it. */
enum pf_blast_flags { PF_BLAST_WIDE = 1u << 0 };
int32_t pf_tcp_blast(const char *addr, uint32_t streams, uint64_t bytes_per_stream,
                     uint32_t pool, uint32_t sock_buf, uint32_t timeout_ms, uint64_t *out_ns,
                     char *err, uint32_t err_cap);

/* RDMA only: the NICs libibverbs reports, as "name,name,..." into buf;
 * returns the full length. PF_ENODEV when the library cannot be loaded. */
int32_t pf_rdma_devices(char *buf, uint32_t cap);

#ifdef __cplusplus
}
#endif
#endif /* PF_XFER_H */
