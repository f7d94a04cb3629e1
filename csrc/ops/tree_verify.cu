#include "dispatch.cuh"
#include "gemma4_mtp/tree_verify.cuh"
#include "launchers.h"

namespace gemma4_mtp {

int64_t prepare_tree_verify(DType dtype, TreeVerifyParams& p, int num_sms) {
  int64_t bytes = 0;
  const cudaError_t err = with_dtype(dtype, [&](auto tag) {
    bytes = tree_verify_prepare<decltype(tag)>(p, num_sms);
    return cudaSuccess;
  });
  return err == cudaSuccess ? bytes : -1;
}

int64_t tree_verify_counters(int B, int N) { return tree_verify_counter_ints(B, N); }

cudaError_t launch_tree_verify(DType dtype, const TreeVerifyParams& p, cudaStream_t stream) {
  return with_dtype(dtype, [&](auto tag) { return tree_verify<decltype(tag)>(p, stream); });
}

}  // namespace gemma4_mtp
