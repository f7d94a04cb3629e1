#include "dispatch.cuh"
#include "gemma4_mtp/fused_concat_down_proj.cuh"
#include "launchers.h"

namespace gemma4_mtp {

int64_t prepare_fused_concat_down_proj(DType dtype, DownProjParams& p, int num_sms, int64_t* counters) {
  int64_t bytes = 0;
  with_dtype(dtype, [&](auto tag) {
    bytes = down_proj_prepare<decltype(tag)>(p, num_sms, counters);
    return cudaSuccess;
  });
  return bytes;
}

cudaError_t launch_fused_concat_down_proj(DType dtype, const DownProjParams& p, cudaStream_t stream) {
  return with_dtype(dtype, [&](auto tag) { return fused_concat_down_proj<decltype(tag)>(p, stream); });
}

}  // namespace gemma4_mtp
