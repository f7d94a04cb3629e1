#include "dispatch.cuh"
#include "gemma4_mtp/rms_norm_linear.cuh"
#include "launchers.h"

namespace gemma4_mtp {

cudaError_t launch_rms_norm_gate_up(DType dtype, const GlueParams& p, cudaStream_t stream) {
  return with_dtype(dtype, [&](auto tag) { return rms_norm_gate_up<decltype(tag)>(p, stream); });
}

}  // namespace gemma4_mtp
