/*
 * pf_verbs.h — the subset of <infiniband/verbs.h> (rdma-core v44) that the
 * RDMA transport uses, declared here so that the library has no build-time
 * dependency on libibverbs (it is loaded with dlopen at run time,
 * pf_rdma.c). tools/rdma_abi_check.sh checks every size, offset and enum
 * value against rdma-core's own header; tests/xfer/fake_ibverbs.c, the
 * test stand-in for libibverbs, implements the same declarations.
 */
#ifndef PF_VERBS_H
#define PF_VERBS_H
#include <stddef.h>
#include <stdint.h>

struct ibv_device;
struct ibv_context;
struct ibv_cq;
struct ibv_qp;
struct ibv_pd;
struct ibv_srq;
struct ibv_comp_channel;

union ibv_gid {
  uint8_t raw[16];
  struct {
    uint64_t subnet_prefix;
    uint64_t interface_id;
  } global;
};

struct ibv_sge {
  uint64_t addr;
  uint32_t length;
  uint32_t lkey;
};

struct ibv_mw_bind_info {
  void *mr;
  uint64_t addr;
  uint64_t length;
  unsigned int mw_access_flags;
};

struct ibv_send_wr {
  uint64_t wr_id;
  struct ibv_send_wr *next;
  struct ibv_sge *sg_list;
  int num_sge;
  int opcode; /* enum ibv_wr_opcode */
  unsigned int send_flags;
  uint32_t imm_data; /* network byte order */
  union {
    struct {
      uint64_t remote_addr;
      uint32_t rkey;
    } rdma;
    struct {
      uint64_t remote_addr;
      uint64_t compare_add;
      uint64_t swap;
      uint32_t rkey;
    } atomic;
    struct {
      void *ah;
      uint32_t remote_qpn;
      uint32_t remote_qkey;
    } ud;
  } wr;
  union {
    struct {
      uint32_t remote_srqn;
    } xrc;
  } qp_type;
  union {
    struct {
      void *mw;
      uint32_t rkey;
      struct ibv_mw_bind_info bind_info;
    } bind_mw;
    struct {
      void *hdr;
      uint16_t hdr_sz;
      uint16_t mss;
    } tso;
  };
};

struct ibv_recv_wr {
  uint64_t wr_id;
  struct ibv_recv_wr *next;
  struct ibv_sge *sg_list;
  int num_sge;
};

struct ibv_wc {
  uint64_t wr_id;
  int status; /* enum ibv_wc_status */
  int opcode; /* enum ibv_wc_opcode */
  uint32_t vendor_err;
  uint32_t byte_len;
  uint32_t imm_data; /* network byte order */
  uint32_t qp_num;
  uint32_t src_qp;
  unsigned int wc_flags;
  uint16_t pkey_index;
  uint16_t slid;
  uint8_t sl;
  uint8_t dlid_path_bits;
};

struct ibv_context_ops {
  void *_compat_query_device, *_compat_query_port, *_compat_alloc_pd, *_compat_dealloc_pd,
      *_compat_reg_mr, *_compat_rereg_mr, *_compat_dereg_mr, *alloc_mw, *bind_mw, *dealloc_mw,
      *_compat_create_cq;
  int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
  void *req_notify_cq, *_compat_cq_event, *_compat_resize_cq, *_compat_destroy_cq,
      *_compat_create_srq, *_compat_modify_srq, *_compat_query_srq, *_compat_destroy_srq,
      *post_srq_recv, *_compat_create_qp, *_compat_query_qp, *_compat_modify_qp,
      *_compat_destroy_qp;
  int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);
  int (*post_recv)(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr);
  void *_compat_create_ah, *_compat_destroy_ah, *_compat_attach_mcast, *_compat_detach_mcast,
      *_compat_async_event;
};

struct ibv_context {
  struct ibv_device *device;
  struct ibv_context_ops ops;
  /* cmd_fd, async_fd, num_comp_vectors, mutex, abi_compat follow (unused) */
};

