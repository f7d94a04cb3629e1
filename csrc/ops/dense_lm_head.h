// Host-only entry point of csrc/ops/dense_lm_head.cu (what torch_bindings.cpp calls), without device headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "gemma4_mtp/dense_lm_head_params.h"
#include "gemma4_mtp/params.h"

namespace gemma4_mtp {

// Fills p.num_ctas for this device; returns the workspace bytes p.partial must point to (0: none).
int64_t prepare_dense_lm_head(DenseHeadParams& p, int num_sms);
// Shared memory kernel 1 needs for Hd and the element size of dtype (the binding checks the 48 KiB limit).
int64_t dense_lm_head_smem_bytes(DType dtype, int64_t Hd);
cudaError_t launch_dense_lm_head(DType dtype, const DenseHeadParams& p, cudaStream_t stream);

}  // namespace gemma4_mtp
