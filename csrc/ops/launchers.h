// Entry points of the kernels compiled in csrc/ops/*.cu, callable from host-only C++ (the torch glue in
// csrc/torch_bindings.cpp) without device headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "gemma4_mtp/params.h"
#include "gemma4_mtp/softmax_sample_params.h"

namespace gemma4_mtp {

// Fills p.plan for this device; returns the bytes of p.partials and, in *counters, the number of int32
// p.counters a launch needs (zero before the first launch, left zero by every launch).
int64_t prepare_fused_concat_down_proj(DType dtype, DownProjParams& p, int num_sms, int64_t* counters);
cudaError_t launch_fused_concat_down_proj(DType dtype, const DownProjParams& p, cudaStream_t stream);

// Fills p.num_splits for this device and element type; returns the workspace size in bytes (0: none)
// and, in *counters, the number of int32 p.counters a launch needs (zero before the first launch, left
// zero by every launch).
int64_t prepare_attention(DType dtype, AttentionParams& p, int num_sms, int64_t* counters);
cudaError_t launch_q_only_paged_attention(DType dtype, const AttentionParams& p, cudaStream_t stream);

constexpr int kMaxCentroids = 4096;
constexpr int kMaxTopK = 16;  // centroid_logits' topk answers per token
constexpr int kCentroidCounters = 2;
// Fills p.grid, p.chunks, p.rows for this device; returns the workspace size in bytes.
int64_t prepare_centroid_logits(CentroidParams& p, int num_sms);
cudaError_t launch_centroid_logits(DType dtype, const CentroidParams& p, cudaStream_t stream);

// Fills the plan fields of p (after its pointers and strides: the plan depends on their alignment);
// returns the workspace size in bytes. p.counters needs tree_verify_counters(B, N) int32 that are zero
// before the first launch (launches leave them zero).
int64_t prepare_tree_verify(DType dtype, TreeVerifyParams& p, int num_sms);
int64_t tree_verify_counters(int B, int N);
cudaError_t launch_tree_verify(DType dtype, const TreeVerifyParams& p, cudaStream_t stream);

// The fused glue ops (GlueParams): fills p.plan for this device; returns the bytes of p.partials and,
// in *workspace_bytes and *counters, the bytes of p.workspace (rms_norm_q_rope) and the number of int32
// p.counters (zero before the first launch, left zero by every launch). Defined in rms_norm_linear.cu.
int64_t prepare_rms_norm_glue(DType dtype, GlueParams& p, int num_sms, int64_t* workspace_bytes, int64_t* counters);
cudaError_t launch_rms_norm_linear(DType dtype, const GlueParams& p, cudaStream_t stream);
cudaError_t launch_rms_norm_gate_up(DType dtype, const GlueParams& p, cudaStream_t stream);
cudaError_t launch_rms_norm_q_rope(DType dtype, const GlueParams& p, cudaStream_t stream);

// softmax_sample (SoftmaxSampleParams): p.P, the workspace (softmax_sample_carve) and B zeroed int32
// p.counters (left zero) must be set.
cudaError_t launch_softmax_sample(DType dtype, const SoftmaxSampleParams& p, cudaStream_t stream);

struct DrafterStepParams;  // gemma4_mtp/drafter_step_params.h

// A whole drafter step (DrafterStepParams; csrc/ops/drafter_step.cu): returns the bytes of the one
// workspace its launches carve (activations, partials, workspaces) and, in *counters, the int32
// counters they need (zero before the first launch, left zero by every launch). The workspace must be
// 256-byte aligned; the plan depends on the device's SM count only.
int64_t prepare_drafter_step(DType dtype, const DrafterStepParams& p, int num_sms, int64_t* counters);
cudaError_t launch_drafter_step(DType dtype, const DrafterStepParams& p, int num_sms, void* workspace,
                                int32_t* counters, cudaStream_t stream);

}  // namespace gemma4_mtp
