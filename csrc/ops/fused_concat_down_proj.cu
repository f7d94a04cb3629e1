#include "dispatch.cuh"
#include "gemma4_mtp/fused_concat_down_proj.cuh"
#include "launchers.h"

namespace gemma4_mtp {

cudaError_t launch_fused_concat_down_proj(DType dtype, const DownProjParams& p, cudaStream_t stream) {
  return with_dtype(dtype, [&](auto tag) { return fused_concat_down_proj<decltype(tag)>(p, stream); });
}

}  // namespace gemma4_mtp
