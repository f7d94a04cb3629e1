#include "dispatch.cuh"
#include "gemma4_mtp/q_only_attention.cuh"
#include "launchers.h"

namespace gemma4_mtp {

int64_t prepare_attention(DType dtype, AttentionParams& p, int num_sms, int64_t* counters) {
  const int elem_bytes = dtype == DType::kFloat32 ? 4 : 2;
  p.num_splits = attention_plan_for(elem_bytes, p, num_sms).num_splits;
  *counters = attention_counters_for(elem_bytes, p);
  return 4 * attention::workspace_floats(p.B, p.Q, p.Hq, p.D, p.num_splits);
}

cudaError_t launch_q_only_paged_attention(DType dtype, const AttentionParams& p, cudaStream_t stream) {
  return with_dtype(dtype, [&](auto tag) { return q_only_paged_attention<decltype(tag)>(p, stream); });
}

}  // namespace gemma4_mtp
