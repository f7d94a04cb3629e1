// Plain argument structs of the four kernels (raw pointers, sizes, element strides). Includable from
// host-only C++ (no CUDA headers) so that engine glue code, like csrc/torch_bindings.cpp, can fill
// them without pulling in device code.
#pragma once

#include <cstdint>

#include "gemma4_mtp/down_proj_logic.h"
#include "gemma4_mtp/glue_logic.h"

namespace gemma4_mtp {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// y[t] = weight @ concat(round(embed_table[token_ids[t]] * round(embed_scale)), hidden[t]).
// An out-of-range token id makes row t of out NaN (nothing out of bounds is read).
struct DownProjParams {
  const void* token_ids;  // [T] int32 or int64
  bool token_ids_int64;
  const void* embed_table;  // [vocab, Hb], row stride table_stride
  const void* hidden;       // [T, Hb]
  const void* weight;       // [Hd, 2 * Hb]
  void* out;                // [T, Hd]
  int64_t table_stride, hidden_stride, weight_stride, out_stride;
  int64_t vocab;
  int T, Hb, Hd;
  float embed_scale;  // rounded to the table dtype by the kernel
  // filled by down_proj_prepare(): the tensor-core path's grid, and what a split k range needs
  DownProjPlan plan;
  float* partials;    // fp32 [splits, T, Hd]
  int32_t* counters;  // one per output tile; zero before the first launch, left zero
};

// Q-only paged attention. Every query row of request b attends cache positions
// [max(0, seq_lens[b] - window), seq_lens[b]). A seq_len outside [0, max_blocks * block_size] or a
// block id outside [0, num_blocks) among the blocks read makes that request's output and lse NaN.
struct AttentionParams {
  const void* q;  // [B, Q, Hq, D]
  int64_t q_stride[3];
  const void* k_cache;  // [num_blocks, block_size, Hkv, D], stride 1 in D
  const void* v_cache;
  int64_t k_stride[3], v_stride[3];
  const int32_t* block_table;  // [B, max_blocks]
  int64_t block_table_stride;
  const int32_t* seq_lens;  // [B]
  void* out;                // [B, Q, Hq, D] contiguous
  float* lse;               // [B, Q, Hq] contiguous fp32
  float* workspace;         // num_splits > 1: partial outputs and lse, attention::workspace_floats()
  int32_t* counters;        // attention_counters_for() int32 (when the kernel merges the splits itself):
                            // zero before the first launch, left zero; may be null when that is 0
  int B, Q, Hq, Hkv, D;
  int num_blocks, block_size, max_blocks;
  float scale;
  float softcap;  // <= 0: none
  int64_t window;  // <= 0: none
  int num_splits;  // attention_plan(); each request spreads its own range over them
};

enum class CentroidOutput { kArgmax = 0, kSparse = 1, kDense = 2, kTopK = 3 };
// Phase 2's order (centroid_logic.h centroid_plan): kAuto lets the plan pick; the others force it (tests,
// benchmarks; kClusters serves argmax and topk only).
enum class CentroidOrder { kAuto = 0, kTokens = 1, kClusters = 2 };

// Two-stage centroid head, one launch (centroid_logits.cuh). An id outside [0, V) in token_ordering is
// never dereferenced: its logit is NaN and its sparse id -1, it is skipped in the dense output, and it
// makes the argmax of its token (-1, NaN) and every one of its top-k answers (-1, NaN).
struct CentroidParams {
  const void* hidden;     // [T, Hd]
  const void* centroids;  // [C, Hd]
  const void* token_ordering;  // [V] int32 or int64
  bool ordering_int64;
  const void* lm_head;  // [V, Hd]
  int64_t hidden_stride, centroid_stride, lm_head_stride;
  int T, Hd, C, top_k;
  int64_t V;
  CentroidOutput output;
  int k;  // topk: answers per token, 1..min(K, 16) (K = top_k * V / C); the other outputs ignore it
  int64_t* ids;  // argmax: [T]; topk: [T, k], best first; sparse: [T, K]
  float* logits;  // argmax: [T]; topk: [T, k]; sparse: [T, K]; dense: [T, V] already filled with the fill value
  // dense: the launch fills [T, V] with -inf itself before any candidate is written (the drafter step's
  // sampled head: no fill launch of its own); else the caller filled it
  bool fill_dense;
  void* workspace;  // prepare_centroid_logits() bytes
  int32_t* counters;  // 2 int32, zero before the first launch; every launch leaves them zero
  CentroidOrder order;  // kAuto (zero) unless forced
  // filled by prepare_centroid_logits():
  int grid;    // programs of the launch (co-resident: cooperative launch)
  int chunks;  // items per (token, cluster)
  int rows;    // candidate rows per item
  bool cluster_major;
};

struct TreeVerifyParams {
  const void* draft_tokens;  // [B, N] int32 or int64, contiguous
  bool draft_int64;
  const int32_t* parents;  // [B, N] contiguous
  const void* logits;      // [B, N, V], stride 1 in V
  int64_t logits_stride[2];
  const float* temperature;  // [B] or null (all greedy)
  const float* uniforms;     // [B, N, 2] or null
  const void* draft_probs;   // [B, N, V] fp32 or the logits' type, stride 1 in V, or null
  bool draft_probs_fp32;
  int64_t draft_probs_stride[2];
  int B, N;
  int64_t V;
  int32_t* accept_len;      // [B]
  int32_t* accepted_nodes;  // [B, N]
  int64_t* output_tokens;   // [B, N]
  int32_t* last_node;       // [B]
  int32_t* counters;  // tree_verify_counter_ints() int32, zero before the first launch (every launch
                      // leaves them zero); launches sharing them must not overlap in time
  void* workspace;    // tree_verify_prepare() bytes, any contents
  // the plan, from tree_verify_prepare()
  int num_chunks;
  int64_t chunk;
  int64_t granule;
  int granules;
};

// The fused glue ops (rms_norm_linear.cuh): a decoder layer's glue as a prologue, a projection, and
// an epilogue per op. Prologue, per token row t of x [T, H] (every step rounded to the element type, as
// Hugging Face's Gemma 4 rounds): h = x, or h = residual + rms_norm(x) * residual_norm_weight (then
// h * layer_scalar when given); n = rms_norm(h) * norm_weight, or h when norm_weight is null. Then
//   kLinear:  out [T, N] = n @ weight^T
//   kGateUp:  out [T, N] = gelu_tanh(n @ weight^T) * (n @ up_weight^T)   (weight = gate_proj); with
//             down_weight, the whole MLP: out [T, down_N] = that m @ down_weight^T (m rounded to the dtype,
//             the sum rounded once)
//   kQRope:   out [T, N / D, D] = rope(rms_norm(n @ weight^T per head, q_norm_weight), positions)
// residual_out / normed_out [T, H], when not null, receive h / n (normed_out: kLinear only).
struct GlueParams {
  GlueKind kind;
  const void* x;  // [T, H]
  int64_t x_stride;
  const void* residual;  // [T, H] or null (h = x)
  int64_t residual_stride;
  const void* residual_norm_weight;  // [H], with residual
  const void* layer_scalar;          // [1] or null, with residual
  const void* norm_weight;           // [H] or null (n = h)
  float eps;
  const void* weight;  // [N, H]
  int64_t weight_stride;
  const void* up_weight;  // kGateUp: [N, H]
  int64_t up_weight_stride;
  const void* down_weight;  // kGateUp: [down_N, N] or null (out is m)
  int64_t down_weight_stride;
  int down_N;
  void* out;  // [T, N]; kQRope: contiguous [T, N / D, D]
  int64_t out_stride;
  void* residual_out;  // [T, H] or null
  int64_t residual_out_stride;
  void* normed_out;  // [T, H] or null
  int64_t normed_out_stride;
  // kQRope: q_norm_weight [D]; positions [P] (int32 or int64), row t takes positions[t / per_pos];
  // inv_freq [D / 2] fp32 (neox pairs (j, j + D/2))
  const void* q_norm_weight;
  const void* positions;
  bool positions_int64;
  const float* inv_freq;
  int D, per_pos;
  int T, H, N;
  // filled by glue_prepare(): the grid, and the buffers it needs
  GluePlan plan;
  float* partials;    // fp32 [splits, T, row_tiles * 32] when plan.splits > 1
  int32_t* counters;  // glue_counters(); zero before the first launch, left zero
  void* workspace;    // kQRope: [T, N] of the element type (q before q_norm); kGateUp with down_weight:
                      // fp32 [row_tiles + groups, T, down_N] (glue_mlp_workspace_floats)
};

}  // namespace gemma4_mtp
