/*
 * fake_ibverbs.c — a software stand-in for libibverbs.so.1, loaded by the
 * RDMA transport through PEGAFLOW_LIBIBVERBS, so that its data path runs on
 * machines without an RDMA device (every machine we have). It is a model,
 * not a NIC: it proves pf_rdma.c's bookkeeping against the verbs rules it
 * implements, not against hardware.
 *
 * One device, "pf_fake0" (port 1, InfiniBand link layer, LID 1). Every QP
 * lives in this process, so a peer pair is two endpoints of one process:
 * READ / WRITE copy between the two pools with memcpy, checking the lkey and
 * the rkey against the registered ranges; WRITE_WITH_IMM consumes a receive
 * of the destination QP and completes it there with the immediate. The
 * rules modelled (IBTA 10.7.3.1, as rxe and rdmavt implement them):
 *   - a successful WR makes a completion only when signaled;
 *   - a WR that fails, and every WR flushed once its QP is in the error
 *     state, makes a completion whether signaled or not (WR_FLUSH_ERR for
 *     the flushed ones), one per WR, in posting order;
 *   - a WR that fails moves its QP to the error state;
 *   - send-queue entries are freed when their completion is polled (an
 *     unsignaled WR's with the next signaled one); posting beyond
 *     max_send_wr fails with ENOMEM;
 *   - a CQ holds the `cqe` entries it was created with, no more: a
 *     completion that finds it full overruns it, as rdma-core reports it
 *     (async event IBV_EVENT_CQ_ERR): that completion and every later one
 *     are lost and ibv_poll_cq fails from then on (the CQ is unusable);
 *     fake_fail_poll makes a CQ fail so on demand (a device error);
 *   - QP state transitions follow the QP state machine (RESET -> INIT ->
 *     RTR -> RTS; RESET and ERR from any state), anything else is EINVAL;
 *     moving to RESET empties both queues without completions (and, as a
 *     provider does, drops the QP's completions still in its CQ);
 *   - ibv_create_cq of more entries than the device's max_cqe fails
 *     (EINVAL; mlx5's 4194303, env PF_FAKE_IBV_MAX_CQE); ibv_destroy_cq of a
 *     CQ that a QP still uses fails (EBUSY); ibv_post_recv on a QP in RESET
 *     fails (EINVAL).
 *
 * The test's controls (fake_*, below) park WRs as a stalled NIC would, make
 * a post, a receive post, a QP state change or a CQ's polls fail, hold back
 * a QP's flush completions, keep the pollers from seeing completions (a
 * poller slower than the NIC), and count what happened.
 * One mutex guards everything; poll_cq is the only call the pollers make.
 * The structures are csrc/pf_verbs.h's (rdma-core v44's layouts).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pf_verbs.h" /* the verbs structures the transport declares (csrc/) */

/* The opcodes, statuses and states the model uses, by short names (pf_verbs.h has the
 * transport's; these add the statuses it only reads as numbers). */
enum { WR_WRITE = 0, WR_WRITE_IMM = 1, WR_READ = 4 };
enum { SEND_SIGNALED = 2 };
enum { WC_SUCCESS = 0, WC_LOC_PROT_ERR = 4, WC_FLUSH = 5, WC_REM_ACCESS_ERR = 10,
       WC_RETRY_EXC_ERR = 12, WC_RNR_RETRY_EXC_ERR = 13 };
enum { WC_OP_RDMA_WRITE = 1, WC_OP_RDMA_READ = 2, WC_OP_RECV_RDMA_WITH_IMM = (1 << 7) + 1 };
enum { QPS_RESET, QPS_INIT, QPS_RTR, QPS_RTS, QPS_SQD, QPS_SQE, QPS_ERR };

/* ---- the model ------------------------------------------------------------ */
typedef struct fake_cqe {
  struct ibv_wc wc;
  struct fake_qp *qp; /* whose send queue it frees entries of */
  uint32_t frees;     /* send-queue entries freed when polled */
  int send;           /* a send WR's completion (else a receive's) */
} fake_cqe;

