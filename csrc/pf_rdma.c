/*
 * pf_rdma.c — the transfer contract over RDMA verbs (RC QPs, one-sided
 * READ / WRITE / WRITE_WITH_IMM).
 *
 * STATUS: the data path has NOT yet run on RDMA hardware (no machine we have
 * has a device and Soft-RoCE cannot be loaded there). What runs in tests:
 * loading libibverbs.so.1, the device list, the errors for a missing library
 * / no device / an unknown NIC, parameter validation; and the whole data
 * path over tests/xfer/fake_ibverbs.c, a software stand-in for the library.
 *
 * No link-time dependency: libibverbs.so.1 is dlopen'ed (name overridable
 * with PEGAFLOW_LIBIBVERBS) and the few structures used are declared below,
 * mirroring rdma-core's <infiniband/verbs.h> of release v44 (Debian bookworm
 * libibverbs-dev 44.0-2; these layouts are ABI-stable since rdma-core v13,
 * symbol version IBVERBS_1.1). ibv_post_send / ibv_post_recv / ibv_poll_cq
 * are inline functions in verbs.h that call through ibv_context.ops, so the
 * context and its ops table are declared in full.
 *
 * Shape: an endpoint opens each NIC of --nics (every device when empty),
 * allocates a PD and registers the whole pool (LOCAL_WRITE | REMOTE_READ |
 * REMOTE_WRITE); one poller thread drains the CQs and posts ring records. A
 * peer has `streams` RC QPs per NIC and one CQ per NIC for them, sized so
 * that it can never overrun (see RDMA_QP_CQES); a batch's parts (pf_xfer.c
 * plans them) go one per QP as a chain of work requests with one sge each,
 * only the last one signaled. A QP whose send queue is full keeps further
 * parts in a backlog that the poller posts as credit returns.
 *
 * CQ sizing: a CQ that overruns is lost (async event IBV_EVENT_CQ_ERR; its
 * completions, flushes included, never come, so batches never end), and in
 * the error state every send WR and every posted receive completes, one
 * completion each. Before, the NIC's one CQ of 4096 entries was shared by
 * every peer's QPs (each up to 1024 sends + 128 receives): two peers of two
 * QPs whose full send queues flushed together overran it. Now each peer
 * brings its own CQ per NIC of exactly what its QPs there can have
 * outstanding, so no traffic can overrun it and no post needs admission; a
 * peer the device cannot give such a CQ (max_cqe) is refused at create.
 * The poller polls the CQs of the live peers (a list it copies when it
 * changes), and a CQ's completions are of one peer: no lookup across peers.
 * A CQ whose poll fails all the same (a device error) is lost with its
 * completions: the poller breaks its peer, destroys the peer's QPs and ends
 * its batches at once (cq_lost).
 *
 * Deadlines: RDMA work cannot be cancelled one request at a time; a posted
 * READ may land at any moment until the QP stops. So a batch that times out
 * moves every QP of its peer to the error state, and its record is posted
 * only when the completion of the last WR of every chain it posted has been
 * polled: after that the NIC no longer writes into its ranges (the fix for
 * the original system's #403, where a timed-out transfer wrote into freed
 * memory). Only a chain's last WR is signaled, but a flushed or failed WR
 * completes whether signaled or not, one completion each, in order: so a
 * chain ends with its last WR's completion, whatever its status, and the
 * others only record a failure. The peer is then broken and must be
 * reconnected; parts still in a backlog are dropped and their batches end
 * at once with the peer's failure.
 *
 * Who ends a batch: the poller (its completions), the timer (a deadline
 * with nothing posted) or a peer close; never the submit on the JS thread,
 * the ring's only consumer (a record posted there waits for ever on a full
 * ring). A submit that cannot post a part moves the QPs to the error state
 * and, if nothing of the batch is left on the wire, hands the batch back
 * with the error (no record); otherwise it is accepted and the poller ends
 * it with the flush of its last posted chain. WRITE_IMM: once
 * every data part has completed, a zero-length WRITE_WITH_IMM goes on the
 * first QP; the target's poller turns its receive completion into a
 * PF_DONE_XFER_IMM record (RC delivers it after the data of that QP, and the
 * data of the other QPs had completed before it was posted).
 */
#define _GNU_SOURCE
#include "pf_xfer_internal.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pf_verbs.h" /* the ibverbs declarations used (no libibverbs-dev needed) */

/* ---- the library, loaded at run time ---------------------------------- */
static struct {
  void *h;
  char name[256];
  struct ibv_device **(*get_device_list)(int *num);
  void (*free_device_list)(struct ibv_device **list);
  const char *(*get_device_name)(struct ibv_device *dev);
  struct ibv_context *(*open_device)(struct ibv_device *dev);
  int (*close_device)(struct ibv_context *ctx);
  int (*query_port)(struct ibv_context *ctx, uint8_t port, struct ibv_port_attr *attr);
  int (*query_gid)(struct ibv_context *ctx, uint8_t port, int index, union ibv_gid *gid);
  struct ibv_pd *(*alloc_pd)(struct ibv_context *ctx);
  int (*dealloc_pd)(struct ibv_pd *pd);
  struct ibv_mr *(*reg_mr)(struct ibv_pd *pd, void *addr, size_t len, int access);
  int (*dereg_mr)(struct ibv_mr *mr);
  struct ibv_cq *(*create_cq)(struct ibv_context *ctx, int cqe, void *cq_ctx,
                              struct ibv_comp_channel *ch, int vec);
  int (*destroy_cq)(struct ibv_cq *cq);
  struct ibv_qp *(*create_qp)(struct ibv_pd *pd, struct ibv_qp_init_attr *attr);
  int (*modify_qp)(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask);
  int (*destroy_qp)(struct ibv_qp *qp);
} ibv;
static pthread_mutex_t ibv_mu = PTHREAD_MUTEX_INITIALIZER;

#define IBV_LIB_DEFAULT "libibverbs.so.1"

/* Loads the library named by PEGAFLOW_LIBIBVERBS (or libibverbs.so.1) once
 * per name; PF_ENODEV naming the library when it cannot. */
static int32_t ibv_load(const char *fn) {
  const char *name = getenv("PEGAFLOW_LIBIBVERBS");
  if (!name || !*name) name = IBV_LIB_DEFAULT;
  pthread_mutex_lock(&ibv_mu);
  if (ibv.h && strcmp(ibv.name, name) == 0) {
    pthread_mutex_unlock(&ibv_mu);
    return PF_OK;
  }
  void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *why = dlerror();
    pthread_mutex_unlock(&ibv_mu);
    return pf_fail(PF_ENODEV, "%s: %s not found (%s); install rdma-core's libibverbs "
                   "(Debian: libibverbs1) or use the TCP transport", fn, name,
                   why ? why : "dlopen failed");
  }
#define SYM(field, sym)                                                              \
  do {                                                                               \
    *(void **)&ibv.field = dlsym(h, sym);                                            \
    if (!ibv.field) {                                                                \
      dlclose(h);                                                                    \
      memset(&ibv, 0, sizeof ibv);                                                   \
      pthread_mutex_unlock(&ibv_mu);                                                 \
      return pf_fail(PF_ENODEV, "%s: %s lacks the symbol %s (not an rdma-core "     \
                     "libibverbs?)", fn, name, sym);                                  \
    }                                                                                \
  } while (0)
  SYM(get_device_list, "ibv_get_device_list");
  SYM(free_device_list, "ibv_free_device_list");
  SYM(get_device_name, "ibv_get_device_name");
  SYM(open_device, "ibv_open_device");
  SYM(close_device, "ibv_close_device");
  SYM(query_port, "ibv_query_port");
  SYM(query_gid, "ibv_query_gid");
  SYM(alloc_pd, "ibv_alloc_pd");
  SYM(dealloc_pd, "ibv_dealloc_pd");
  SYM(reg_mr, "ibv_reg_mr");
  SYM(dereg_mr, "ibv_dereg_mr");
  SYM(create_cq, "ibv_create_cq");
  SYM(destroy_cq, "ibv_destroy_cq");
  SYM(create_qp, "ibv_create_qp");
  SYM(modify_qp, "ibv_modify_qp");
  SYM(destroy_qp, "ibv_destroy_qp");
