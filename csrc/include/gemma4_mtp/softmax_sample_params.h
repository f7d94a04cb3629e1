// Arguments of the softmax_sample kernels (softmax_sample.cuh), host-includable (no device headers).
#pragma once

#include <cstdint>

namespace gemma4_mtp {

constexpr int kSoftmaxSampleChunk = 4096;  // vocabulary ids per CTA (the Triton kernels' CHUNK)

struct SoftmaxSampleParams {
  const void* logits;         // [B, V] fp32 / fp16 / bf16, row stride logit_stride (elements)
  int64_t logit_stride;
  const float* temperature;   // [B], stride temp_stride
  int64_t temp_stride;
  const double* uniforms;     // [B], stride u_stride
  int64_t u_stride;
  float* probs;               // [B, V] fp32 out, row stride probs_stride
  int64_t probs_stride;
  int64_t* tokens;            // [B] out, contiguous
  float* stats;               // workspace [B, P, 2]: each chunk's max of logits / temperature and sum of exp
  double* mass;               // workspace [B, P]: each chunk's fp64 sum of q
  int32_t* counters;          // [B], zero before the launch, left zero
  int B;
  int V;
  int P;                      // chunks per row: softmax_sample_chunks(V)
};

inline int softmax_sample_chunks(int V) { return (V + kSoftmaxSampleChunk - 1) / kSoftmaxSampleChunk; }

// Bytes of the workspace (mass first: 8-byte aligned), carved by softmax_sample_carve.
inline int64_t softmax_sample_workspace_bytes(int B, int P) { return static_cast<int64_t>(B) * P * (8 + 2 * 4); }

inline void softmax_sample_carve(SoftmaxSampleParams& p, void* workspace) {
  p.mass = static_cast<double*>(workspace);
  p.stats = reinterpret_cast<float*>(p.mass + static_cast<int64_t>(p.B) * p.P);
}

}  // namespace gemma4_mtp
