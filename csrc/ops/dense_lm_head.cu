#include "dense_lm_head.h"
#include "dispatch.cuh"
#include "gemma4_mtp/dense_lm_head.cuh"

namespace gemma4_mtp {

int64_t prepare_dense_lm_head(DenseHeadParams& p, int num_sms) {
  p.num_ctas = dense_head_ctas(p.V, num_sms);
  return dense_head_workspace_bytes(p);
}

int64_t dense_lm_head_smem_bytes(DType dtype, int64_t Hd) {
  const size_t elem = dtype == DType::kFloat32 ? 4 : 2;
  return static_cast<int64_t>(dense_head_smem_bytes(static_cast<int>(Hd), elem));
}

cudaError_t launch_dense_lm_head(DType dtype, const DenseHeadParams& p, cudaStream_t stream) {
  return with_dtype(dtype, [&](auto tag) { return dense_lm_head<decltype(tag)>(p, stream); });
}

}  // namespace gemma4_mtp