#undef SYM
  ibv.h = h;
  snprintf(ibv.name, sizeof ibv.name, "%s", name);
  pthread_mutex_unlock(&ibv_mu);
  return PF_OK;
}

static int32_t device_names(char *buf, size_t cap, int *count) {
  int n = 0;
  struct ibv_device **list = ibv.get_device_list(&n);
  size_t len = 0;
  if (buf && cap) buf[0] = 0;
  for (int i = 0; list && i < n; i++) {
    const char *nm = ibv.get_device_name(list[i]);
    int w = snprintf(buf ? buf + len : NULL, buf && len < cap ? cap - len : 0, "%s%s",
                     i ? "," : "", nm ? nm : "?");
    len += (size_t)w;
  }
  if (list) ibv.free_device_list(list);
  *count = list ? n : 0;
  return (int32_t)len;
}

int32_t pf_rdma_devices(char *buf, uint32_t cap) {
  int32_t rc = ibv_load("pf_rdma_devices");
  if (rc < 0) return rc;
  int n;
  return device_names(buf, cap, &n);
}

/* ---- endpoint ----------------------------------------------------------- */
#define RDMA_MAX_NICS 16
#define RDMA_SQ_DEPTH 1024
/* Receive WRs kept posted per QP for incoming immediates. */
#define RDMA_RQ_DEPTH 128
/* CQ entries one QP can fill: each send-queue entry and each posted receive
 * makes at most one completion (a flushed one too) and is not reused before
 * that completion is polled (send credit returns at poll; a receive is
 * posted again after its completion is handled). A peer's CQ on a NIC has
 * this many per QP on that NIC, so it cannot overrun. */
#define RDMA_QP_CQES (RDMA_SQ_DEPTH + RDMA_RQ_DEPTH)
/* Chunks per part: one chain of WRs, at most half a send queue. */
#define RDMA_PART_CHUNKS 512u
/* env PEGAFLOW_RDMA_GID_INDEX: the GID table entry (RoCE v2 is often 3). */
#define RDMA_DEFAULT_GID_INDEX 0
/* Poller sleep when every CQ is empty. */
#define RDMA_IDLE_US 20
/* A peer close's longest wait for the flush completions of what its batches
 * posted, once its QPs are in the error state (a working NIC flushes at
 * once). Past it (a wedged NIC, a lost completion) the QPs are destroyed
 * instead, which stops them for good, and the batches end: the close never
 * hangs. Env PEGAFLOW_RDMA_FLUSH_WAIT_MS overrides it per endpoint. */
#define RDMA_FLUSH_WAIT_MS 5000u
#define RDMA_MAX_FLUSH_WAIT_MS 3600000u
/* Send wr_id: gen << 32 | slot << 24 | RDMA_LAST_BIT on a chain's last WR
 * | part (RDMA_IMM_PART for the immediate). Receive wr_id: RDMA_RECV_BIT |
 * lane. An error completion's opcode is undefined, so the wr_id alone must
 * tell sends from receives; and every WR of a chain carries its part, so
 * the LAST bit tells the one whose completion ends the chain (IBTA
 * 10.7.3.1: an unsignaled WR completes silently on success but makes a
 * completion of its own when it fails or is flushed). */
#define RDMA_RECV_BIT (1u << 23)
#define RDMA_LAST_BIT (1u << 22)
#define RDMA_PART_MASK 0x3fffffu
#define RDMA_IMM_PART RDMA_PART_MASK

typedef struct rdma_nic {
  char name[64];
  uint8_t port;
  struct ibv_context *ctx;
  struct ibv_pd *pd;
  struct ibv_mr *mr;
  uint16_t lid;
  uint8_t mtu;
  union ibv_gid gid;
  int gid_index;
} rdma_nic;

struct rdma_peer;

typedef struct rdma_ep {
  rdma_nic nic[RDMA_MAX_NICS];
  uint32_t nnics;
  uint32_t flush_wait_ms; /* RDMA_FLUSH_WAIT_MS, or PEGAFLOW_RDMA_FLUSH_WAIT_MS */
  pthread_t poller;
  atomic_int stop;
  /* The peers whose CQs the poller polls (each peer's own, per NIC). A peer
   * is listed at the end of its create and unlisted at the start of its
   * free, which then takes ep->scan for writing once: a poller pass (it
   * holds `scan` for reading) that still saw it has ended, and later passes
   * see the new `live_version` and copy the list again. */
  pthread_mutex_t live_mu;
  struct rdma_peer **live;
  uint32_t nlive, cap_live;
  atomic_uint live_version;
} rdma_ep;