typedef struct fake_cq {
  struct ibv_context *context; /* first member, as ibv_cq */
  fake_cqe *q;
  uint32_t head, len, cap;
  int depth;      /* entries it holds (ibv_create_cq's cqe) */
  int overrun;    /* a completion found it full: unusable, later ones lost */
  int users;      /* QPs whose send or receive CQ it is */
  int fail_rc;    /* < 0: ibv_poll_cq returns it from now on (fake_fail_poll) */
  uint64_t polls; /* poll_cq calls */
} fake_cq;

typedef struct fake_wr {
  uint64_t wr_id;
  int opcode, signaled;
  uint64_t addr;
  uint32_t len, lkey;
  uint64_t remote_addr;
  uint32_t rkey, imm;
} fake_wr;

typedef struct fake_qp {
  struct ibv_qp_head head; /* first member, as ibv_qp */
  int ordinal;             /* creation order in this process */
  int state;
  uint32_t dest;
  fake_cq *cq;
  uint32_t max_send_wr;
  uint32_t outstanding;  /* send-queue entries in use */
  uint32_t unsignaled;   /* successful unsignaled WRs not yet freed */
  fake_wr *parked;       /* WRs a stalled NIC has not run yet, in order */
  uint32_t nparked, cap_parked;
  uint64_t *recv;        /* posted receive wr_ids */
  uint32_t nrecv, cap_recv;
  int defer_flush;       /* keep this QP's flush completions until delivered */
  fake_cqe *deferred;
  uint32_t ndeferred, cap_deferred;
  struct fake_qp *next;
} fake_qp;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static fake_qp *qps;
static int next_ordinal;
static uint32_t next_qpn = 0x100;
static uint32_t next_key = 0x1000;
static struct ibv_mr *mrs[64];
static int hold;            /* park new WRs */
static int fail_after = -1; /* successful posts left before one fails (-1: none) */
static int fail_drain;      /* the failing post first waits for its CQ to be polled empty */
static uint64_t n_flushed, n_posts, n_failed_posts, n_overruns, n_lost, n_failed_polls;
static int recv_fail_after = -1; /* successful post_recv calls left before one fails */
static int poll_paused;          /* poll_cq finds nothing (a poller slower than the NIC) */
/* Armed modify_qp failures: the next change of QP `ordinal` to `state`. */
#define FAKE_MODIFY_FAILS 8
static struct {
  int armed, ordinal, state;
} modify_fails[FAKE_MODIFY_FAILS];

static char device_name[] = "pf_fake0";
static struct ibv_device *device_list[2] = {(struct ibv_device *)device_name, NULL};

#define GROW(arr, n, cap)                                            \
  do {                                                               \
    if ((n) == (cap)) {                                              \
      uint32_t nc = (cap) ? (cap) * 2 : 64;                          \
      void *na = realloc((arr), nc * sizeof *(arr));                 \
      if (!na) abort();                                              \
      (arr) = na;                                                    \
      (cap) = nc;                                                    \
    }                                                                \
  } while (0)

static void cq_push(fake_cq *cq, const fake_cqe *e) {
  if (cq->overrun) {
    n_lost++;
    return;
  }
  if ((int)cq->len >= cq->depth) { /* IBV_EVENT_CQ_ERR: the CQ is gone */
    cq->overrun = 1;
    n_overruns++;
    n_lost++;
    return;
  }
  if (cq->len == cq->cap) {
    uint32_t nc = cq->cap ? cq->cap * 2 : 256;
    fake_cqe *nq = malloc(nc * sizeof *nq);
    if (!nq) abort();
    for (uint32_t i = 0; i < cq->len; i++) nq[i] = cq->q[(cq->head + i) % cq->cap];
    free(cq->q);
    cq->q = nq;
    cq->head = 0;
    cq->cap = nc;
  }
  cq->q[(cq->head + cq->len) % cq->cap] = *e;
  cq->len++;
}

