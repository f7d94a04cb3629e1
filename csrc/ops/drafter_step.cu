// A whole drafter step in one host call: the launches of Gemma4MTPDrafter.step (python_api/gemma4_mtp/
// drafter.py, whose composition this follows op for op) made from C++, with every activation, partial
// and workspace carved from one caller-given buffer. What it saves is host time: an eager step of
// per-op calls crosses from Python into an op ~20 times (~55 µs each on the 2026-12-04 H200 host:
// 1.29 ms a step); this is one crossing and 20-24 launches, 21-26 with the LM head's top tokens
// (DrafterStepParams::head: Gemma4MTPDrafter.step_top_tokens, the second crossing of a draft step
// saved), 23-27 with a sampled token instead (step_sample_tokens: the head's logits and softmax_sample,
// two crossings saved). Host code only: the kernels are the ops'.
#include <algorithm>

#include "dense_lm_head.h"
#include "gemma4_mtp/drafter_step_params.h"
#include "launchers.h"

namespace gemma4_mtp {

namespace {

// Carves 256-byte aligned regions off a base address; a sizing pass walks the same carves from a
// stand-in base that is never dereferenced (prepare reads only alignments).
struct Carver {
  uintptr_t base;
  int64_t used = 0;
  void* take(int64_t bytes) {
    void* p = reinterpret_cast<void*>(base + static_cast<uintptr_t>(used));
    used += (std::max<int64_t>(bytes, 0) + 255) / 256 * 256;
    return p;
  }
};

struct Counters {
  int32_t* base;  // null while sizing
  int64_t used = 0;
  int32_t* take(int64_t n) {
    int32_t* p = base == nullptr ? nullptr : base + used;
    used += n;
    return p;
  }
};

int64_t elem_bytes(DType dt) { return dt == DType::kFloat32 ? 4 : 2; }

// A row stride as the bindings pass it: a size-1 dimension's stride is never applied, and 0 keeps it
// out of the kernels' 16-byte checks.
int64_t rows_stride(int64_t rows, int64_t cols) { return rows == 1 ? 0 : cols; }

class Step {
 public:
  Step(DType dt, const DrafterStepParams& p, int num_sms, uintptr_t base, int32_t* counters, cudaStream_t stream,
       bool launch)
      : dt_(dt), p_(p), sms_(num_sms), ws_{base}, counters_{counters}, stream_(stream), launch_(launch),
        T_(static_cast<int64_t>(p.B) * p.Q) {}