/* Parses "name[:port],..." into nics; EINVAL naming the bad entry. */
static int32_t parse_nics(const char *fn, const char *text, rdma_nic *nic, uint32_t *n) {
  *n = 0;
  if (!*text) return PF_OK;
  const char *p = text;
  for (;;) {
    const char *end = strchr(p, ',');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    char item[96];
    if (len == 0 || len >= sizeof item)
      return pf_fail(PF_EINVAL, "%s: nics \"%s\": empty or over-long device name", fn, text);
    memcpy(item, p, len);
    item[len] = 0;
    if (*n == RDMA_MAX_NICS)
      return pf_fail(PF_EINVAL, "%s: nics \"%s\": more than %d devices", fn, text, RDMA_MAX_NICS);
    long port = 1;
    char *colon = strchr(item, ':');
    if (colon) {
      char *e;
      port = strtol(colon + 1, &e, 10);
      if (*e || port < 1 || port > 255)
        return pf_fail(PF_EINVAL, "%s: nics entry \"%s\": port must be 1..255", fn, item);
      *colon = 0;
    }
    if (!item[0] || strlen(item) >= sizeof nic[0].name)
      return pf_fail(PF_EINVAL, "%s: nics entry \"%s\": bad device name", fn, item);
    for (const char *c = item; *c; c++)
      if (!(*c == '_' || *c == '-' || *c == '.' || (*c >= '0' && *c <= '9') ||
            (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z')))
        return pf_fail(PF_EINVAL, "%s: nics entry \"%s\": bad character '%c' in device name",
                       fn, item, *c);
    snprintf(nic[*n].name, sizeof nic[0].name, "%s", item);
    nic[*n].port = (uint8_t)port;
    (*n)++;
    if (!end) break;
    p = end + 1;
  }
  return PF_OK;
}

static void nic_close(rdma_nic *n) {
  if (n->mr) ibv.dereg_mr(n->mr);
  if (n->pd) ibv.dealloc_pd(n->pd);
  if (n->ctx) ibv.close_device(n->ctx);
  memset(n, 0, sizeof *n);
}

static void *poller_main(void *arg);

static int32_t rdma_open(pf_xfer_ep *ep) {
  const char *fn = "pf_xfer_open(rdma)";
  rdma_ep *r = calloc(1, sizeof *r);
  if (!r) return pf_fail(PF_ENOMEM, "%s: out of memory", fn);
  int32_t rc = parse_nics(fn, ep->cfg.nics, r->nic, &r->nnics);
  if (rc == PF_OK)
    rc = xfer_env_limit(fn, "PEGAFLOW_RDMA_FLUSH_WAIT_MS", RDMA_FLUSH_WAIT_MS,
                        RDMA_MAX_FLUSH_WAIT_MS, " (ms)", &r->flush_wait_ms);
  if (rc < 0) goto fail;
  if ((rc = ibv_load(fn)) < 0) goto fail;
  int ndev = 0;
  struct ibv_device **list = ibv.get_device_list(&ndev);
  if (!list || ndev == 0) {
    if (list) ibv.free_device_list(list);
    rc = pf_fail(PF_ENODEV, "%s: no RDMA device found (%s lists none%s%s); the TCP transport "
                 "is used instead", fn, ibv.name, errno ? ": " : "", errno ? strerror(errno) : "");
    goto fail;
  }
  if (r->nnics == 0) { /* every device, port 1 */
    for (int i = 0; i < ndev && i < RDMA_MAX_NICS; i++) {
      snprintf(r->nic[i].name, sizeof r->nic[i].name, "%s", ibv.get_device_name(list[i]));
      r->nic[i].port = 1;
    }
    r->nnics = (uint32_t)(ndev < RDMA_MAX_NICS ? ndev : RDMA_MAX_NICS);
  }
  const char *gi = getenv("PEGAFLOW_RDMA_GID_INDEX");
  int gid_index = gi && *gi ? atoi(gi) : RDMA_DEFAULT_GID_INDEX;
  for (uint32_t k = 0; k < r->nnics; k++) {
    rdma_nic *n = &r->nic[k];
    struct ibv_device *dev = NULL;
    for (int i = 0; i < ndev; i++)
      if (strcmp(ibv.get_device_name(list[i]), n->name) == 0) dev = list[i];
    if (!dev) {
      char names[512];
      int cnt;
      device_names(names, sizeof names, &cnt);
      ibv.free_device_list(list);
      rc = pf_fail(PF_EINVAL, "%s: nics: no RDMA device named \"%s\" (found: %s)", fn, n->name,
                   names);
      goto fail_nics;
    }
    n->ctx = ibv.open_device(dev);
    if (!n->ctx) {
      ibv.free_device_list(list);
      rc = pf_fail(PF_ENODEV, "%s: ibv_open_device(%s): %s", fn, n->name, strerror(errno));
      goto fail_nics;
    }
    struct ibv_port_attr pa;
    memset(&pa, 0, sizeof pa);
    if (ibv.query_port(n->ctx, n->port, &pa) || pa.state != IBV_PORT_ACTIVE) {
      ibv.free_device_list(list);
      rc = pf_fail(PF_ENODEV, "%s: %s port %u is not active (state %d)", fn, n->name, n->port,
                   pa.state);
      goto fail_nics;
    }
    n->lid = pa.lid;
    n->mtu = (uint8_t)pa.active_mtu;
    n->gid_index = gid_index;
    if (pa.link_layer == IBV_LINK_LAYER_ETHERNET &&
        ibv.query_gid(n->ctx, n->port, gid_index, &n->gid)) {
      ibv.free_device_list(list);
      rc = pf_fail(PF_ENODEV, "%s: %s port %u: no GID at index %d (PEGAFLOW_RDMA_GID_INDEX)",
                   fn, n->name, n->port, gid_index);
      goto fail_nics;
    }
    n->pd = ibv.alloc_pd(n->ctx);
    n->mr = n->pd ? ibv.reg_mr(n->pd, ep->pool->host, ep->pool->bytes,
                               IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ |
                                   IBV_ACCESS_REMOTE_WRITE)
                  : NULL;
    if (!n->mr) {
      int e = errno;
      ibv.free_device_list(list);
      rc = pf_fail(PF_ENOMEM, "%s: %s: %s failed: %s", fn, n->name,
                   !n->pd ? "ibv_alloc_pd" : "ibv_reg_mr of the pool", strerror(e));
      goto fail_nics;
    }
  }
  ibv.free_device_list(list);
  pthread_mutex_init(&r->live_mu, NULL);
  ep->impl = r;
  if (pthread_create(&r->poller, NULL, poller_main, ep)) {
    rc = pf_fail(PF_ENOMEM, "%s: cannot start the CQ poller", fn);
    ep->impl = NULL;
    pthread_mutex_destroy(&r->live_mu);
    goto fail_nics;
  }
  return PF_OK;
fail_nics:
  for (uint32_t k = 0; k < r->nnics; k++)
    if (r->nic[k].ctx) nic_close(&r->nic[k]);
fail:
  free(r);
  return rc;
}

/* Every peer was closed before (pf_xfer_close refuses otherwise), so no CQ
 * is left to poll. */
static void rdma_close(pf_xfer_ep *ep) {
  rdma_ep *r = ep->impl;
  atomic_store(&r->stop, 1);
  pthread_join(r->poller, NULL);
  for (uint32_t k = 0; k < r->nnics; k++) nic_close(&r->nic[k]);
  free(r->live);
  pthread_mutex_destroy(&r->live_mu);
  free(r);
}

/* ---- peers --------------------------------------------------------------- */
typedef struct rdma_wire_qp {
  uint32_t qpn, psn, rkey;
  uint16_t lid;
  uint8_t port, mtu;
  uint8_t gid[16];
} rdma_wire_qp;
typedef struct rdma_wire_hdr {
  uint32_t magic; /* "PFR1" */
  uint32_t nqp;
  uint64_t pool_addr;
  uint64_t pool_bytes;
} rdma_wire_hdr;
#define RDMA_MAGIC 0x31524650u

typedef struct backlog_item {
  uint32_t slot, gen, part;
} backlog_item;

typedef struct rdma_qp {
  struct ibv_qp *qp; /* NULL once destroyed by a close that gave up on its flush */
  uint32_t qpn;      /* its number: what the poller matches completions by */
  rdma_nic *nic;
  pf_xfer_peer *peer;
  uint32_t psn;
  uint32_t remote_rkey;
  pthread_mutex_t mu; /* posting, credit, backlog */
  uint32_t credit;    /* free send-queue entries */
  backlog_item *bl;
  uint32_t bl_head, bl_len, bl_cap;
} rdma_qp;

typedef struct rdma_peer {
  pf_xfer_peer *p;
  rdma_qp *qp; /* lane i is on NIC i % ncq */
  uint32_t nqp;
  /* This peer's CQ on each NIC (send and receive CQ of its QPs there),
   * RDMA_QP_CQES per QP on that NIC. */
  struct ibv_cq *cq[RDMA_MAX_NICS];
  uint32_t ncq;
  uint64_t remote_addr;
  /* QPs moved (or being moved) to the error state; set only after the
   * peer's `broken` and its message are published (qps_to_error). */
  atomic_int in_error;
  atomic_int detached; /* the poller no longer looks at these QPs */
  int listed;          /* in the poller's list (rdma_ep.live) */
  /* Non-empty: a failed connect could not bring the QPs back to INIT (why);
   * every later connect is refused: the peer must be created again.
   * Connects run one at a time (pf_xfer.c), so no lock. */
  char stuck[160];
} rdma_peer;

typedef struct rdma_slot {
  atomic_uint posted_open; /* posted signaled WRs whose completion is pending */
  atomic_int fail;         /* first failure of this batch (0 = none) */
} rdma_slot;

/* Breaks the peer with status and the reason (printf-style; the first
 * reason stays), then moves every QP to the error state once: posted WRs
 * stop and flush. The reason is published before in_error, so a thread
 * that sees in_error reads a whole p->broken_msg. */
static void qps_to_error(pf_xfer_peer *p, int32_t status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void qps_to_error(pf_xfer_peer *p, int32_t status, const char *fmt, ...) {
  rdma_peer *rp = p->impl;
  char why[200];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  xfer_peer_mark_broken(p, status, "QPs moved to the error state (%s); close the peer and "
                        "reconnect", why);
  int expected = 0;
  if (!atomic_compare_exchange_strong(&rp->in_error, &expected, 1)) return;
  for (uint32_t i = 0; i < rp->nqp; i++) {
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_ERR;
    /* Under the QP's mutex: the poller may be destroying it (cq_lost). */
    pthread_mutex_lock(&rp->qp[i].mu);
    if (rp->qp[i].qp) ibv.modify_qp(rp->qp[i].qp, &a, IBV_QP_STATE);
    pthread_mutex_unlock(&rp->qp[i].mu);
  }
}

/* How a batch ends that the peer's failure cancelled (flushed, or dropped
 * from a backlog): as TCP's, PF_ESHUTDOWN when the peer is closing, else
 * PF_EIO. */
static int32_t cancelled_status(pf_xfer_peer *p) {
  return atomic_load(&p->closing) ? PF_ESHUTDOWN : PF_EIO;
}

/* ibv_wc_status names (rdma-core's enum ibv_wc_status, stable since v1). */
static const char *wc_status_name(int st) {
  static const char *const names[] = {
      "SUCCESS", "LOC_LEN_ERR", "LOC_QP_OP_ERR", "LOC_EEC_OP_ERR", "LOC_PROT_ERR",
      "WR_FLUSH_ERR", "MW_BIND_ERR", "BAD_RESP_ERR", "LOC_ACCESS_ERR", "REM_INV_REQ_ERR",
      "REM_ACCESS_ERR", "REM_OP_ERR", "RETRY_EXC_ERR", "RNR_RETRY_EXC_ERR", "LOC_RDD_VIOL_ERR",
      "REM_INV_RD_REQ_ERR", "REM_ABORT_ERR", "INV_EECN_ERR", "INV_EEC_STATE_ERR", "FATAL_ERR",
      "RESP_TIMEOUT_ERR", "GENERAL_ERR"};
  return st >= 0 && st < (int)(sizeof names / sizeof names[0]) ? names[st] : "unknown status";
}

/* An ibv_* call's error: verbs return the errno value (ibv_post_*,
 * ibv_modify_qp) or -1 / NULL with errno set. */
static int verbs_errno(int rc) {
  return rc > 0 ? rc : errno;
}

/* Brings QP `lane` (in RESET) to INIT and posts its RDMA_RQ_DEPTH receives
 * for immediates. Fails (PF_EIO; `why` names the QP, its NIC and, for the
 * receives, how many were posted) leaving the QP as it is. A QP short of
 * receives would make immediates stall (RNR retries) or fail later with
 * no word of why: before, failed receive posts were ignored. */
static int32_t qp_arm(rdma_qp *q, uint32_t lane, char *why, size_t cap) {
  struct ibv_qp_attr a;
  memset(&a, 0, sizeof a);
  a.qp_state = IBV_QPS_INIT;
  a.port_num = q->nic->port;
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
  int rc = ibv.modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                        IBV_QP_ACCESS_FLAGS);
  if (rc) {
    snprintf(why, cap, "QP %u (%s) to INIT: %s", lane, q->nic->name, strerror(verbs_errno(rc)));
    return PF_EIO;
  }
  for (uint32_t k = 0; k < RDMA_RQ_DEPTH; k++) {
    struct ibv_recv_wr wr = {.wr_id = RDMA_RECV_BIT | lane}, *bad;
    rc = q->nic->ctx->ops.post_recv(q->qp, &wr, &bad);
    if (rc) {
      snprintf(why, cap, "ibv_post_recv on QP %u (%s) failed after %u of %u receives: %s", lane,
               q->nic->name, k, RDMA_RQ_DEPTH, strerror(verbs_errno(rc)));
      return PF_EIO;
    }
  }
  return PF_OK;
}

/* Lists rp for the poller (end of a successful create). */
static int32_t peer_list(rdma_ep *r, rdma_peer *rp, const char *fn) {
  pthread_mutex_lock(&r->live_mu);
  if (r->nlive == r->cap_live) {
    uint32_t ncap = r->cap_live ? r->cap_live * 2 : 8;
    rdma_peer **nl = realloc(r->live, ncap * sizeof *nl);
    if (!nl) {
      pthread_mutex_unlock(&r->live_mu);
      return pf_fail(PF_ENOMEM, "%s: out of memory for the poller's peer list", fn);
    }
    r->live = nl;
    r->cap_live = ncap;
  }
  r->live[r->nlive++] = rp;
  atomic_fetch_add(&r->live_version, 1);
  pthread_mutex_unlock(&r->live_mu);
  rp->listed = 1;
  return PF_OK;
}

/* Unlists rp, then waits out a poller pass that may still poll its CQs. */
static void peer_unlist(pf_xfer_ep *ep, rdma_peer *rp) {
  rdma_ep *r = ep->impl;
  if (!rp->listed) return;
  pthread_mutex_lock(&r->live_mu);
  for (uint32_t i = 0; i < r->nlive; i++)
    if (r->live[i] == rp) {
      r->live[i] = r->live[--r->nlive];
      break;
    }
  atomic_fetch_add(&r->live_version, 1);
  pthread_mutex_unlock(&r->live_mu);
  pthread_rwlock_wrlock(&ep->scan);
  pthread_rwlock_unlock(&ep->scan);
  rp->listed = 0;
}

static int32_t rdma_peer_create(pf_xfer_peer *p) {
  const char *fn = "pf_xfer_peer_create(rdma)";
  rdma_ep *r = p->ep->impl;
  rdma_peer *rp = calloc(1, sizeof *rp);
  if (!rp) return pf_fail(PF_ENOMEM, "%s: out of memory", fn);
  uint32_t streams = p->ep->cfg.streams;
  rp->p = p;
  rp->nqp = r->nnics * streams;
  rp->qp = calloc(rp->nqp, sizeof *rp->qp);
  if (!rp->qp) {
    free(rp);
    return pf_fail(PF_ENOMEM, "%s: out of memory", fn);
  }
  p->impl = rp;
  int32_t rc = PF_OK;
  for (uint32_t k = 0; k < r->nnics; k++) {
    /* Every QP of this peer on NIC k, each with its whole send queue and
     * receive queue completing at once (the error state flushes them). */
    uint32_t cqe = streams * RDMA_QP_CQES;
    rp->cq[k] = ibv.create_cq(r->nic[k].ctx, (int)cqe, NULL, NULL, 0);
    if (!rp->cq[k]) {
      int e = errno;
      rc = pf_fail(e == EINVAL ? PF_EINVAL : PF_ENOMEM,
                   "%s: ibv_create_cq of %u entries on %s (%u QPs x (%u send + %u receive)): "
                   "%s%s", fn, cqe, r->nic[k].name, streams, RDMA_SQ_DEPTH, RDMA_RQ_DEPTH,
                   strerror(e), e == EINVAL ? "; more than the device's max_cqe? use fewer QPs "
                                              "per NIC (streams)" : "");
      goto fail;
    }
    rp->ncq = k + 1;
  }
  for (uint32_t i = 0; i < rp->nqp; i++) {
    rdma_qp *q = &rp->qp[i];
    q->nic = &r->nic[i % r->nnics]; /* lanes alternate NICs */
    q->peer = p;
    q->credit = RDMA_SQ_DEPTH;
    pthread_mutex_init(&q->mu, NULL);
    struct ibv_qp_init_attr ia;
    memset(&ia, 0, sizeof ia);
    ia.send_cq = ia.recv_cq = rp->cq[i % r->nnics];
    ia.cap.max_send_wr = RDMA_SQ_DEPTH;
    ia.cap.max_recv_wr = RDMA_RQ_DEPTH;
    ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
    ia.qp_type = IBV_QPT_RC;
    q->qp = ibv.create_qp(q->nic->pd, &ia);
    if (!q->qp) {
      rc = pf_fail(PF_ENOMEM, "%s: ibv_create_qp on %s: %s", fn, q->nic->name, strerror(errno));
      goto fail;
    }
    q->qpn = ((struct ibv_qp_head *)q->qp)->qp_num;
    q->psn = (uint32_t)(rand() & 0xffffff);
    char why[200];
    if ((rc = qp_arm(q, i, why, sizeof why)) < 0) {
      pf_fail(rc, "%s: %s", fn, why);
      goto fail;
    }
  }
  if ((rc = peer_list(r, rp, fn)) < 0) goto fail;
  return PF_OK;
fail:
  p->ep->ops->peer_free(p);
  return rc;
}

static int32_t rdma_peer_info(pf_xfer_peer *p, uint8_t *buf, uint32_t cap) {
  rdma_peer *rp = p->impl;
  uint32_t need = (uint32_t)(sizeof(rdma_wire_hdr) + rp->nqp * sizeof(rdma_wire_qp));
  if (!buf || cap < need) return (int32_t)need;
  rdma_wire_hdr h = {.magic = RDMA_MAGIC, .nqp = rp->nqp,
                     .pool_addr = (uint64_t)(uintptr_t)p->ep->pool->host,
                     .pool_bytes = p->ep->pool->bytes};
  memcpy(buf, &h, sizeof h);
  for (uint32_t i = 0; i < rp->nqp; i++) {
    rdma_qp *q = &rp->qp[i];
    rdma_wire_qp w = {.qpn = q->qpn, .psn = q->psn,
                      .rkey = q->nic->mr->rkey, .lid = q->nic->lid, .port = q->nic->port,
                      .mtu = q->nic->mtu};
    memcpy(w.gid, q->nic->gid.raw, 16);
    memcpy(buf + sizeof h + i * sizeof w, &w, sizeof w);
  }
  return (int32_t)need;
}

/* Moves QP `lane` to RTR and RTS towards the remote QP `w`. */
static int32_t qp_connect(rdma_qp *q, uint32_t lane, const rdma_wire_qp *w, const char *fn) {
  struct ibv_qp_attr a;
  memset(&a, 0, sizeof a);
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = w->mtu < q->nic->mtu ? w->mtu : q->nic->mtu;
  a.dest_qp_num = w->qpn;
  a.rq_psn = w->psn;
  a.max_dest_rd_atomic = 16;
  a.min_rnr_timer = 12;
  a.ah_attr.dlid = w->lid;
  a.ah_attr.port_num = q->nic->port;
  static const uint8_t zero[16];
  if (memcmp(w->gid, zero, 16) != 0) {
    a.ah_attr.is_global = 1;
    memcpy(a.ah_attr.grh.dgid.raw, w->gid, 16);
    a.ah_attr.grh.sgid_index = (uint8_t)q->nic->gid_index;
    a.ah_attr.grh.hop_limit = 64;
  }
  int rc = ibv.modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                                        IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (rc)
    return pf_fail(PF_EIO, "%s: QP %u (%s) to RTR: %s", fn, lane, q->nic->name,
                   strerror(verbs_errno(rc)));
  memset(&a, 0, sizeof a);
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14; /* 4.096 us * 2^14 = 67 ms per retry */
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.sq_psn = q->psn;
  a.max_rd_atomic = 16;
  rc = ibv.modify_qp(q->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                    IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
  if (rc)
    return pf_fail(PF_EIO, "%s: QP %u (%s) to RTS: %s", fn, lane, q->nic->name,
                   strerror(verbs_errno(rc)));
  q->remote_rkey = w->rkey;
  return PF_OK;
}

/* A connect failed at QP `upto` (rc, pf_last_error says why) after QPs
 * before it reached RTS, and `upto` itself may be in RTR: none of them can
 * be connected again from there (RTR is entered from INIT only). So QPs
 * 0..upto go back through RESET to INIT with their receives posted again
 * (RESET empties the receive queue), as the create left them: a retry
 * starts from where the first attempt did. Nothing was ever posted on their
 * send queues (a submit needs a connected peer). If that fails the peer
 * cannot be connected any more, and the error, and every later connect's,
 * says to close it and create it again. Before, the QPs were left where
 * they stood and a retry failed on QP 0 ("to RTR: Invalid argument"),
 * saying nothing of why or what to do. */
static int32_t connect_unwind(rdma_peer *rp, uint32_t upto, int32_t rc) {
  char why[PF_ERROR_TEXT_BYTES];
  pf_last_error(why, sizeof why);
  for (uint32_t i = 0; i <= upto; i++) {
    rdma_qp *q = &rp->qp[i];
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RESET;
    int e = ibv.modify_qp(q->qp, &a, IBV_QP_STATE);
    if (e)
      snprintf(rp->stuck, sizeof rp->stuck, "resetting QP %u (%s) failed (%s)", i, q->nic->name,
               strerror(verbs_errno(e)));
    else
      qp_arm(q, i, rp->stuck, sizeof rp->stuck); /* writes `stuck` only if it fails */
    if (rp->stuck[0])
      return pf_fail(rc, "%s; %s: close the peer and create it again", why, rp->stuck);
  }
  return pf_fail(rc, "%s; the peer's QPs were reset to INIT: connect may be retried", why);
}

static int32_t rdma_peer_connect(pf_xfer_peer *p, const uint8_t *remote, uint32_t len,
                                 int32_t timeout_ms) {
  const char *fn = "pf_xfer_peer_connect(rdma)";
  rdma_peer *rp = p->impl;
  if (rp->stuck[0])
    return pf_fail(PF_EIO, "%s: an earlier connect failed and its QPs could not be reset (%s): "
                   "close the peer and create it again", fn, rp->stuck);
  rdma_wire_hdr h;
  if (len < sizeof h) return pf_fail(PF_EINVAL, "%s: remote info is %u bytes; too short", fn, len);
  memcpy(&h, remote, sizeof h);
  if (h.magic != RDMA_MAGIC)
    return pf_fail(PF_EINVAL, "%s: remote info is not an RDMA peer description", fn);
  if (h.nqp != rp->nqp || len != sizeof h + h.nqp * sizeof(rdma_wire_qp))
    return pf_fail(PF_EINVAL, "%s: remote has %u QPs (%u bytes); this peer has %u (NICs x "
                   "streams must match on both sides)", fn, h.nqp, len, rp->nqp);
  for (uint32_t i = 0; i < rp->nqp; i++) {
    rdma_wire_qp w;
    memcpy(&w, remote + sizeof h + i * sizeof w, sizeof w);
    int32_t rc = qp_connect(&rp->qp[i], i, &w, fn);
    if (rc < 0) return connect_unwind(rp, i, rc);
  }
  rp->remote_addr = h.pool_addr;
  p->remote_bytes = h.pool_bytes;
  p->lanes = rp->nqp;
  return PF_OK;
}

/* ---- posting ------------------------------------------------------------ */
static rdma_slot *slot_state(xfer_slot *s) {
  if (!s->impl) s->impl = calloc(1, sizeof(rdma_slot));
  return s->impl;
}

/* Posts part `part` of (s, gen) on q now; q->mu held; credit checked. 0, or the
 * errno value of the failed ibv_post_send. */
static int post_part(pf_xfer_peer *p, rdma_qp *q, xfer_slot *s, uint32_t gen, uint32_t part) {
  rdma_peer *rp = p->impl;
  rdma_slot *rs = s->impl;
  uint8_t *pool = p->ep->pool->host;
  uint64_t wr_id = (uint64_t)gen << 32 | (uint64_t)s->index << 24;
  int n;
  struct ibv_send_wr wrs[RDMA_PART_CHUNKS], *bad = NULL;
  struct ibv_sge sges[RDMA_PART_CHUNKS];
  if (part == RDMA_IMM_PART) {
    n = 1;
    memset(&wrs[0], 0, sizeof wrs[0]);
    wrs[0].wr_id = wr_id | RDMA_LAST_BIT | RDMA_IMM_PART;
    wrs[0].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wrs[0].send_flags = IBV_SEND_SIGNALED;
    wrs[0].imm_data = htonl(s->imm);
    wrs[0].wr.rdma.remote_addr = rp->remote_addr;
    wrs[0].wr.rdma.rkey = q->remote_rkey;
  } else {
    const xfer_part *pt = &s->parts[part];
    n = (int)pt->n;
    for (int i = 0; i < n; i++) {
      const xfer_chunk *c = &s->chunks[pt->first + (uint32_t)i];
      sges[i] = (struct ibv_sge){.addr = (uint64_t)(uintptr_t)(pool + c->local_off),
                                 .length = (uint32_t)c->bytes, .lkey = q->nic->mr->lkey};
      memset(&wrs[i], 0, sizeof wrs[i]);
      wrs[i].wr_id = wr_id | part;
      wrs[i].sg_list = &sges[i];
      wrs[i].num_sge = 1;
      wrs[i].opcode = s->op == PF_XFER_READ ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
      wrs[i].wr.rdma.remote_addr = rp->remote_addr + c->remote_off;
      wrs[i].wr.rdma.rkey = q->remote_rkey;
      wrs[i].next = i + 1 < n ? &wrs[i + 1] : NULL;
    }
    wrs[n - 1].send_flags = IBV_SEND_SIGNALED;
    wrs[n - 1].wr_id |= RDMA_LAST_BIT;
  }
  atomic_fetch_add(&rs->posted_open, 1);
  int rc = q->nic->ctx->ops.post_send(q->qp, wrs, &bad);
  if (rc) {
    atomic_fetch_sub(&rs->posted_open, 1);
    return verbs_errno(rc); /* providers return the errno value, errno is not set */
  }
  q->credit -= (uint32_t)n;
  return 0;
}

/* Posts (or queues behind the backlog) part `part` of (s, gen) on lane.
 * Fails (pf_fail naming the part and the QP) without queueing anything. */
static int32_t post_or_queue(pf_xfer_peer *p, uint32_t lane, xfer_slot *s, uint32_t gen,
                             uint32_t part) {
  rdma_peer *rp = p->impl;
  rdma_qp *q = &rp->qp[lane];
  uint32_t need = part == RDMA_IMM_PART ? 1 : s->parts[part].n;
  pthread_mutex_lock(&q->mu);
  if (!q->qp) { /* destroyed (cq_lost): the peer is broken, its reason whole */
    pthread_mutex_unlock(&q->mu);
    return pf_fail(PF_EIO, "part %u on QP %u (%s): the QP is destroyed (%s)", part, lane,
                   q->nic->name, p->broken_msg);
  }
  if (q->bl_len == 0 && q->credit >= need) {
    int e = post_part(p, q, s, gen, part);
    pthread_mutex_unlock(&q->mu);
    if (!e) return PF_OK;
    if (part == RDMA_IMM_PART)
      return pf_fail(PF_EIO, "ibv_post_send of the immediate on QP %u (%s): %s", lane,
                     q->nic->name, strerror(e));
    return pf_fail(PF_EIO, "ibv_post_send of part %u (%u WR%s) on QP %u (%s): %s", part, need,
                   need == 1 ? "" : "s", lane, q->nic->name, strerror(e));
  }
  if (q->bl_len == q->bl_cap) {
    uint32_t ncap = q->bl_cap ? q->bl_cap * 2 : 64;
    backlog_item *b = malloc(ncap * sizeof *b);
    if (!b) {
      pthread_mutex_unlock(&q->mu);
      return pf_fail(PF_ENOMEM, "out of memory for the backlog of QP %u (%s), part %u", lane,
                     q->nic->name, part);
    }
    for (uint32_t i = 0; i < q->bl_len; i++) b[i] = q->bl[(q->bl_head + i) % q->bl_cap];
    free(q->bl);
    q->bl = b;
    q->bl_head = 0;
    q->bl_cap = ncap;
  }
  q->bl[(q->bl_head + q->bl_len) % q->bl_cap] = (backlog_item){s->index, gen, part};
  q->bl_len++;
  pthread_mutex_unlock(&q->mu);
  return PF_OK;
}

/* Ends (s, gen) once nothing of it is on the wire and it failed or every
 * part landed. Called by the threads that may post a record: the poller and
 * the timer, never the submit. A no-op once (s, gen) has ended. */
static void maybe_end(pf_xfer_peer *p, xfer_slot *s, uint32_t gen) {
  rdma_slot *rs = s->impl;
  if (atomic_load(&rs->posted_open) != 0) return;
  int f = atomic_load(&rs->fail);
  if (f) xfer_end(p, s, gen, f);
  else if (atomic_load(&s->parts_left) == 0) xfer_end(p, s, gen, PF_OK);
}

/* Records `status` as the failure of (s, gen) unless one is recorded; 0
 * when (s, gen) has ended (its slot may hold a newer batch: nothing is
 * touched). Inside the slot guard, so the slot cannot be re-armed under it. */
static int batch_fail(xfer_slot *s, uint32_t gen, int32_t status) {
  if (!xfer_enter(s, gen)) return 0;
  rdma_slot *rs = s->impl;
  int z = 0;
  atomic_compare_exchange_strong(&rs->fail, &z, status);
  xfer_leave(s);
  return 1;
}

/* Credit came back on q: post what waits, in order. Parts of ended batches
 * are dropped; once the peer is in error every part is dropped, and its
 * batch ends now with the peer's failure (it has no completion left to
 * wait for, else it would only end at its deadline). Poller thread. */
static void drain_backlog(pf_xfer_peer *p, rdma_qp *q) {
  rdma_peer *rp = p->impl;
  pthread_mutex_lock(&q->mu);
  while (q->bl_len) {
    backlog_item it = q->bl[q->bl_head];
    xfer_slot *s = &p->slots[it.slot];
    int in_error = atomic_load(&rp->in_error);
    if (in_error || !xfer_live(s, it.gen)) {
      q->bl_head = (q->bl_head + 1) % q->bl_cap;
      q->bl_len--;
      if (!in_error) continue;
      pthread_mutex_unlock(&q->mu);
      if (batch_fail(s, it.gen, cancelled_status(p))) maybe_end(p, s, it.gen);
      pthread_mutex_lock(&q->mu);
      continue;
    }
    uint32_t need = it.part == RDMA_IMM_PART ? 1 : s->parts[it.part].n;
    if (q->credit < need) break;
    q->bl_head = (q->bl_head + 1) % q->bl_cap;
    q->bl_len--;
    int e = post_part(p, q, s, it.gen, it.part);
    if (e) {
      rdma_slot *rs = s->impl;
      int z = 0;
      atomic_compare_exchange_strong(&rs->fail, &z, PF_EIO);
      pthread_mutex_unlock(&q->mu);
      qps_to_error(p, PF_EIO, "ibv_post_send of a queued part on QP %u (%s): %s",
                   (uint32_t)(q - rp->qp), q->nic->name, strerror(e));
      maybe_end(p, s, it.gen);
      pthread_mutex_lock(&q->mu);
    }
  }
  pthread_mutex_unlock(&q->mu);
}

/* Part `part` of the batch being submitted could not be posted or queued
 * (rc; pf_last_error says why). The batch stops: the QPs go to the error
 * state, so what it posted stops and flushes. If some of it is still on the
 * wire, it is accepted (PF_OK) and the poller ends it with `rc` after the
 * last flush; if nothing is, it is handed back with rc and no record, for
 * pf_xfer.c's submit_unwind (which answers PF_OK if another thread ended it
 * meanwhile). JS thread: never ends the batch itself (a record posted here
 * waits for ever on a full ring). */
static int32_t submit_failed(pf_xfer_peer *p, xfer_slot *s, int32_t rc) {
  rdma_peer *rp = p->impl;
  rdma_slot *rs = s->impl;
  char why[PF_ERROR_TEXT_BYTES];
  pf_last_error(why, sizeof why);
  int z = 0;
  atomic_compare_exchange_strong(&rs->fail, &z, rc);
  qps_to_error(p, PF_EIO, "%s", why);
  /* A backlogged part that the poller read as postable before in_error was
   * set is posted under its QP's mutex: once each mutex has been taken,
   * posted_open counts every WR chain this batch will ever have. */
  for (uint32_t i = 0; i < rp->nqp; i++) {
    pthread_mutex_lock(&rp->qp[i].mu);
    pthread_mutex_unlock(&rp->qp[i].mu);
  }
  /* seq_cst against the poller's decrement-then-load of `fail`: if a chain
   * is still open here, its completion (later) sees `fail` and ends it. */
  if (atomic_load(&rs->posted_open) != 0) return PF_OK;
  pf_fail(rc, "%s", why);
  return rc;
}

static int32_t rdma_submit(pf_xfer_peer *p, xfer_slot *s) {
  rdma_peer *rp = p->impl;
  rdma_slot *rs = slot_state(s);
  if (!rs) return pf_fail(PF_ENOMEM, "out of memory for the slot state");
  if (s->nparts >= RDMA_IMM_PART)
    return pf_fail(PF_EINVAL, "%u parts exceed %u", s->nparts, RDMA_IMM_PART - 1);
  atomic_store(&rs->posted_open, 0);
  atomic_store(&rs->fail, 0);
  /* in_error is set only after the message is whole (qps_to_error). */
  if (atomic_load(&rp->in_error)) return pf_fail(PF_EIO, "%s", p->broken_msg);
  for (uint32_t i = 0; i < s->nparts; i++) {
    int32_t rc = post_or_queue(p, s->parts[i].lane, s, s->gen, i);
    if (rc < 0) return submit_failed(p, s, rc);
  }
  return PF_OK;
}

/* Timer thread. (s, gen) was picked as due before this call: it may have
 * ended since and its slot hold a newer batch, which must not be marked
 * (before: it was, its peer broken and the new batch left to fail). */
static void rdma_expire(pf_xfer_peer *p, xfer_slot *s, uint32_t gen) {
  if (!xfer_enter(s, gen)) return;
  rdma_slot *rs = s->impl;
  atomic_store(&s->expiring, 1);
  int z = 0;
  atomic_compare_exchange_strong(&rs->fail, &z, PF_ETIMEDOUT);
  unsigned long long tag = s->tag;
  unsigned long long ms =
      (atomic_load_explicit(&s->deadline_ns, memory_order_relaxed) - s->submit_ns) / 1000000ull;
  xfer_leave(s);
  qps_to_error(p, PF_ETIMEDOUT, "batch tag %llu (slot %u) passed its %llu ms deadline", tag,
               s->index, ms);
  /* With nothing posted (all in a backlog) there is no flush to wait for. */
  maybe_end(p, s, gen);
}

/* Poller thread. Only the completion of a chain's last WR (RDMA_LAST_BIT)
 * ends the chain: it returns the chain's credit and closes it in
 * posted_open. Another WR of the chain completes only when it failed or was
 * flushed (one completion per WR), and its chain's last WR then completes
 * after it: it only records the failure. Before, each of those completions
 * was taken for the whole chain, so a batch could end, and its record go
 * out, while chains on other QPs were still unflushed (#403), and the QP's
 * credit grew past its send queue. */
static void on_send_wc(pf_xfer_peer *p, rdma_qp *q, const struct ibv_wc *wc) {
  rdma_peer *rp = p->impl;
  uint32_t gen = (uint32_t)(wc->wr_id >> 32);
  uint32_t slot = (uint32_t)(wc->wr_id >> 24) & 0xff;
  uint32_t part = (uint32_t)wc->wr_id & RDMA_PART_MASK;
  int last = (wc->wr_id & RDMA_LAST_BIT) != 0;
  xfer_slot *s = &p->slots[slot];
  rdma_slot *rs = s->impl; /* the batch lives: this chain is still open */
  if (wc->status != IBV_WC_SUCCESS) {
    int flushed = wc->status == IBV_WC_WR_FLUSH_ERR;
    int z = 0;
    atomic_compare_exchange_strong(&rs->fail, &z, flushed ? cancelled_status(p) : PF_EIO);
    if (!flushed)
      qps_to_error(p, PF_EIO, "a work request of batch tag %llu on QP %u (%s) failed: %s (status "
                   "%d, vendor error 0x%x)", (unsigned long long)s->tag,
                   (uint32_t)(q - rp->qp), q->nic->name, wc_status_name(wc->status),
                   wc->status, wc->vendor_err);
  }
  if (!last) return;
  pthread_mutex_lock(&q->mu);
  q->credit += part == RDMA_IMM_PART ? 1 : s->parts[part].n;
  pthread_mutex_unlock(&q->mu);
  if (wc->status == IBV_WC_SUCCESS && part != RDMA_IMM_PART) {
    unsigned left = atomic_fetch_sub(&s->parts_left, 1) - 1;
    if (left == 1 && s->op == PF_XFER_WRITE_IMM && !atomic_load(&rs->fail)) {
      if (post_or_queue(p, 0, s, gen, RDMA_IMM_PART) < 0) {
        int z = 0;
        atomic_compare_exchange_strong(&rs->fail, &z, PF_EIO);
      }
    }
  } else if (wc->status == IBV_WC_SUCCESS) {
    atomic_fetch_sub(&s->parts_left, 1);
  }
  atomic_fetch_sub(&rs->posted_open, 1);
  maybe_end(p, s, gen);
  drain_backlog(p, q);
}

/* A completion polled from rp's CQ on NIC k: find its QP by number among
 * rp's QPs on that NIC (lanes k, k + NICs, ...; a few). */
static void on_wc(pf_xfer_ep *ep, rdma_peer *rp, uint32_t k, const struct ibv_wc *wc) {
  rdma_qp *q = NULL;
  for (uint32_t j = k; j < rp->nqp && !q; j += rp->ncq)
    if (rp->qp[j].qpn == wc->qp_num) q = &rp->qp[j];
  if (!q) return;
  if (!(wc->wr_id & RDMA_RECV_BIT)) {
    on_send_wc(rp->p, q, wc);
    return;
  }
  /* An incoming immediate (flushed receives are just dropped). */
  if (wc->status != IBV_WC_SUCCESS || wc->opcode != IBV_WC_RECV_RDMA_WITH_IMM) return;
  pf_completion c = {.tag = ep->cfg.imm_tag, .kind = PF_DONE_XFER_IMM, .index = rp->p->handle,
                     .status = PF_OK, .aux = ntohl(wc->imm_data), .value = 0};
  pf_ring_post(ep->ring, &c);
  struct ibv_recv_wr wr = {.wr_id = wc->wr_id}, *bad;
  int rc = q->nic->ctx->ops.post_recv(q->qp, &wr, &bad);
  /* One receive short, the QP would stall (RNR) on an immediate some day,
   * with no word of why: the peer breaks now, saying so. */
  if (rc)
    qps_to_error(rp->p, PF_EIO, "ibv_post_recv of a receive for immediates on QP %u (%s): %s",
                 (uint32_t)(q - rp->qp), q->nic->name, strerror(verbs_errno(rc)));
}

/* Destroys every QP of p, each under its mutex (a submit posting on it, or
 * qps_to_error moving it, never meets a freed QP; one destroyed reads as
 * NULL): a destroyed QP's WRs never touch memory again. Returns how many
 * are left (a destroy failed, logged naming the peer, the QP and why). */
static uint32_t qps_destroy(pf_xfer_peer *p) {
  rdma_peer *rp = p->impl;
  uint32_t left = 0;
  for (uint32_t i = 0; i < rp->nqp; i++) {
    rdma_qp *q = &rp->qp[i];
    pthread_mutex_lock(&q->mu);
    int e = q->qp ? ibv.destroy_qp(q->qp) : 0;
    if (e)
      fprintf(stderr, "pegaflow: rdma peer %u: ibv_destroy_qp of QP %u (%s): %s\n", p->handle,
              i, q->nic->name, strerror(verbs_errno(e)));
    if (e) left++;
    else q->qp = NULL;
    pthread_mutex_unlock(&q->mu);
  }
  return left;
}

/* Poller thread: ibv_poll_cq of rp's CQ on NIC k returned rc < 0 (an
 * overrun, IBV_EVENT_CQ_ERR, or a device error). The CQ is lost: the
 * completions it held and every later one (flushes included) never come,
 * so a batch waiting for one would never end. The peer breaks, naming the
 * NIC, the peer and rc; the poller never polls its CQs again (no spinning on
 * a CQ that fails every pass); its QPs are destroyed, which stops the NIC
 * for good (what a flush would have proven), and then every batch in flight
 * ends at once: PF_ETIMEDOUT if the timer had expired it, else PF_EIO
 * (PF_ESHUTDOWN while closing). Before, rc was taken for "no completions":
 * the batches waited for their deadlines, and past them for ever. A peer
 * not yet connected has nothing on the wire, and a connect may be moving
 * its QPs: it is only broken. */
static void cq_lost(pf_xfer_ep *ep, rdma_peer *rp, uint32_t k, int rc) {
  pf_xfer_peer *p = rp->p;
  const char *nic = ((rdma_ep *)ep->impl)->nic[k].name;
  atomic_store(&rp->detached, 1); /* set by the poller itself: no pass to wait out */
  char why[200];
  snprintf(why, sizeof why, "ibv_poll_cq of peer %u's CQ on %s returned %d: the CQ is lost "
           "(an overrun or a device error)", p->handle, nic, rc);
  if (atomic_load(&p->connected)) qps_to_error(p, PF_EIO, "%s", why);
  else xfer_peer_mark_broken(p, PF_EIO, "%s; close the peer and create it again", why);
  /* `connected` again, after `broken` is published (seq_cst): a submit that
   * sees the peer connected after this load sees it broken and refuses. */
  if (!atomic_load(&p->connected)) {
    fprintf(stderr, "pegaflow: rdma peer %u: %s; the peer is broken\n", p->handle, why);
    return;
  }
  qps_to_error(p, PF_EIO, "%s", why); /* connected meanwhile: the QPs too */
  uint32_t left = qps_destroy(p);
  if (left) {
    fprintf(stderr, "pegaflow: rdma peer %u: %s; %u of its QPs could not be destroyed, so its "
            "batches in flight end when the peer is closed\n", p->handle, why, left);
    return;
  }
  uint32_t ended = 0;
  for (uint32_t i = 0; i < PF_XFER_MAX_INFLIGHT; i++) {
    xfer_slot *s = &p->slots[i];
    if (!atomic_load(&s->armed)) continue;
    uint32_t gen = (uint32_t)(atomic_load(&s->guard) >> 32);
    ended += (uint32_t)xfer_end(p, s, gen, atomic_load(&s->expiring) ? PF_ETIMEDOUT
                                                                    : cancelled_status(p));
  }
  fprintf(stderr, "pegaflow: rdma peer %u: %s; its QPs were destroyed and its %u batch(es) in "
          "flight ended; close the peer and reconnect\n", p->handle, why, ended);
}

static void *poller_main(void *arg) {
  pf_xfer_ep *ep = arg;
  rdma_ep *r = ep->impl;
  pthread_setname_np(pthread_self(), "pf-rdma-poll"); /* top, perf, /proc: whose CPU */
  struct ibv_wc wc[32];
  /* The poller's copy of r->live, refreshed when live_version moves. */
  rdma_peer **live = NULL;
  uint32_t nlive = 0, cap = 0, seen = 0;
  int fresh = 0;
  while (!atomic_load(&r->stop)) {
    int any = 0;
    pthread_rwlock_rdlock(&ep->scan); /* listed peers stay alive this pass */
    if (!fresh || atomic_load(&r->live_version) != seen) {
      pthread_mutex_lock(&r->live_mu);
      if (r->nlive > cap) {
        rdma_peer **nl = realloc(live, r->cap_live * sizeof *nl);
        if (nl) {
          live = nl;
          cap = r->cap_live;
        }
      }
      /* Out of memory: poll nothing this pass (the old copy may hold a
       * peer being freed) and try again. */
      fresh = r->nlive <= cap;
      nlive = fresh ? r->nlive : 0;
      if (nlive) memcpy(live, r->live, nlive * sizeof *live);
      seen = atomic_load(&r->live_version);
      pthread_mutex_unlock(&r->live_mu);
    }
    for (uint32_t i = 0; i < nlive; i++) {
      rdma_peer *rp = live[i];
      if (atomic_load_explicit(&rp->detached, memory_order_relaxed)) continue;
      for (uint32_t k = 0; k < rp->ncq; k++) {
        int n = r->nic[k].ctx->ops.poll_cq(rp->cq[k], 32, wc);
        if (n < 0) {
          cq_lost(ep, rp, k, n);
          break;
        }
        for (int j = 0; j < n; j++) on_wc(ep, rp, k, &wc[j]);
        if (n > 0) any = 1;
      }
    }
    pthread_rwlock_unlock(&ep->scan);
    if (!any) usleep(RDMA_IDLE_US);
  }
  free(live);
  return NULL;
}

/* Batches of p with WR chains still on the wire (no completion polled). */
static uint32_t batches_on_wire(pf_xfer_peer *p) {
  uint32_t n = 0;
  for (uint32_t i = 0; i < PF_XFER_MAX_INFLIGHT; i++) {
    rdma_slot *rs = p->slots[i].impl;
    if (rs && atomic_load(&p->slots[i].armed) && atomic_load(&rs->posted_open)) n++;
  }
  return n;
}

/* The flushes did not come in time: keeps the poller off p's CQs (detached;
 * then one pass of `scan` for writing waits out a poller pass that polled
 * them before) and destroys p's QPs. A destroyed QP's WRs never
 * touch memory again, so the batches may end now (pf_xfer_peer_close's
 * end_all ends them with PF_ESHUTDOWN). */
static void qps_destroy_now(pf_xfer_peer *p, uint32_t on_wire) {
  pf_xfer_ep *ep = p->ep;
  rdma_ep *r = ep->impl;
  rdma_peer *rp = p->impl;
  fprintf(stderr, "pegaflow: rdma peer %u: %u batch(es) still had work requests on the wire "
          "%u ms after its QPs were moved to the error state (no flush completion came); "
          "its QPs are destroyed so that the NIC stops, and the batches end with "
          "PF_ESHUTDOWN\n", p->handle, on_wire, r->flush_wait_ms);
  atomic_store(&rp->detached, 1);
  pthread_rwlock_wrlock(&ep->scan);
  pthread_rwlock_unlock(&ep->scan);
  qps_destroy(p);
}

/* Stops p's traffic: QPs to the error state, then waits (at most the
 * endpoint's flush wait) until the poller has ended every batch with WRs on
 * the wire, after their flush; past it the QPs are destroyed. Before, the
 * wait had no deadline: a flush that never came held the close, and the
 * endpoint's, for ever. */
static void rdma_peer_shutdown(pf_xfer_peer *p) {
  rdma_peer *rp = p->impl;
  if (!rp) return;
  if (atomic_load(&p->connected)) qps_to_error(p, PF_ESHUTDOWN, "the peer is closing");
  rdma_ep *r = p->ep->impl;
  uint64_t deadline = pf_now_ns() + (uint64_t)r->flush_wait_ms * 1000000ull;
  uint32_t on_wire;
  while ((on_wire = batches_on_wire(p)) && pf_now_ns() < deadline) usleep(1000);
  if (on_wire) qps_destroy_now(p, on_wire);
}

/* Also the unwind of a create that failed part way (calloc'ed: what was
 * not made yet is NULL). The QPs go before the CQs they use. */
static void rdma_peer_free(pf_xfer_peer *p) {
  rdma_peer *rp = p->impl;
  if (!rp) return;
  peer_unlist(p->ep, rp);
  for (uint32_t i = 0; i < rp->nqp; i++) {
    if (!rp->qp[i].nic) continue; /* never made */
    if (rp->qp[i].qp) ibv.destroy_qp(rp->qp[i].qp);
    free(rp->qp[i].bl);
    pthread_mutex_destroy(&rp->qp[i].mu);
  }
  for (uint32_t k = 0; k < rp->ncq; k++) {
    int e = ibv.destroy_cq(rp->cq[k]);
    if (e)
      fprintf(stderr, "pegaflow: rdma peer %u: ibv_destroy_cq on %s: %s\n", p->handle,
              ((rdma_ep *)p->ep->impl)->nic[k].name, strerror(verbs_errno(e)));
  }
  free(rp->qp);
  free(rp);
  p->impl = NULL;
}

const xfer_ops pf_rdma_ops = {
    .name = "rdma",
    .open = rdma_open,
    .close = rdma_close,
    .peer_create = rdma_peer_create,
    .peer_info = rdma_peer_info,
    .peer_connect = rdma_peer_connect,
    .peer_shutdown = rdma_peer_shutdown,
    .peer_free = rdma_peer_free,
    .submit = rdma_submit,
    .expire = rdma_expire,
    .max_part_chunks = RDMA_PART_CHUNKS,
};