static void complete(fake_qp *qp, uint64_t wr_id, int status, int opcode, uint32_t frees,
                     int send) {
  fake_cqe e = {.wc = {.wr_id = wr_id, .status = status, .opcode = opcode,
                       .qp_num = qp->head.qp_num},
                .qp = qp, .frees = frees, .send = send};
  if (status == WC_FLUSH) {
    n_flushed++;
    if (qp->defer_flush) {
      GROW(qp->deferred, qp->ndeferred, qp->cap_deferred);
      qp->deferred[qp->ndeferred++] = e;
      return;
    }
  }
  cq_push(qp->cq, &e);
}

/* The QP enters the error state: every parked WR and every receive flushes,
 * one completion each. */
static void to_error(fake_qp *qp) {
  qp->state = QPS_ERR;
  for (uint32_t i = 0; i < qp->nparked; i++)
    complete(qp, qp->parked[i].wr_id, WC_FLUSH, 0, 1, 1);
  qp->nparked = 0;
  /* The unsignaled WRs that ran before are freed with the first flush. */
  if (qp->unsignaled) {
    qp->outstanding -= qp->unsignaled;
    qp->unsignaled = 0;
  }
  for (uint32_t i = 0; i < qp->nrecv; i++) complete(qp, qp->recv[i], WC_FLUSH, 0, 0, 0);
  qp->nrecv = 0;
}

static struct ibv_mr *mr_find(uint32_t key, int remote, uint64_t addr, uint64_t len) {
  for (int i = 0; i < 64; i++) {
    struct ibv_mr *m = mrs[i];
    if (!m || (remote ? m->rkey : m->lkey) != key) continue;
    uint64_t base = (uint64_t)(uintptr_t)m->addr;
    if (addr >= base && len <= m->length && addr - base <= m->length - len) return m;
  }
  return NULL;
}

static fake_qp *qp_by_num(uint32_t qpn) {
  for (fake_qp *q = qps; q; q = q->next)
    if (q->head.qp_num == qpn) return q;
  return NULL;
}

/* Runs one WR (the QP is ready). 0 = success, else the completion status. */
static int run_wr(fake_qp *qp, const fake_wr *w) {
  if (w->len && !mr_find(w->lkey, 0, w->addr, w->len)) return WC_LOC_PROT_ERR;
  if (w->len && !mr_find(w->rkey, 1, w->remote_addr, w->len)) return WC_REM_ACCESS_ERR;
  fake_qp *dst = qp_by_num(qp->dest);
  if (!dst || dst->state < QPS_RTR || dst->state == QPS_ERR) return WC_RETRY_EXC_ERR;
  void *local = (void *)(uintptr_t)w->addr, *remote = (void *)(uintptr_t)w->remote_addr;
  if (w->opcode == WR_READ) memcpy(local, remote, w->len);
  else if (w->len) memcpy(remote, local, w->len);
  if (w->opcode == WR_WRITE_IMM) {
    if (!dst->nrecv) return WC_RNR_RETRY_EXC_ERR;
    uint64_t rid = dst->recv[0];
    memmove(dst->recv, dst->recv + 1, (dst->nrecv - 1) * sizeof *dst->recv);
    dst->nrecv--;
    fake_cqe e = {.wc = {.wr_id = rid, .status = WC_SUCCESS, .opcode = WC_OP_RECV_RDMA_WITH_IMM,
                         .imm_data = w->imm, .qp_num = dst->head.qp_num,
                         .src_qp = qp->head.qp_num}};
    cq_push(dst->cq, &e);
  }
  return 0;
}

/* Runs w now, or flushes it if the QP is in the error state. */
static void execute(fake_qp *qp, const fake_wr *w) {
  if (qp->state == QPS_ERR) {
    complete(qp, w->wr_id, WC_FLUSH, 0, 1, 1);
    return;
  }
  int st = run_wr(qp, w);
  if (st) {
    complete(qp, w->wr_id, st, 0, 1 + qp->unsignaled, 1);
    qp->unsignaled = 0;
    to_error(qp);
    return;
  }
  if (w->signaled) {
    complete(qp, w->wr_id, WC_SUCCESS, w->opcode == WR_READ ? WC_OP_RDMA_READ : WC_OP_RDMA_WRITE,
             1 + qp->unsignaled, 1);
    qp->unsignaled = 0;
  } else {
    qp->unsignaled++;
  }
}