/* The first members of ibv_qp / ibv_cq / ibv_mr (the rest is never read). */
struct ibv_qp_head {
  struct ibv_context *context;
  void *qp_context;
  struct ibv_pd *pd;
  struct ibv_cq *send_cq;
  struct ibv_cq *recv_cq;
  struct ibv_srq *srq;
  uint32_t handle;
  uint32_t qp_num;
};
struct ibv_cq_head {
  struct ibv_context *context;
};
struct ibv_mr {
  struct ibv_context *context;
  struct ibv_pd *pd;
  void *addr;
  size_t length;
  uint32_t handle;
  uint32_t lkey;
  uint32_t rkey;
};

struct ibv_qp_cap {
  uint32_t max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data;
};
struct ibv_qp_init_attr {
  void *qp_context;
  struct ibv_cq *send_cq;
  struct ibv_cq *recv_cq;
  struct ibv_srq *srq;
  struct ibv_qp_cap cap;
  int qp_type; /* enum ibv_qp_type */
  int sq_sig_all;
};
struct ibv_global_route {
  union ibv_gid dgid;
  uint32_t flow_label;
  uint8_t sgid_index;
  uint8_t hop_limit;
  uint8_t traffic_class;
};
struct ibv_ah_attr {
  struct ibv_global_route grh;
  uint16_t dlid;
  uint8_t sl;
  uint8_t src_path_bits;
  uint8_t static_rate;
  uint8_t is_global;
  uint8_t port_num;
};
struct ibv_qp_attr {
  int qp_state, cur_qp_state, path_mtu, path_mig_state;
  uint32_t qkey, rq_psn, sq_psn, dest_qp_num;
  unsigned int qp_access_flags;
  struct ibv_qp_cap cap;
  struct ibv_ah_attr ah_attr;
  struct ibv_ah_attr alt_ah_attr;
  uint16_t pkey_index, alt_pkey_index;
  uint8_t en_sqd_async_notify, sq_draining, max_rd_atomic, max_dest_rd_atomic, min_rnr_timer,
      port_num, timeout, retry_cnt, rnr_retry, alt_port_num, alt_timeout;
  uint32_t rate_limit;
};
/* struct _compat_ibv_port_attr: what the exported ibv_query_port fills. */
struct ibv_port_attr {
  int state, max_mtu, active_mtu, gid_tbl_len;
  uint32_t port_cap_flags, max_msg_sz, bad_pkey_cntr, qkey_viol_cntr;
  uint16_t pkey_tbl_len, lid, sm_lid;
  uint8_t lmc, max_vl_num, sm_sl, subnet_timeout, init_type_reply, active_width, active_speed,
      phys_state, link_layer, flags;
  uint16_t port_cap_flags2;
  uint8_t pad[32]; /* room for fields newer libraries may add */
};

enum { IBV_ACCESS_LOCAL_WRITE = 1, IBV_ACCESS_REMOTE_WRITE = 2, IBV_ACCESS_REMOTE_READ = 4 };
enum { IBV_WR_RDMA_WRITE = 0, IBV_WR_RDMA_WRITE_WITH_IMM = 1, IBV_WR_RDMA_READ = 4 };
enum { IBV_SEND_SIGNALED = 2 };
enum { IBV_WC_SUCCESS = 0, IBV_WC_WR_FLUSH_ERR = 5 };
enum { IBV_WC_RECV_RDMA_WITH_IMM = (1 << 7) + 1 };
enum { IBV_QPT_RC = 2 };
enum { IBV_QPS_RESET, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_SQD, IBV_QPS_SQE,
       IBV_QPS_ERR };
enum { IBV_QP_STATE = 1 << 0, IBV_QP_ACCESS_FLAGS = 1 << 3, IBV_QP_PKEY_INDEX = 1 << 4,
       IBV_QP_PORT = 1 << 5, IBV_QP_AV = 1 << 7, IBV_QP_PATH_MTU = 1 << 8,
       IBV_QP_TIMEOUT = 1 << 9, IBV_QP_RETRY_CNT = 1 << 10, IBV_QP_RNR_RETRY = 1 << 11,
       IBV_QP_RQ_PSN = 1 << 12, IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13,
       IBV_QP_MIN_RNR_TIMER = 1 << 15, IBV_QP_SQ_PSN = 1 << 16,
       IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17, IBV_QP_DEST_QPN = 1 << 20 };
enum { IBV_PORT_ACTIVE = 4 };
enum { IBV_LINK_LAYER_ETHERNET = 2 };

#endif /* PF_VERBS_H */
