/* pf_cuda.c — CUDA backend (being written; reports ENODEV until then). */
#include "pf_internal.h"
static int32_t cuda_open(pf_engine *e, int32_t device, uint32_t workers) {
  return pf_fail(PF_ENODEV, "pf_engine_open: cuda backend not available in this build");
}
const pf_backend_ops pf_cuda_ops = {.name = "cuda", .open = cuda_open};
