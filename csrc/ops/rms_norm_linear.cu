#include "dispatch.cuh"
#include "gemma4_mtp/rms_norm_linear.cuh"
#include "launchers.h"

namespace gemma4_mtp {

int64_t prepare_rms_norm_glue(DType dtype, GlueParams& p, int num_sms, int64_t* workspace_bytes, int64_t* counters) {
  int64_t bytes = 0;
  with_dtype(dtype, [&](auto tag) {
    bytes = glue_prepare<decltype(tag)>(p, num_sms, workspace_bytes, counters);
    return cudaSuccess;
  });
  return bytes;
}

cudaError_t launch_rms_norm_linear(DType dtype, const GlueParams& p, cudaStream_t stream) {
  return with_dtype(dtype, [&](auto tag) { return rms_norm_linear<decltype(tag)>(p, stream); });
}

}  // namespace gemma4_mtp
