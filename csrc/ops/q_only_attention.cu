#include "dispatch.cuh"
#include "gemma4_mtp/q_only_attention.cuh"
#include "launchers.h"

namespace gemma4_mtp {

int64_t prepare_attention(AttentionParams& p, int num_sms) {
  const SplitPlan plan = attention_plan(p.B, p.Q, p.Hq, p.Hkv, p.max_blocks, p.block_size, p.window, num_sms);
  p.num_splits = plan.num_splits;
  return 4 * attention::workspace_floats(p.B, p.Q, p.Hq, p.D, p.num_splits);
}

bool attention_layout_supported(DType dtype, const AttentionParams& p) {
  return with_dtype(dtype, [&](auto tag) {
           return attention_layout_ok<decltype(tag)>(p) ? cudaSuccess : cudaErrorInvalidValue;
         }) == cudaSuccess;
}

cudaError_t launch_q_only_paged_attention(DType dtype, const AttentionParams& p, cudaStream_t stream) {
  return with_dtype(dtype, [&](auto tag) { return q_only_paged_attention<decltype(tag)>(p, stream); });
}

}  // namespace gemma4_mtp
