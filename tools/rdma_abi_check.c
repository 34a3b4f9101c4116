/*
 * rdma_abi_check.c — compile-time proof that the ibverbs declarations in
 * csrc/pf_rdma.c (written by hand so the build needs no rdma-core headers)
 * match rdma-core's <infiniband/verbs.h>: every size, field offset and enum
 * value pf_rdma.c relies on. Run tools/rdma_abi_check.sh; it fails to
 * compile on any mismatch. MY_VERBS is the declarations block of pf_rdma.c
 * with ibv_ / IBV_ renamed to my_ibv_ / MY_IBV_.
 */
#include <stddef.h>
#include <stdint.h>
#include <infiniband/verbs.h>
#include MY_VERBS
#define SAME_SIZE(t) _Static_assert(sizeof(struct my_##t) == sizeof(struct t), #t " size")
#define SAME_OFF(t, f) _Static_assert(offsetof(struct my_##t, f) == offsetof(struct t, f), #t "." #f)
SAME_SIZE(ibv_sge); SAME_SIZE(ibv_send_wr); SAME_SIZE(ibv_recv_wr); SAME_SIZE(ibv_wc);
SAME_SIZE(ibv_qp_init_attr); SAME_SIZE(ibv_qp_attr); SAME_SIZE(ibv_ah_attr); SAME_SIZE(ibv_global_route);
SAME_SIZE(ibv_context_ops); SAME_SIZE(ibv_mr); SAME_SIZE(ibv_qp_cap);
SAME_OFF(ibv_send_wr, wr_id); SAME_OFF(ibv_send_wr, next); SAME_OFF(ibv_send_wr, sg_list); SAME_OFF(ibv_send_wr, num_sge);
SAME_OFF(ibv_send_wr, opcode); SAME_OFF(ibv_send_wr, send_flags); SAME_OFF(ibv_send_wr, imm_data); SAME_OFF(ibv_send_wr, wr);
SAME_OFF(ibv_wc, wr_id); SAME_OFF(ibv_wc, status); SAME_OFF(ibv_wc, opcode); SAME_OFF(ibv_wc, imm_data); SAME_OFF(ibv_wc, qp_num); SAME_OFF(ibv_wc, wc_flags);
SAME_OFF(ibv_context_ops, poll_cq); SAME_OFF(ibv_context_ops, post_send); SAME_OFF(ibv_context_ops, post_recv);
SAME_OFF(ibv_context, ops);
SAME_OFF(ibv_qp_attr, qp_state); SAME_OFF(ibv_qp_attr, path_mtu); SAME_OFF(ibv_qp_attr, rq_psn); SAME_OFF(ibv_qp_attr, sq_psn); SAME_OFF(ibv_qp_attr, dest_qp_num);
SAME_OFF(ibv_qp_attr, qp_access_flags); SAME_OFF(ibv_qp_attr, ah_attr); SAME_OFF(ibv_qp_attr, max_rd_atomic); SAME_OFF(ibv_qp_attr, max_dest_rd_atomic);
SAME_OFF(ibv_qp_attr, min_rnr_timer); SAME_OFF(ibv_qp_attr, port_num); SAME_OFF(ibv_qp_attr, timeout); SAME_OFF(ibv_qp_attr, retry_cnt); SAME_OFF(ibv_qp_attr, rnr_retry);
SAME_OFF(ibv_ah_attr, dlid); SAME_OFF(ibv_ah_attr, is_global); SAME_OFF(ibv_ah_attr, port_num); SAME_OFF(ibv_ah_attr, grh);
SAME_OFF(ibv_global_route, sgid_index); SAME_OFF(ibv_global_route, hop_limit);
SAME_OFF(ibv_mr, lkey); SAME_OFF(ibv_mr, rkey);
SAME_OFF(ibv_qp_init_attr, send_cq); SAME_OFF(ibv_qp_init_attr, recv_cq); SAME_OFF(ibv_qp_init_attr, cap); SAME_OFF(ibv_qp_init_attr, qp_type);
_Static_assert(offsetof(struct my_ibv_qp_head, qp_num) == offsetof(struct ibv_qp, qp_num), "qp_num");
_Static_assert(offsetof(struct my_ibv_port_attr, lid) == offsetof(struct ibv_port_attr, lid), "port lid");
_Static_assert(offsetof(struct my_ibv_port_attr, link_layer) == offsetof(struct ibv_port_attr, link_layer), "port link_layer");
_Static_assert(offsetof(struct my_ibv_port_attr, active_mtu) == offsetof(struct ibv_port_attr, active_mtu), "port mtu");
_Static_assert(MY_IBV_WC_RECV_RDMA_WITH_IMM == IBV_WC_RECV_RDMA_WITH_IMM, "wc opcode");
_Static_assert(MY_IBV_WR_RDMA_READ == IBV_WR_RDMA_READ && MY_IBV_WR_RDMA_WRITE_WITH_IMM == IBV_WR_RDMA_WRITE_WITH_IMM, "wr opcodes");
_Static_assert(MY_IBV_QP_DEST_QPN == IBV_QP_DEST_QPN && MY_IBV_QP_MAX_DEST_RD_ATOMIC == IBV_QP_MAX_DEST_RD_ATOMIC && MY_IBV_QP_SQ_PSN == IBV_QP_SQ_PSN, "masks");
_Static_assert(MY_IBV_QPS_ERR == IBV_QPS_ERR && MY_IBV_QPS_RTS == IBV_QPS_RTS, "states");
_Static_assert(MY_IBV_WC_WR_FLUSH_ERR == IBV_WC_WR_FLUSH_ERR, "flush");
_Static_assert(MY_IBV_LINK_LAYER_ETHERNET == IBV_LINK_LAYER_ETHERNET && MY_IBV_PORT_ACTIVE == IBV_PORT_ACTIVE, "port enums");
int main(void) { return 0; }