  cudaError_t run() {
    const int64_t E = elem_bytes(dt_);
    void* x = ws_.take(T_ * p_.Hd * E);
    cudaError_t err = down_proj(x);
    // the residual stream, the layer output still to add (its layer), as the Python step keeps them
    const void* residual = x;
    const void* delta = nullptr;
    const DrafterStepLayer* prev = nullptr;
    for (int i = 0; i < p_.num_layers && err == cudaSuccess; ++i) {
      const DrafterStepLayer& w = p_.layers[i];
      const DrafterStepKV& kv = p_.kv[w.kv];
      const int64_t N = static_cast<int64_t>(p_.Hq) * kv.D;
      GlueParams g = glue(GlueKind::kQRope, prev == nullptr ? x : delta, p_.Hd, w.input_norm);
      const void* stream = x;  // the first layer reads the pre-projection's output as it is
      if (prev != nullptr) {
        // the previous layer's end (post-feedforward norm, residual add, layer scalar) as the prologue
        void* residual_out = ws_.take(T_ * p_.Hd * E);
        add_layer_end(g, *prev, residual);
        g.residual_out = residual_out;
        g.residual_out_stride = rows_stride(T_, p_.Hd);
        stream = residual_out;
      }
      void* q = ws_.take(T_ * N * E);
      project(g, w.q_proj, static_cast<int>(N), q, N);
      g.q_norm_weight = w.q_norm;
      g.positions = p_.positions;
      g.positions_int64 = p_.positions_int64;
      g.inv_freq = w.inv_freq;
      g.D = kv.D;
      g.per_pos = p_.Q;
      err = glue_launch(g, launch_rms_norm_q_rope);
      void* o = ws_.take(T_ * N * E);
      if (err == cudaSuccess) err = attention(kv, q, o);
      void* a = ws_.take(T_ * p_.Hd * E);
      GlueParams lin = glue(GlueKind::kLinear, o, N, nullptr);
      project(lin, w.o_proj, p_.Hd, a, p_.Hd);
      if (err == cudaSuccess) err = glue_launch(lin, launch_rms_norm_linear);
      void* residual_out = ws_.take(T_ * p_.Hd * E);
      // the MLP: one launch where the op's binding takes one (glue_mlp_one_launch), else gate_up into m
      // and down_proj
      const bool one_launch = glue_mlp_one_launch(T_, p_.Hd, w.I, p_.Hd, E);
      void* d = ws_.take(T_ * p_.Hd * E);
      void* m = one_launch ? d : ws_.take(T_ * w.I * E);
      GlueParams gu = glue(GlueKind::kGateUp, a, p_.Hd, w.pre_ff_norm);
      gu.residual = stream;
      gu.residual_stride = rows_stride(T_, p_.Hd);
      gu.residual_norm_weight = w.post_attn_norm;
      gu.residual_out = residual_out;
      gu.residual_out_stride = rows_stride(T_, p_.Hd);
      project(gu, w.gate, w.I, m, one_launch ? p_.Hd : w.I);
      gu.up_weight = w.up;
      gu.up_weight_stride = rows_stride(w.I, p_.Hd);
      if (one_launch) {
        gu.down_weight = w.down;
        gu.down_weight_stride = rows_stride(p_.Hd, w.I);
        gu.down_N = p_.Hd;
      }
      if (err == cudaSuccess) err = glue_launch(gu, launch_rms_norm_gate_up);
      if (!one_launch) {
        GlueParams down = glue(GlueKind::kLinear, m, w.I, nullptr);
        project(down, w.down, p_.Hd, d, p_.Hd);
        if (err == cudaSuccess) err = glue_launch(down, launch_rms_norm_linear);
      }
      residual = residual_out;
      delta = d;
      prev = &w;
    }
    if (err != cudaSuccess) return err;  // prev is set: params_ok() requires a layer
    // the last layer's end, the final norm (written to last) and the post-projection in one launch
    GlueParams g = glue(GlueKind::kLinear, delta, p_.Hd, p_.final_norm);
    add_layer_end(g, *prev, residual);
    g.normed_out = p_.last;
    g.normed_out_stride = rows_stride(T_, p_.Hd);
    project(g, p_.post_projection, p_.Hb, p_.proj, p_.Hb);
    err = glue_launch(g, launch_rms_norm_linear);
    if (err != cudaSuccess) return err;
    if (p_.head.kind == DrafterStepHeadKind::kNone) return cudaSuccess;
    if (p_.head.temperature != nullptr) return sampled_head();
    return p_.head.kind == DrafterStepHeadKind::kCentroid ? centroid_head(nullptr) : dense_head(nullptr);
  }

  int64_t workspace_bytes() const { return ws_.used; }
  int64_t counters() const { return counters_.used; }

