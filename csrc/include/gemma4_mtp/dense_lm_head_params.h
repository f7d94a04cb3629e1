// Arguments of the dense LM head kernels (dense_lm_head.cuh), host-includable (no device headers).
#pragma once

#include <cstdint>

namespace gemma4_mtp {

constexpr int kMaxDenseHeadK = 16;  // the public op's limit (gemma4_mtp_kernels.ops.dense_lm_head.MAX_K)

struct DenseHeadParams {
  const void* hidden;    // [T, Hd], row stride hidden_stride (elements)
  const void* lm_head;   // [V, Hd], row stride head_stride
  int64_t hidden_stride;
  int64_t head_stride;
  int T;
  int V;
  int Hd;
  int k;                 // 1 .. kMaxDenseHeadK (top-k output)
  float* dense;          // [T, V] fp32 logits, row stride dense_stride: the "dense" output (else null)
  int64_t dense_stride;
  uint64_t* partial;     // workspace [num_ctas, T, K] (top-k output)
  int num_ctas;
  int64_t* out_ids;      // [T, k] contiguous
  float* out_logits;     // [T, k] contiguous
};

}  // namespace gemma4_mtp
