#include "dispatch.cuh"
#include "gemma4_mtp/softmax_sample.cuh"
#include "launchers.h"

namespace gemma4_mtp {

cudaError_t launch_softmax_sample(DType dtype, const SoftmaxSampleParams& p, cudaStream_t stream) {
  return with_dtype(dtype, [&](auto tag) { return softmax_sample<decltype(tag)>(p, stream); });
}

}  // namespace gemma4_mtp
