#include "dispatch.cuh"
#include "gemma4_mtp/tree_verify.cuh"
#include "launchers.h"

namespace gemma4_mtp {

int64_t prepare_tree_verify(TreeVerifyParams& p, int num_sms, int64_t* counter_bytes) {
  const ChunkPlan plan = tree_verify_plan(p.B, p.N, p.V, num_sms);
  p.num_chunks = plan.num_chunks;
  p.chunk = plan.chunk;
  *counter_bytes = 4 * (static_cast<int64_t>(p.B) * p.N + 1);
  return tree_verify_workspace_bytes(p.B, p.N, p.num_chunks);
}

cudaError_t launch_tree_verify(DType dtype, const TreeVerifyParams& p, cudaStream_t stream) {
  return with_dtype(dtype, [&](auto tag) { return tree_verify<decltype(tag)>(p, stream); });
}

}  // namespace gemma4_mtp