/* ---- the verbs entry points ------------------------------------------------ */
static int fake_poll_cq(struct ibv_cq *cqp, int n, struct ibv_wc *wc) {
  fake_cq *cq = (fake_cq *)cqp;
  pthread_mutex_lock(&mu);
  if (cq->overrun || cq->fail_rc < 0) {
    n_failed_polls++;
    int rc = cq->fail_rc < 0 ? cq->fail_rc : -1;
    pthread_mutex_unlock(&mu);
    return rc;
  }
  if (poll_paused) {
    pthread_mutex_unlock(&mu);
    return 0;
  }
  cq->polls++;
  int k = 0;
  while (k < n && cq->len) {
    fake_cqe *e = &cq->q[cq->head];
    wc[k++] = e->wc;
    if (e->qp) e->qp->outstanding -= e->frees;
    cq->head = (cq->head + 1) % cq->cap;
    cq->len--;
  }
  pthread_mutex_unlock(&mu);
  return k;
}

/* With mu held: waits (unlocking meanwhile) until the poller calls poll_cq
 * again after `seen` calls; 1 once it did, 0 after about a second (no
 * poller: the endpoint is closing). */
static int seen_since(fake_cq *cq, uint64_t seen) {
  for (int i = 0; i < 100000 && cq->polls < seen + 1; i++) {
    pthread_mutex_unlock(&mu);
    usleep(10);
    pthread_mutex_lock(&mu);
  }
  return cq->polls >= seen + 1;
}

/* With mu held: waits until cq is empty and its poller has come back for
 * more after taking the last completion, so whatever that completion made
 * the transport do is done. */
static void wait_polled(fake_cq *cq) {
  for (int i = 0; i < 100000; i++) {
    uint64_t seen = cq->polls;
    if (cq->len == 0 && seen_since(cq, seen) && cq->len == 0) return;
    pthread_mutex_unlock(&mu);
    usleep(10);
    pthread_mutex_lock(&mu);
  }
}

static int fake_post_send(struct ibv_qp *qpp, struct ibv_send_wr *wr, struct ibv_send_wr **bad) {
  fake_qp *qp = (fake_qp *)qpp;
  pthread_mutex_lock(&mu);
  n_posts++;
  if (fail_after == 0) {
    fail_after = -1;
    if (fail_drain) wait_polled(qp->cq);
    n_failed_posts++;
    *bad = wr;
    pthread_mutex_unlock(&mu);
    /* As rdma-core's providers: the errno value is returned, errno itself is
     * left as it was (here: set to something else, so a reader of errno is
     * caught). */
    errno = EAGAIN;
    return ENOMEM;
  }
  if (fail_after > 0) fail_after--;
  uint32_t n = 0;
  for (struct ibv_send_wr *w = wr; w; w = w->next) n++;
  if (qp->state != QPS_RTS && qp->state != QPS_ERR) {
    *bad = wr;
    pthread_mutex_unlock(&mu);
    errno = EINVAL;
    return EINVAL;
  }
  if (qp->outstanding + n > qp->max_send_wr) { /* the transport's credit is wrong */
    *bad = wr;
    pthread_mutex_unlock(&mu);
    errno = ENOMEM;
    return ENOMEM;
  }
  qp->outstanding += n;
  for (struct ibv_send_wr *w = wr; w; w = w->next) {
    fake_wr f = {.wr_id = w->wr_id, .opcode = w->opcode,
                 .signaled = (w->send_flags & SEND_SIGNALED) != 0,
                 .remote_addr = w->wr.rdma.remote_addr, .rkey = w->wr.rdma.rkey,
                 .imm = w->imm_data};
    if (w->num_sge > 0) {
      f.addr = w->sg_list[0].addr;
      f.len = w->sg_list[0].length;
      f.lkey = w->sg_list[0].lkey;
    }
    if (hold && qp->state != QPS_ERR) {
      GROW(qp->parked, qp->nparked, qp->cap_parked);
      qp->parked[qp->nparked++] = f;
    } else {
      execute(qp, &f);
    }
  }
  pthread_mutex_unlock(&mu);
  return 0;
}

