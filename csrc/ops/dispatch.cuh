// Maps the runtime dtype tag to the element type of the kernel templates.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "gemma4_mtp/params.h"

namespace gemma4_mtp {

template <class F>
cudaError_t with_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: return f(float{});
    case DType::kFloat16: return f(__half{});
    case DType::kBFloat16: return f(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace gemma4_mtp