 private:
  cudaError_t down_proj(void* x) {
    DownProjParams d{};
    d.token_ids = p_.token_ids;
    d.token_ids_int64 = p_.token_ids_int64;
    d.embed_table = p_.embed_table;
    d.hidden = p_.hidden;
    d.weight = p_.pre_projection;
    d.out = x;
    d.table_stride = p_.vocab == 1 ? 0 : p_.table_stride;
    d.hidden_stride = T_ == 1 ? 0 : p_.hidden_stride;
    d.weight_stride = rows_stride(p_.Hd, 2 * int64_t{p_.Hb});
    d.out_stride = p_.Hd;
    d.vocab = p_.vocab;
    d.T = static_cast<int>(T_);
    d.Hb = p_.Hb;
    d.Hd = p_.Hd;
    d.embed_scale = p_.embed_scale;
    int64_t n = 0;
    const int64_t partial_bytes = prepare_fused_concat_down_proj(dt_, d, sms_, &n);
    d.partials = partial_bytes > 0 ? static_cast<float*>(ws_.take(partial_bytes)) : nullptr;
    d.counters = n > 0 ? counters_.take(n) : nullptr;
    return launch_ ? launch_fused_concat_down_proj(dt_, d, stream_) : cudaSuccess;
  }

  // x [T, H] with an optional input norm: the fields every glue op of the step shares.
  GlueParams glue(GlueKind kind, const void* x, int64_t H, const void* norm_weight) const {
    GlueParams g{};
    g.kind = kind;
    g.x = x;
    g.x_stride = rows_stride(T_, H);
    g.norm_weight = norm_weight;
    g.eps = p_.eps;
    g.T = static_cast<int>(T_);
    g.H = static_cast<int>(H);
    return g;
  }

  // residual + post_feedforward_layernorm(x) of layer `w`, times its layer scalar
  void add_layer_end(GlueParams& g, const DrafterStepLayer& w, const void* residual) const {
    g.residual = residual;
    g.residual_stride = rows_stride(T_, p_.Hd);
    g.residual_norm_weight = w.post_ff_norm;
    g.layer_scalar = w.layer_scalar;
  }

  void project(GlueParams& g, const void* weight, int N, void* out, int64_t out_stride) const {
    g.weight = weight;
    g.weight_stride = rows_stride(N, g.H);
    g.out = out;
    g.out_stride = out_stride;
    g.N = N;
  }

  cudaError_t glue_launch(GlueParams& g, cudaError_t (*launch)(DType, const GlueParams&, cudaStream_t)) {
    int64_t ws_bytes = 0, n = 0;
    const int64_t partial_bytes = prepare_rms_norm_glue(dt_, g, sms_, &ws_bytes, &n);
    g.partials = partial_bytes > 0 ? static_cast<float*>(ws_.take(partial_bytes)) : nullptr;
    g.workspace = ws_bytes > 0 ? ws_.take(ws_bytes) : nullptr;
    g.counters = n > 0 ? counters_.take(n) : nullptr;
    return launch_ ? launch(dt_, g, stream_) : cudaSuccess;
  }

  cudaError_t attention(const DrafterStepKV& kv, const void* q, void* out) {
    AttentionParams a{};
    const int64_t D = kv.D;
    a.q = q;
    a.q_stride[0] = p_.B == 1 ? 0 : int64_t{p_.Q} * p_.Hq * D;
    a.q_stride[1] = p_.Q == 1 ? 0 : int64_t{p_.Hq} * D;
    a.q_stride[2] = p_.Hq == 1 ? 0 : D;
    a.k_cache = kv.k_cache;
    a.v_cache = kv.v_cache;
    for (int i = 0; i < 3; ++i) {
      a.k_stride[i] = kv.k_stride[i];
      a.v_stride[i] = kv.v_stride[i];
    }
    a.block_table = kv.block_table;
    a.block_table_stride = kv.block_table_stride;
    a.seq_lens = p_.seq_lens;
    a.out = out;
    a.lse = static_cast<float*>(ws_.take(T_ * p_.Hq * 4));
    a.B = p_.B;
    a.Q = p_.Q;
    a.Hq = p_.Hq;
    a.Hkv = kv.Hkv;
    a.D = kv.D;
    a.num_blocks = kv.num_blocks;
    a.block_size = kv.block_size;
    a.max_blocks = kv.max_blocks;
    a.scale = 1.0f;  // Gemma 4 normalises q and k instead (q_norm, the target's k_norm)
    a.softcap = 0.0f;
    a.window = kv.window;
    int64_t n = 0;
    const int64_t ws_bytes = prepare_attention(dt_, a, sms_, &n);
    a.workspace = ws_bytes > 0 ? static_cast<float*>(ws_.take(ws_bytes)) : nullptr;
    a.counters = n > 0 ? counters_.take(n) : nullptr;
    return launch_ ? launch_q_only_paged_attention(dt_, a, stream_) : cudaSuccess;
  }