static int fake_post_recv(struct ibv_qp *qpp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad) {
  fake_qp *qp = (fake_qp *)qpp;
  pthread_mutex_lock(&mu);
  int err = 0;
  if (recv_fail_after == 0) {
    recv_fail_after = -1;
    err = ENOMEM;
  } else if (qp->state == QPS_RESET) {
    err = EINVAL;
  }
  if (err) {
    *bad = wr;
    pthread_mutex_unlock(&mu);
    errno = err;
    return err;
  }
  if (recv_fail_after > 0) recv_fail_after--;
  for (struct ibv_recv_wr *w = wr; w; w = w->next) {
    if (qp->state == QPS_ERR) {
      complete(qp, w->wr_id, WC_FLUSH, 0, 0, 0);
      continue;
    }
    GROW(qp->recv, qp->nrecv, qp->cap_recv);
    qp->recv[qp->nrecv++] = w->wr_id;
  }
  pthread_mutex_unlock(&mu);
  return 0;
}

struct ibv_device **ibv_get_device_list(int *num) {
  const char *e = getenv("PF_FAKE_IBV_NO_DEVICE");
  if (num) *num = e && *e ? 0 : 1;
  return device_list;
}
void ibv_free_device_list(struct ibv_device **list) { (void)list; }
const char *ibv_get_device_name(struct ibv_device *dev) { return (const char *)dev; }

struct ibv_context *ibv_open_device(struct ibv_device *dev) {
  struct ibv_context *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->device = dev;
  c->ops.poll_cq = fake_poll_cq;
  c->ops.post_send = fake_post_send;
  c->ops.post_recv = fake_post_recv;
  return c;
}
int ibv_close_device(struct ibv_context *ctx) {
  free(ctx);
  return 0;
}
int ibv_query_port(struct ibv_context *ctx, uint8_t port, struct ibv_port_attr *attr) {
  (void)ctx;
  if (port != 1) return EINVAL;
  memset(attr, 0, sizeof *attr);
  attr->state = 4;      /* ACTIVE */
  attr->active_mtu = 5; /* 4096 */
  attr->max_mtu = 5;
  attr->lid = 1;
  attr->link_layer = 1; /* InfiniBand: no GID needed */
  return 0;
}
int ibv_query_gid(struct ibv_context *ctx, uint8_t port, int index, union ibv_gid *gid) {
  (void)ctx, (void)port, (void)index;
  memset(gid, 0, sizeof *gid);
  return 0;
}
void *ibv_alloc_pd(struct ibv_context *ctx) {
  void **pd = calloc(1, sizeof *pd);
  if (pd) *pd = ctx;
  return pd;
}
int ibv_dealloc_pd(void *pd) {
  free(pd);
  return 0;
}
struct ibv_mr *ibv_reg_mr(void *pd, void *addr, size_t len, int access) {
  (void)access;
  struct ibv_mr *m = calloc(1, sizeof *m);
  if (!m) return NULL;
  pthread_mutex_lock(&mu);
  int slot = -1;
  for (int i = 0; i < 64 && slot < 0; i++)
    if (!mrs[i]) slot = i;
  if (slot < 0) {
    pthread_mutex_unlock(&mu);
    free(m);
    errno = ENOMEM;
    return NULL;
  }
  m->context = *(struct ibv_context **)pd;
  m->pd = pd;
  m->addr = addr;
  m->length = len;
  m->lkey = next_key++;
  m->rkey = next_key++;
  mrs[slot] = m;
  pthread_mutex_unlock(&mu);
  return m;
}
int ibv_dereg_mr(struct ibv_mr *m) {
  pthread_mutex_lock(&mu);
  for (int i = 0; i < 64; i++)
    if (mrs[i] == m) mrs[i] = NULL;
  pthread_mutex_unlock(&mu);
  free(m);
  return 0;
}
/* The device's max_cqe: mlx5's, or env PF_FAKE_IBV_MAX_CQE. */
#define FAKE_MAX_CQE 4194303
struct ibv_cq *ibv_create_cq(struct ibv_context *ctx, int cqe, void *cq_ctx, void *ch, int vec) {
  (void)cq_ctx, (void)ch, (void)vec;
  const char *m = getenv("PF_FAKE_IBV_MAX_CQE");
  int max = m && *m ? atoi(m) : FAKE_MAX_CQE;
  if (cqe < 1 || cqe > max) {
    errno = EINVAL;
    return NULL;
  }
  fake_cq *cq = calloc(1, sizeof *cq);
  if (!cq) return NULL;
  cq->context = ctx;
  cq->depth = cqe;
  return (struct ibv_cq *)cq;
}
int ibv_destroy_cq(struct ibv_cq *cqp) {
  fake_cq *cq = (fake_cq *)cqp;
  pthread_mutex_lock(&mu);
  int users = cq->users;
  pthread_mutex_unlock(&mu);
  if (users) {
    errno = EBUSY;
    return EBUSY;
  }
  free(cq->q);
  free(cq);
  return 0;
}
struct ibv_qp *ibv_create_qp(void *pd, struct ibv_qp_init_attr *attr) {
  fake_qp *qp = calloc(1, sizeof *qp);
  if (!qp) return NULL;
  pthread_mutex_lock(&mu);
  qp->head.context = *(struct ibv_context **)pd;
  qp->head.pd = pd;
  qp->head.send_cq = attr->send_cq;
  qp->head.recv_cq = attr->recv_cq;
  qp->head.qp_num = next_qpn++;
  qp->ordinal = next_ordinal++;
  qp->cq = (fake_cq *)attr->send_cq;
  qp->cq->users++;
  qp->max_send_wr = attr->cap.max_send_wr;
  qp->state = QPS_RESET;
  qp->next = qps;
  qps = qp;
  pthread_mutex_unlock(&mu);
  return (struct ibv_qp *)qp;
}
/* With mu held: drops the completions of qp still in its CQ. */
static void cq_clean(fake_qp *qp) {
  fake_cq *cq = qp->cq;
  uint32_t keep = 0;
  for (uint32_t i = 0; i < cq->len; i++) {
    fake_cqe e = cq->q[(cq->head + i) % cq->cap];
    if (e.wc.qp_num == qp->head.qp_num) continue;
    cq->q[(cq->head + keep++) % cq->cap] = e;
  }
  cq->len = keep;
}

