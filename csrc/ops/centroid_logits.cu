#include "dispatch.cuh"
#include "gemma4_mtp/centroid_logits.cuh"
#include "launchers.h"

namespace gemma4_mtp {

static_assert(kMaxCentroids == centroid::kMaxCentroids, "launchers.h and the kernel agree");
static_assert(kMaxTopK == centroid::kMaxTopK, "launchers.h and the kernel agree");

int64_t prepare_centroid_logits(CentroidParams& p, int num_sms) { return centroid_prepare(p, num_sms); }

cudaError_t launch_centroid_logits(DType dtype, const CentroidParams& p, cudaStream_t stream) {
  return with_dtype(dtype, [&](auto tag) { return centroid_logits<decltype(tag)>(p, stream); });
}

}  // namespace gemma4_mtp