  // The two-stage head over `last` as Gemma4MTPDrafter.top_tokens calls centroid_logits: argmax for one
  // answer, topk for more; with `dense`, the dense logits there (as Gemma4MTPDrafter.logits), the launch
  // filling them with -inf first.
  cudaError_t centroid_head(float* dense) {
    const DrafterStepHead& h = p_.head;
    CentroidParams c{};
    c.hidden = p_.last;
    c.centroids = h.centroids;
    c.token_ordering = h.token_ordering;
    c.ordering_int64 = h.ordering_int64;
    c.lm_head = h.lm_head;
    c.hidden_stride = rows_stride(T_, p_.Hd);
    c.centroid_stride = rows_stride(h.C, p_.Hd);
    c.lm_head_stride = rows_stride(h.V, p_.Hd);
    c.T = static_cast<int>(T_);
    c.Hd = p_.Hd;
    c.C = h.C;
    c.top_k = h.top_k;
    c.V = h.V;
    c.output = dense != nullptr ? CentroidOutput::kDense : h.k == 1 ? CentroidOutput::kArgmax : CentroidOutput::kTopK;
    c.k = h.k;
    c.ids = dense != nullptr ? nullptr : h.ids;  // argmax's [T] is the [T, 1] of k = 1
    c.logits = dense != nullptr ? dense : h.scores;
    c.fill_dense = dense != nullptr;
    c.counters = counters_.take(kCentroidCounters);
    const int64_t ws_bytes = prepare_centroid_logits(c, sms_);
    c.workspace = ws_bytes > 0 ? ws_.take(ws_bytes) : nullptr;
    return launch_ ? launch_centroid_logits(dt_, c, stream_) : cudaSuccess;
  }

  // The dense head's top-k over `last` (dense_lm_head, output "topk"); with `dense`, its logits there
  // (output "dense").
  cudaError_t dense_head(float* dense) {
    const DrafterStepHead& h = p_.head;
    DenseHeadParams d{};
    d.hidden = p_.last;
    d.lm_head = h.lm_head;
    d.hidden_stride = rows_stride(T_, p_.Hd);
    d.head_stride = rows_stride(h.V, p_.Hd);
    d.T = static_cast<int>(T_);
    d.V = static_cast<int>(h.V);
    d.Hd = p_.Hd;
    d.k = dense != nullptr ? 1 : h.k;
    d.dense = dense;
    d.dense_stride = rows_stride(T_, h.V);
    d.out_ids = dense != nullptr ? nullptr : h.ids;
    d.out_logits = dense != nullptr ? nullptr : h.scores;
    const int64_t ws_bytes = prepare_dense_lm_head(d, sms_);
    d.partial = ws_bytes > 0 ? static_cast<uint64_t*>(ws_.take(ws_bytes)) : nullptr;
    return launch_ ? launch_dense_lm_head(dt_, d, stream_) : cudaSuccess;
  }