/* The QP state machine's transitions (IBTA 10.3.1, ib_modify_qp_is_ok). */
static int transition_ok(int from, int to) {
  switch (to) {
  case QPS_RESET:
  case QPS_ERR: return 1;
  case QPS_INIT: return from == QPS_RESET || from == QPS_INIT;
  case QPS_RTR: return from == QPS_INIT;
  case QPS_RTS: return from == QPS_RTR || from == QPS_RTS;
  default: return 0;
  }
}

int ibv_modify_qp(struct ibv_qp *qpp, struct ibv_qp_attr *attr, int mask) {
  fake_qp *qp = (fake_qp *)qpp;
  pthread_mutex_lock(&mu);
  if (mask & 1) {
    int to = attr->qp_state, err = transition_ok(qp->state, to) ? 0 : EINVAL;
    for (int i = 0; i < FAKE_MODIFY_FAILS && !err; i++)
      if (modify_fails[i].armed && modify_fails[i].ordinal == qp->ordinal &&
          modify_fails[i].state == to) {
        modify_fails[i].armed = 0;
        err = EINVAL;
      }
    if (err) {
      pthread_mutex_unlock(&mu);
      errno = err;
      return err;
    }
    if (to == QPS_RTR) qp->dest = attr->dest_qp_num;
    if (to == QPS_ERR && qp->state != QPS_ERR) to_error(qp);
    if (to == QPS_RESET) { /* both queues emptied, no completions */
      qp->nparked = qp->nrecv = qp->ndeferred = 0;
      qp->outstanding = qp->unsignaled = 0;
      cq_clean(qp);
    }
    qp->state = to;
  }
  pthread_mutex_unlock(&mu);
  return 0;
}
/* As a provider does on destroy, the QP's completions still queued go. */
int ibv_destroy_qp(struct ibv_qp *qpp) {
  fake_qp *qp = (fake_qp *)qpp;
  pthread_mutex_lock(&mu);
  for (fake_qp **pp = &qps; *pp; pp = &(*pp)->next)
    if (*pp == qp) {
      *pp = qp->next;
      break;
    }
  cq_clean(qp);
  qp->cq->users--;
  pthread_mutex_unlock(&mu);
  free(qp->parked);
  free(qp->recv);
  free(qp->deferred);
  free(qp);
  return 0;
}

