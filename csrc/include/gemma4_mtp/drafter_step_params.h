// The arguments of a whole drafter step in one host call (csrc/ops/drafter_step.cu:
// prepare_drafter_step / launch_drafter_step): the Gemma 4 MTP drafter's forward over T = B x Q query
// tokens, as python_api/gemma4_mtp/drafter.py `Gemma4MTPDrafter.step` composes it from the ops, with
// every launch made from C++ (no per-kernel host round trip through Python). Raw pointers and sizes,
// includable from host-only C++ (no CUDA headers).
//
// Layouts: every weight contiguous ([rows, cols], row stride cols); last and proj contiguous [T, cols];
// hidden and embed_table rows of hidden_stride / table_stride elements; the caches and block tables as
// q_only_paged_attention takes them (AttentionParams).
#pragma once

#include <cstdint>

namespace gemma4_mtp {

// One attention type's view of the target's paged cache (the target layer the drafter reads).
struct DrafterStepKV {
  const void* k_cache;  // [num_blocks, block_size, Hkv, D], stride 1 in D, 16-byte rows
  const void* v_cache;
  int64_t k_stride[3], v_stride[3];  // a size-1 dimension's stride 0
  const int32_t* block_table;        // [B, max_blocks]
  int64_t block_table_stride;
  int num_blocks, block_size, max_blocks, Hkv, D;
  int64_t window;  // <= 0: attend every cached position
};

// A decoder layer's weights, in the order the step reads them. Vectors have Hd elements unless said.
struct DrafterStepLayer {
  int kv;                  // index into DrafterStepParams::kv
  const void* input_norm;  // [Hd]
  const void* q_proj;      // [Hq * D, Hd]
  const void* q_norm;      // [D]
  const float* inv_freq;   // [D / 2] fp32
  const void* o_proj;      // [Hd, Hq * D]
  const void* post_attn_norm;
  const void* pre_ff_norm;
  const void* gate;  // [I, Hd]
  const void* up;    // [I, Hd]
  const void* down;  // [Hd, I]
  const void* post_ff_norm;
  const void* layer_scalar;  // [1]
  int I;                     // the MLP's intermediate size
};

// The LM head after the step, in the same call (Gemma4MTPDrafter.top_tokens of `last`): the k best
// tokens of each row, from the two-stage centroid head (E2B / E4B: centroid_logits' argmax at k = 1,
// its topk above) or the dense one (26B / 31B: dense_lm_head's topk). kNone: no head.
// With `temperature`, a token drawn per row instead (Gemma4MTPDrafter.sample_tokens of `last`): the
// head's dense fp32 logits (centroid_logits' "dense", -inf outside the kept clusters, filled by its own
// launch; dense_lm_head's "dense") into the workspace, then softmax_sample.
enum class DrafterStepHeadKind { kNone = 0, kCentroid, kDense };

struct DrafterStepHead {
  DrafterStepHeadKind kind;
  const void* lm_head;         // [V, Hd]
  int64_t V;
  const void* centroids;       // kCentroid: [C, Hd]
  const void* token_ordering;  // kCentroid: [V] int32 or int64
  bool ordering_int64;
  int C, top_k;                // kCentroid: clusters, clusters kept per token
  int k;                       // answers per token: 1 .. 16 (and at most the head's candidates); sampled: 1
  int64_t* ids;                // out [T, k] int64, best first, ties to the lower id; sampled: [T], the draws
  float* scores;               // out [T, k] fp32: their logits; sampled: unused
  // sampled (temperature not null): q = softmax(logits / temperature) per row, a token by its inverse
  // CDF at the row's uniform (softmax_sample's arguments, strides in elements)
  const float* temperature;    // [T] fp32
  int64_t temp_stride;
  const double* uniforms;      // [T] fp64, each in [0, 1)
  int64_t u_stride;
  float* probs;                // out [T, V] fp32, stride 1 in V
  int64_t probs_stride;
};

struct DrafterStepParams {
  int B, Q;       // requests, queries per request (T = B * Q rows)
  int Hb, Hd, Hq;  // target hidden size, drafter hidden size, query heads
  int num_layers, num_kv;
  float eps;  // every RMSNorm's
  // input: concat(embed_table[token_ids[t]] * embed_scale, hidden[t]) through pre_projection
  const void* token_ids;  // [T] int32 or int64
  bool token_ids_int64;
  const void* embed_table;  // [vocab, Hb]
  int64_t table_stride, vocab;
  float embed_scale;
  const void* hidden;  // [T, Hb], rows hidden_stride apart
  int64_t hidden_stride;
  const void* pre_projection;  // [Hd, 2 * Hb]
  const int32_t* seq_lens;     // [B]
  const void* positions;       // [B] int32 or int64: RoPE position of request b's queries
  bool positions_int64;
  const DrafterStepKV* kv;          // [num_kv]: one per attention type (Gemma 4: sliding, full)
  const DrafterStepLayer* layers;   // [num_layers] (Gemma 4 drafters: 4)
  const void* final_norm;       // [Hd]
  const void* post_projection;  // [Hb, Hd]
  void* last;                   // out [T, Hd]: the final norm's output (the LM head's input)
  void* proj;                   // out [T, Hb]: post_projection(last), the next step's hidden
  DrafterStepHead head;         // zero-initialised: none
};

}  // namespace gemma4_mtp