  // A token drawn per row of `last` as Gemma4MTPDrafter.sample_tokens draws it: the head's dense fp32
  // logits into the workspace, then softmax_sample (its two launches) over them.
  cudaError_t sampled_head() {
    const DrafterStepHead& h = p_.head;
    float* logits = static_cast<float*>(ws_.take(T_ * h.V * 4));
    const cudaError_t err =
        h.kind == DrafterStepHeadKind::kCentroid ? centroid_head(logits) : dense_head(logits);
    SoftmaxSampleParams s{};
    s.logits = logits;
    s.logit_stride = rows_stride(T_, h.V);
    s.temperature = h.temperature;
    s.temp_stride = T_ == 1 ? 0 : h.temp_stride;
    s.uniforms = h.uniforms;
    s.u_stride = T_ == 1 ? 0 : h.u_stride;
    s.probs = h.probs;
    s.probs_stride = T_ == 1 ? 0 : h.probs_stride;
    s.tokens = h.ids;
    s.B = static_cast<int>(T_);
    s.V = static_cast<int>(h.V);
    s.P = softmax_sample_chunks(s.V);
    softmax_sample_carve(s, ws_.take(softmax_sample_workspace_bytes(s.B, s.P)));
    s.counters = counters_.take(T_);
    if (err != cudaSuccess || !launch_) return err;
    return launch_softmax_sample(DType::kFloat32, s, stream_);  // the logits' type, not the step's
  }

  DType dt_;
  const DrafterStepParams& p_;
  int sms_;
  Carver ws_;
  Counters counters_;
  cudaStream_t stream_;
  bool launch_;
  int64_t T_;
};

bool params_ok(DType dt, const DrafterStepParams& p) {
  if (p.B < 1 || p.Q < 1 || p.Hb < 0 || p.Hd < 1 || p.Hq < 1 || p.num_layers < 1 || p.num_kv < 1 ||
      p.layers == nullptr || p.kv == nullptr)
    return false;
  for (int i = 0; i < p.num_layers; ++i)
    if (p.layers[i].kv < 0 || p.layers[i].kv >= p.num_kv || p.layers[i].I < 1) return false;
  const DrafterStepHead& h = p.head;
  if (h.kind == DrafterStepHeadKind::kNone) return true;
  if (h.lm_head == nullptr || h.ids == nullptr || h.V < 1 || h.k < 1) return false;
  if (h.temperature != nullptr) {  // sampled: softmax_sample's limits (a row a grid row, V in 32 bits)
    if (h.uniforms == nullptr || h.probs == nullptr || h.k != 1 || int64_t{p.B} * p.Q > 65535 || h.V > INT32_MAX)
      return false;
  } else if (h.scores == nullptr) {
    return false;
  }
  if (h.kind == DrafterStepHeadKind::kDense)  // the binding's limits (its 48 KiB of staged rows included)
    return h.k <= kMaxDenseHeadK && h.k <= h.V && h.V <= INT32_MAX &&
           dense_lm_head_smem_bytes(dt, p.Hd) <= 48 * 1024;
  return h.kind == DrafterStepHeadKind::kCentroid && h.centroids != nullptr && h.token_ordering != nullptr &&
         h.C >= 1 && h.C <= kMaxCentroids && h.V % h.C == 0 && h.top_k >= 1 && h.top_k <= h.C &&
         h.k <= kMaxTopK && h.k <= int64_t{h.top_k} * (h.V / h.C);
}

}  // namespace

int64_t prepare_drafter_step(DType dtype, const DrafterStepParams& p, int num_sms, int64_t* counters) {
  *counters = 0;
  if (!params_ok(dtype, p)) return 0;
  Step sizing(dtype, p, num_sms, 256, nullptr, nullptr, false);
  sizing.run();
  *counters = sizing.counters();
  return sizing.workspace_bytes();
}

cudaError_t launch_drafter_step(DType dtype, const DrafterStepParams& p, int num_sms, void* workspace,
                                int32_t* counters, cudaStream_t stream) {
  // the carves must fall where the sizing pass put them (the plans depend on alignment), and every step
  // has counters (rms_norm_q_rope's)
  if (!params_ok(dtype, p) || workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % 256 ||
      counters == nullptr)
    return cudaErrorInvalidValue;
  return Step(dtype, p, num_sms, reinterpret_cast<uintptr_t>(workspace), counters, stream, true).run();
}

}  // namespace gemma4_mtp