/* ---- the test's controls ---------------------------------------------------- */
/* New WRs are parked (1), as a NIC that stalled, or run at once (0). */
void fake_hold(int32_t on) {
  pthread_mutex_lock(&mu);
  hold = on;
  pthread_mutex_unlock(&mu);
}
/* Runs every parked WR in posting order; returns how many. */
int32_t fake_release(void) {
  pthread_mutex_lock(&mu);
  int32_t n = 0;
  for (fake_qp *q = qps; q; q = q->next) {
    uint32_t k = q->nparked;
    fake_wr *w = q->parked;
    q->parked = NULL;
    q->nparked = q->cap_parked = 0;
    for (uint32_t i = 0; i < k; i++, n++) execute(q, &w[i]);
    free(w);
  }
  pthread_mutex_unlock(&mu);
  return n;
}
/* WRs parked now. */
int32_t fake_parked(void) {
  pthread_mutex_lock(&mu);
  int32_t n = 0;
  for (fake_qp *q = qps; q; q = q->next) n += (int32_t)q->nparked;
  pthread_mutex_unlock(&mu);
  return n;
}
/* After `after` more successful ibv_post_send calls, the next one fails
 * (ENOMEM); `drain`: it first waits until its CQ was polled empty. */
void fake_fail_post(int32_t after, int32_t drain) {
  pthread_mutex_lock(&mu);
  fail_after = after;
  fail_drain = drain;
  pthread_mutex_unlock(&mu);
}
/* The QP with `ordinal` keeps its flush completions until fake_deliver_flush
 * (as a NIC that is slow to flush one QP). 0 = done, -1 = no such QP. */
int32_t fake_defer_flush(int32_t ordinal) {
  pthread_mutex_lock(&mu);
  int32_t rc = -1;
  for (fake_qp *q = qps; q; q = q->next)
    if (q->ordinal == ordinal) {
      q->defer_flush = 1;
      rc = 0;
    }
  pthread_mutex_unlock(&mu);
  return rc;
}
/* Waits up to `ms` until the CQ of the QP with `ordinal` is empty and its
 * poller came back for more (so the transport has handled every completion
 * queued before this call). 1 = so, 0 = not within ms, -1 = no such QP. */
int32_t fake_wait_polled(int32_t ordinal, int32_t ms) {
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  pthread_mutex_lock(&mu);
  fake_cq *cq = NULL;
  for (fake_qp *q = qps; q; q = q->next)
    if (q->ordinal == ordinal) cq = q->cq;
  int32_t rc = cq ? 0 : -1;
  while (cq) {
    uint64_t seen = cq->polls;
    if (cq->len == 0 && seen_since(cq, seen)) {
      rc = 1;
      break;
    }
    clock_gettime(CLOCK_MONOTONIC, &t);
    if ((t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000 >= ms) break;
    pthread_mutex_unlock(&mu);
    sched_yield();
    pthread_mutex_lock(&mu);
  }
  pthread_mutex_unlock(&mu);
  return rc;
}
/* Hands every deferred flush completion to its CQ; returns how many were
 * of send WRs. */
int32_t fake_deliver_flush(void) {
  pthread_mutex_lock(&mu);
  int32_t n = 0;
  for (fake_qp *q = qps; q; q = q->next) {
    for (uint32_t i = 0; i < q->ndeferred; i++) {
      n += q->deferred[i].send;
      cq_push(q->cq, &q->deferred[i]);
    }
    q->ndeferred = 0;
    q->defer_flush = 0;
  }
  pthread_mutex_unlock(&mu);
  return n;
}
/* Flush completions of send WRs held back now (receives flush too). */
int32_t fake_deferred(void) {
  pthread_mutex_lock(&mu);
  int32_t n = 0;
  for (fake_qp *q = qps; q; q = q->next)
    for (uint32_t i = 0; i < q->ndeferred; i++) n += q->deferred[i].send;
  pthread_mutex_unlock(&mu);
  return n;
}
/* QPs created so far (the next QP's ordinal). */
int32_t fake_qp_count(void) {
  pthread_mutex_lock(&mu);
  int32_t n = next_ordinal;
  pthread_mutex_unlock(&mu);
  return n;
}
/* State of the QP with `ordinal` (-1: none such, destroyed). */
int32_t fake_qp_state(int32_t ordinal) {
  pthread_mutex_lock(&mu);
  int32_t st = -1;
  for (fake_qp *q = qps; q; q = q->next)
    if (q->ordinal == ordinal) st = q->state;
  pthread_mutex_unlock(&mu);
  return st;
}
/* Counters: 0 posts, 1 failed posts, 2 flush completions, 3 CQ overruns
 * (IBV_EVENT_CQ_ERR), 4 completions lost to an overrun, 5 ibv_poll_cq calls
 * that failed (returned a negative value). */
uint64_t fake_count(int32_t which) {
  pthread_mutex_lock(&mu);
  uint64_t v = which == 0 ? n_posts : which == 1 ? n_failed_posts : which == 2 ? n_flushed
               : which == 3 ? n_overruns : which == 4 ? n_lost : n_failed_polls;
  pthread_mutex_unlock(&mu);
  return v;
}
/* After `after` more successful ibv_post_recv calls, the next one fails
 * (ENOMEM). */
void fake_fail_recv(int32_t after) {
  pthread_mutex_lock(&mu);
  recv_fail_after = after;
  pthread_mutex_unlock(&mu);
}
/* The next ibv_modify_qp of the QP with `ordinal` (it may not exist yet) to
 * `state` fails (EINVAL), once. 0 = armed, -1 = too many armed. */
int32_t fake_fail_modify(int32_t ordinal, int32_t state) {
  pthread_mutex_lock(&mu);
  int32_t rc = -1;
  for (int i = 0; i < FAKE_MODIFY_FAILS && rc < 0; i++)
    if (!modify_fails[i].armed) {
      modify_fails[i].armed = 1;
      modify_fails[i].ordinal = ordinal;
      modify_fails[i].state = state;
      rc = 0;
    }
  pthread_mutex_unlock(&mu);
  return rc;
}
/* 1: ibv_poll_cq finds every CQ empty (completions pile up in the CQs, as
 * under a poller slower than the NIC); 0: it takes them again. */
void fake_pause_poll(int32_t on) {
  pthread_mutex_lock(&mu);
  poll_paused = on;
  pthread_mutex_unlock(&mu);
}
/* From its next call on, ibv_poll_cq of the CQ of the QP with `ordinal`
 * returns `rc` (< 0) and takes nothing: the CQ is lost, as after an
 * overrun or a device error (its completions, and every later one, never
 * come). 0 = armed, -1 = no such QP or rc >= 0. */
int32_t fake_fail_poll(int32_t ordinal, int32_t rc) {
  pthread_mutex_lock(&mu);
  int32_t ok = -1;
  for (fake_qp *q = qps; q && rc < 0; q = q->next)
    if (q->ordinal == ordinal) {
      q->cq->fail_rc = rc;
      ok = 0;
    }
  pthread_mutex_unlock(&mu);
  return ok;
}
/* Back to a plain NIC: nothing parked or held, no failure armed, polling on. */
void fake_reset(void) {
  pthread_mutex_lock(&mu);
  hold = 0;
  fail_after = -1;
  fail_drain = 0;
  recv_fail_after = -1;
  poll_paused = 0;
  memset(modify_fails, 0, sizeof modify_fails);
  pthread_mutex_unlock(&mu);
}
