// torch custom ops torch.ops.gemma4_mtp.*: schema, argument checks that name the tensor, and the glue
// from at::Tensor to the framework-free launchers. Outputs are written in place (Tensor(a!)); the
// Python side (gemma4_mtp_kernels/cuda) allocates them and registers the fake implementations.
// Workspaces come from the caching allocator on the current stream, which CUDA-graph capture allows.
#include <Python.h>

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "check_message.h"
#include "gemma4_mtp/drafter_step_params.h"
#include "ops/dense_lm_head.h"
#include "ops/launchers.h"

namespace {

using gemma4_mtp::DType;

DType float_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: G4_CHECK_TYPE(false, "gemma4_mtp: ", name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

void check_tensor(const at::Tensor& t, const char* name, int64_t ndim, const at::Device& device) {
  G4_CHECK(t.is_cuda(), "gemma4_mtp: ", name, " must be a CUDA tensor, got one on ", t.device());
  G4_CHECK(t.device() == device, "gemma4_mtp: ", name, " must be on ", device, ", got ", t.device());
  G4_CHECK(t.dim() == ndim, "gemma4_mtp: ", name, " must have ", ndim, " dimensions, got shape ", t.sizes());
}

void check_dtype(const at::Tensor& t, const char* name, at::ScalarType a, at::ScalarType b = at::ScalarType::Undefined) {
  G4_CHECK_TYPE(t.scalar_type() == a || t.scalar_type() == b, "gemma4_mtp: ", name, " has dtype ", t.scalar_type(),
           ", expected ", a, b == at::ScalarType::Undefined ? "" : " or ", b == at::ScalarType::Undefined ? "" : c10::toString(b));
}

void check_inner(const at::Tensor& t, const char* name) {
  G4_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, "gemma4_mtp: ", name, " needs stride 1 in its last dimension, got strides ",
           t.strides());
}

void check_contiguous(const at::Tensor& t, const char* name) {
  G4_CHECK(t.is_contiguous(), "gemma4_mtp: ", name, " must be contiguous, got strides ", t.strides());
}

void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef shape) {
  G4_CHECK(t.sizes() == shape, "gemma4_mtp: ", name, " must have shape ", shape, ", got ", t.sizes());
}

// A contiguous tensor of exactly `shape` on `device`, of dtype a (or b): each check's own message.
void check_dense(const at::Tensor& t, const char* name, at::IntArrayRef shape, const at::Device& device,
                 at::ScalarType a, at::ScalarType b = at::ScalarType::Undefined) {
  check_tensor(t, name, static_cast<int64_t>(shape.size()), device);
  check_dtype(t, name, a, b);
  check_shape(t, name, shape);
  check_contiguous(t, name);
}

void check_launch(cudaError_t err, const char* op) {
  G4_CHECK_RUNTIME(err == cudaSuccess, "gemma4_mtp::", op, ": kernel launch failed: ", cudaGetErrorString(err));
}

// The stride of a size-1 dimension is never applied; 0 keeps it out of the kernels' 16-byte checks.
int64_t stride(const at::Tensor& t, int i) { return t.size(i) == 1 ? int64_t{0} : t.stride(i); }

int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// At least n zeroed int32 counters on like's device for the kernels of `op`, which synchronise their
// CTAs through them (a grid barrier, last-CTA elections) and leave them zero, so no per-call memset.
// Cached buffers, grown on demand, outgrown ones kept alive (captured graphs hold their addresses); the
// same policy as gemma4_mtp_kernels/_counters.py:
// - eager launches: one buffer per (op, device, stream), so launches on two streams, which may overlap
//   in time, never share counters (launches on one stream follow each other; torch keys its cuBLAS
//   workspaces by stream for the same reason);
// - captured launches: one buffer per (op, device) for all graphs (a graph replays on whatever stream
//   it is given), which every eager call also makes ready, so the warm-up before a capture leaves the
//   capture nothing to allocate. Replays of two graphs that overlap in time would share it: not
//   supported. A capture that still finds it too small gets a graph-private one in *fresh (its zeroing
//   is captured with it, so every replay starts from zero) that is not cached.
int32_t* zeroed_counters(const char* op, int64_t n, const at::Tensor& like, at::Tensor* fresh) {
  static std::mutex mutex;
  // never destroyed: tensors freed after CUDA's own teardown at exit would crash
  static auto* cache = new std::map<std::tuple<std::string, int, int64_t>, std::vector<at::Tensor>>();
  constexpr int64_t kGraphs = -1;  // the graphs' key (c10 stream ids are never negative)
  const std::lock_guard<std::mutex> lock(mutex);
  const int dev = like.get_device();
  const int64_t size = std::max<int64_t>(n, 1024);
  auto ready = [&](int64_t stream) -> at::Tensor& {
    std::vector<at::Tensor>& buffers = (*cache)[{op, dev, stream}];
    if (buffers.empty() || buffers.back().numel() < n) buffers.push_back(at::zeros({size}, like.options().dtype(at::kInt)));
    return buffers.back();
  };
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    std::vector<at::Tensor>& graphs = (*cache)[{op, dev, kGraphs}];
    if (!graphs.empty() && graphs.back().numel() >= n) return graphs.back().data_ptr<int32_t>();
    *fresh = at::zeros({size}, like.options().dtype(at::kInt));
    return fresh->data_ptr<int32_t>();
  }
  ready(kGraphs);  // for a capture of this call
  return ready(at::cuda::getCurrentCUDAStream(dev).id()).data_ptr<int32_t>();
}

void fused_concat_down_proj(const at::Tensor& token_ids, const at::Tensor& embed_table, const at::Tensor& hidden,
                            const at::Tensor& weight, double embed_scale, at::Tensor& out) {
  const auto dev = hidden.device();
  check_tensor(hidden, "hidden", 2, dev);
  check_tensor(token_ids, "token_ids", 1, dev);
  check_tensor(embed_table, "embed_table", 2, dev);
  check_tensor(weight, "weight", 2, dev);
  check_tensor(out, "out", 2, dev);
  check_dtype(token_ids, "token_ids", at::kInt, at::kLong);
  const DType dt = float_dtype(hidden, "hidden");
  check_dtype(embed_table, "embed_table", hidden.scalar_type());
  check_dtype(weight, "weight", hidden.scalar_type());
  check_dtype(out, "out", hidden.scalar_type());
  const int64_t T = hidden.size(0), Hb = hidden.size(1), Hd = weight.size(0);
  check_shape(token_ids, "token_ids", {T});
  G4_CHECK(embed_table.size(1) == Hb, "gemma4_mtp: embed_table must have Hb = ", Hb, " columns, got ", embed_table.sizes());
  check_shape(weight, "weight", {Hd, 2 * Hb});
  check_shape(out, "out", {T, Hd});
  check_contiguous(token_ids, "token_ids");
  check_inner(embed_table, "embed_table");
  check_inner(hidden, "hidden");
  check_inner(weight, "weight");
  check_contiguous(out, "out");
  // the kernel indexes rows and the 2 * Hb input columns with 32-bit ints
  G4_CHECK(T <= INT32_MAX && 2 * Hb <= INT32_MAX && Hd <= INT32_MAX,
           "gemma4_mtp: fused_concat_down_proj sizes must fit 32-bit indices: hidden ", hidden.sizes(), ", weight ",
           weight.sizes());

  const c10::cuda::CUDAGuard guard(dev);
  gemma4_mtp::DownProjParams p{};
  p.token_ids = token_ids.data_ptr();
  p.token_ids_int64 = token_ids.scalar_type() == at::kLong;
  p.embed_table = embed_table.data_ptr();
  p.hidden = hidden.data_ptr();
  p.weight = weight.data_ptr();
  p.out = out.data_ptr();
  p.table_stride = stride(embed_table, 0);
  p.hidden_stride = stride(hidden, 0);
  p.weight_stride = stride(weight, 0);
  p.out_stride = out.stride(0);
  p.vocab = embed_table.size(0);
  p.T = static_cast<int>(T);
  p.Hb = static_cast<int>(Hb);
  p.Hd = static_cast<int>(Hd);
  p.embed_scale = static_cast<float>(embed_scale);
  if (T == 0 || Hd == 0) return;
  // Rows are read with 16-byte loads (tensor-core path, vector CUDA-core path) only when the data
  // pointers and row strides of embed_table, hidden and weight allow it; otherwise the launcher takes
  // the element-wise path (never a misaligned load). out is written element-wise.
  int64_t n_counters = 0;
  const int64_t partial_bytes = gemma4_mtp::prepare_fused_concat_down_proj(dt, p, sm_count(), &n_counters);
  at::Tensor fresh;
  p.counters = n_counters > 0 ? zeroed_counters("fused_concat_down_proj", n_counters, hidden, &fresh) : nullptr;
  at::Tensor partials;
  if (partial_bytes > 0) {
    partials = at::empty({partial_bytes / 4}, hidden.options().dtype(at::kFloat));
    p.partials = partials.data_ptr<float>();
  }
  check_launch(gemma4_mtp::launch_fused_concat_down_proj(dt, p, at::cuda::getCurrentCUDAStream()),
               "fused_concat_down_proj");
}

// The attention kernels read q with 4- and 16-byte loads and copy K/V rows with 16-byte (sm_80) or bulk
// (sm_90) copies: the data pointer and the strides of the first three dimensions must be multiples of
// 16 bytes. Checked, like every other argument, before anything touches the device.
void check_16_byte_rows(const at::Tensor& t, const char* name) {
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int i = 0; i < 3; ++i) ok = ok && stride(t, i) * t.element_size() % 16 == 0;
  G4_CHECK(ok, "gemma4_mtp: ", name, " needs a 16-byte aligned data pointer and strides of its first three "
           "dimensions that are multiples of 16 bytes, got strides ", t.strides(), " (element size ",
           t.element_size(), ", storage offset ", t.storage_offset(), ")");
}

void q_only_paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, int64_t window,
                            double softcap, at::Tensor& out, at::Tensor& lse) {
  const auto dev = q.device();
  check_tensor(q, "q", 4, dev);
  check_tensor(k_cache, "k_cache", 4, dev);
  check_tensor(v_cache, "v_cache", 4, dev);
  check_tensor(block_table, "block_table", 2, dev);
  check_tensor(seq_lens, "seq_lens", 1, dev);
  check_tensor(out, "out", 4, dev);
  check_tensor(lse, "lse", 3, dev);
  const DType dt = float_dtype(q, "q");
  check_dtype(k_cache, "k_cache", q.scalar_type());
  check_dtype(v_cache, "v_cache", q.scalar_type());
  check_dtype(out, "out", q.scalar_type());
  check_dtype(lse, "lse", at::kFloat);
  check_dtype(block_table, "block_table", at::kInt);
  check_dtype(seq_lens, "seq_lens", at::kInt);
  const int64_t B = q.size(0), Q = q.size(1), Hq = q.size(2), D = q.size(3);
  G4_CHECK(k_cache.size(3) == D, "gemma4_mtp: k_cache head dim must be ", D, ", got shape ", k_cache.sizes());
  check_shape(v_cache, "v_cache", k_cache.sizes());
  const int64_t Hkv = k_cache.size(2);
  G4_CHECK(Hkv > 0 && Hq % Hkv == 0, "gemma4_mtp: k_cache KV heads (", Hkv, ") must divide Hq = ", Hq);
  G4_CHECK(D == 64 || D == 128 || D == 256 || D == 512, "gemma4_mtp: q head dim must be 64, 128, 256 or 512, got ", D);
  G4_CHECK(k_cache.size(1) > 0, "gemma4_mtp: k_cache block size must be positive, got shape ", k_cache.sizes());
  G4_CHECK(block_table.size(0) == B, "gemma4_mtp: block_table must have B = ", B, " rows, got ", block_table.sizes());
  check_shape(seq_lens, "seq_lens", {B});
  check_shape(out, "out", q.sizes());
  check_shape(lse, "lse", {B, Q, Hq});
  check_contiguous(out, "out");
  check_contiguous(lse, "lse");
  check_contiguous(seq_lens, "seq_lens");
  check_inner(q, "q");
  check_inner(k_cache, "k_cache");
  check_inner(v_cache, "v_cache");
  check_inner(block_table, "block_table");
  check_16_byte_rows(q, "q");
  check_16_byte_rows(k_cache, "k_cache");
  check_16_byte_rows(v_cache, "v_cache");
  // the kernels index rows, blocks and table columns with 32-bit ints
  G4_CHECK(B * Q * Hq <= INT32_MAX && k_cache.size(0) <= INT32_MAX && block_table.size(1) <= INT32_MAX,
           "gemma4_mtp: q_only_paged_attention sizes must fit 32-bit indices: q ", q.sizes(), ", k_cache ",
           k_cache.sizes(), ", block_table ", block_table.sizes());
  if (out.numel() == 0) return;

  gemma4_mtp::AttentionParams p{};
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  for (int i = 0; i < 3; ++i) {
    p.q_stride[i] = stride(q, i);
    p.k_stride[i] = stride(k_cache, i);
    p.v_stride[i] = stride(v_cache, i);
  }
  p.block_table = block_table.data_ptr<int32_t>();
  p.block_table_stride = block_table.stride(0);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.B = static_cast<int>(B);
  p.Q = static_cast<int>(Q);
  p.Hq = static_cast<int>(Hq);
  p.Hkv = static_cast<int>(Hkv);
  p.D = static_cast<int>(D);
  p.num_blocks = static_cast<int>(k_cache.size(0));
  p.block_size = static_cast<int>(k_cache.size(1));
  p.max_blocks = static_cast<int>(block_table.size(1));
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  p.window = window;

  const c10::cuda::CUDAGuard guard(dev);
  int64_t n_counters = 0;
  const int64_t ws_bytes = gemma4_mtp::prepare_attention(dt, p, sm_count(), &n_counters);
  at::Tensor ws, fresh;
  if (ws_bytes > 0) {
    ws = at::empty({ws_bytes / 4}, q.options().dtype(at::kFloat));
    p.workspace = ws.data_ptr<float>();
  }
  // the splits' last-CTA merge inside the kernel (small merge groups: plan.h attention_merges_in_kernel)
  p.counters = n_counters > 0 ? zeroed_counters("q_only_paged_attention", n_counters, q, &fresh) : nullptr;
  check_launch(gemma4_mtp::launch_q_only_paged_attention(dt, p, at::cuda::getCurrentCUDAStream()),
               "q_only_paged_attention");
}

// The centroid head's weights for hidden rows of Hd elements of `type` on dev (centroid_logits and the
// drafter step's head): checked, each named; returns K = top_k * V / C, the candidates of a token.
int64_t check_centroid_head(const at::Tensor& centroids, const at::Tensor& token_ordering, const at::Tensor& lm_head,
                            int64_t top_k, int64_t Hd, const at::Device& dev, at::ScalarType type) {
  check_tensor(centroids, "centroids", 2, dev);
  check_tensor(token_ordering, "token_ordering", 1, dev);
  check_tensor(lm_head, "lm_head", 2, dev);
  check_dtype(centroids, "centroids", type);
  check_dtype(lm_head, "lm_head", type);
  check_dtype(token_ordering, "token_ordering", at::kInt, at::kLong);
  const int64_t C = centroids.size(0), V = token_ordering.size(0);
  G4_CHECK(centroids.size(1) == Hd, "gemma4_mtp: centroids must have Hd = ", Hd, " columns, got ", centroids.sizes());
  check_shape(lm_head, "lm_head", {V, Hd});
  G4_CHECK(C >= 1 && C <= gemma4_mtp::kMaxCentroids && V % C == 0,
           "gemma4_mtp: centroids must number 1..", gemma4_mtp::kMaxCentroids, " and divide V = ", V, ", got ", C);
  G4_CHECK(V >= C, "gemma4_mtp: token_ordering must hold at least one token per centroid (", C, "), got length ", V);
  G4_CHECK(top_k >= 1 && top_k <= C, "gemma4_mtp: top_k must be in [1, ", C, "], got ", top_k);
  check_contiguous(token_ordering, "token_ordering");
  check_inner(centroids, "centroids");
  check_inner(lm_head, "lm_head");
  return top_k * (V / C);
}

void centroid_logits(const at::Tensor& hidden, const at::Tensor& centroids, const at::Tensor& token_ordering,
                     const at::Tensor& lm_head, int64_t top_k, c10::string_view output, at::Tensor& ids,
                     at::Tensor& logits, c10::string_view order) {
  const auto dev = hidden.device();
  check_tensor(hidden, "hidden", 2, dev);
  const DType dt = float_dtype(hidden, "hidden");
  const int64_t T = hidden.size(0), Hd = hidden.size(1);
  const int64_t K = check_centroid_head(centroids, token_ordering, lm_head, top_k, Hd, dev, hidden.scalar_type());
  const int64_t C = centroids.size(0), V = token_ordering.size(0);
  gemma4_mtp::CentroidOutput mode;
  if (output == "argmax") {
    mode = gemma4_mtp::CentroidOutput::kArgmax;
    check_shape(ids, "ids", {T});
    check_shape(logits, "logits", {T});
  } else if (output == "topk") {  // k = ids.size(1)
    mode = gemma4_mtp::CentroidOutput::kTopK;
    G4_CHECK(ids.dim() == 2 && ids.size(1) >= 1 && ids.size(1) <= std::min<int64_t>(K, gemma4_mtp::kMaxTopK),
             "gemma4_mtp: ids must be [T, k] with 1 <= k <= min(K = top_k * V / C, ", gemma4_mtp::kMaxTopK, ") = ",
             std::min<int64_t>(K, gemma4_mtp::kMaxTopK), " for output 'topk', got ", ids.sizes());
    check_shape(ids, "ids", {T, ids.size(1)});
    check_shape(logits, "logits", {T, ids.size(1)});
  } else if (output == "sparse") {
    mode = gemma4_mtp::CentroidOutput::kSparse;
    check_shape(ids, "ids", {T, K});
    check_shape(logits, "logits", {T, K});
  } else if (output == "dense") {
    mode = gemma4_mtp::CentroidOutput::kDense;
    check_shape(logits, "logits", {T, V});
  } else {
    G4_CHECK(false, "gemma4_mtp: output must be 'argmax', 'topk', 'sparse' or 'dense', got '", std::string(output),
             "'");
  }
  check_tensor(logits, "logits", logits.dim(), dev);
  check_dtype(logits, "logits", at::kFloat);
  check_contiguous(logits, "logits");
  if (mode != gemma4_mtp::CentroidOutput::kDense) {
    check_tensor(ids, "ids", ids.dim(), dev);
    check_dtype(ids, "ids", at::kLong);
    check_contiguous(ids, "ids");
  }
  // phase 2's order: the plan's ("auto"), or forced (benchmarks, tests); cluster-major serves argmax and topk
  const bool ranked = mode == gemma4_mtp::CentroidOutput::kArgmax || mode == gemma4_mtp::CentroidOutput::kTopK;
  G4_CHECK(order == "auto" || order == "tokens" || (order == "clusters" && ranked),
           "gemma4_mtp: order must be 'auto', 'tokens' or, for argmax and topk, 'clusters', got '", std::string(order),
           "'");
  check_inner(hidden, "hidden");
  G4_CHECK(T <= INT32_MAX && Hd <= INT32_MAX, "gemma4_mtp: hidden sizes must fit 32-bit ints, got ", hidden.sizes());
  // hidden, centroids and lm_head rows are read with 16-byte loads when their data pointers and row
  // strides allow it; otherwise the launcher takes the element-wise path (never a misaligned load).

  const c10::cuda::CUDAGuard guard(dev);
  gemma4_mtp::CentroidParams p{};
  p.hidden = hidden.data_ptr();
  p.centroids = centroids.data_ptr();
  p.token_ordering = token_ordering.data_ptr();
  p.ordering_int64 = token_ordering.scalar_type() == at::kLong;
  p.lm_head = lm_head.data_ptr();
  p.hidden_stride = stride(hidden, 0);
  p.centroid_stride = stride(centroids, 0);
  p.lm_head_stride = stride(lm_head, 0);
  p.T = static_cast<int>(T);
  p.Hd = static_cast<int>(Hd);
  p.C = static_cast<int>(C);
  p.top_k = static_cast<int>(top_k);
  p.V = V;
  p.output = mode;
  p.k = mode == gemma4_mtp::CentroidOutput::kTopK ? static_cast<int>(ids.size(1)) : 1;
  p.ids = mode == gemma4_mtp::CentroidOutput::kDense ? nullptr : ids.data_ptr<int64_t>();
  p.logits = logits.data_ptr<float>();
  p.order = order == "tokens"     ? gemma4_mtp::CentroidOrder::kTokens
            : order == "clusters" ? gemma4_mtp::CentroidOrder::kClusters
                                  : gemma4_mtp::CentroidOrder::kAuto;
  if (T == 0) return;
  at::Tensor fresh;
  p.counters = zeroed_counters("centroid_logits", gemma4_mtp::kCentroidCounters, hidden, &fresh);
  const int64_t ws_bytes = gemma4_mtp::prepare_centroid_logits(p, sm_count());
  at::Tensor ws = at::empty({ws_bytes}, hidden.options().dtype(at::kByte));
  p.workspace = ws.data_ptr();
  check_launch(gemma4_mtp::launch_centroid_logits(dt, p, at::cuda::getCurrentCUDAStream()), "centroid_logits");
}

void tree_verify(const at::Tensor& draft_tokens, const at::Tensor& parents, const at::Tensor& target_logits,
                 const std::optional<at::Tensor>& temperature, const std::optional<at::Tensor>& uniforms,
                 const std::optional<at::Tensor>& draft_probs, at::Tensor& accept_len, at::Tensor& accepted_nodes,
                 at::Tensor& output_tokens, at::Tensor& last_node) {
  const auto dev = target_logits.device();
  check_tensor(target_logits, "target_logits", 3, dev);
  check_tensor(draft_tokens, "draft_tokens", 2, dev);
  check_tensor(parents, "parents", 2, dev);
  const DType dt = float_dtype(target_logits, "target_logits");
  check_dtype(draft_tokens, "draft_tokens", at::kInt, at::kLong);
  check_dtype(parents, "parents", at::kInt);
  const int64_t B = target_logits.size(0), N = target_logits.size(1), V = target_logits.size(2);
  G4_CHECK(N >= 1 && V >= 1 && V <= INT32_MAX, "gemma4_mtp: target_logits must have N >= 1 and 1 <= V < 2^31, got ",
           target_logits.sizes());
  check_shape(draft_tokens, "draft_tokens", {B, N});
  check_shape(parents, "parents", {B, N});
  check_contiguous(draft_tokens, "draft_tokens");
  check_contiguous(parents, "parents");
  check_inner(target_logits, "target_logits");
  if (temperature) {
    check_tensor(*temperature, "temperature", 1, dev);
    check_dtype(*temperature, "temperature", at::kFloat);
    check_shape(*temperature, "temperature", {B});
    check_contiguous(*temperature, "temperature");
    G4_CHECK(uniforms.has_value(), "gemma4_mtp: uniforms are required when temperature is given");
  }
  if (uniforms) {
    check_tensor(*uniforms, "uniforms", 3, dev);
    check_dtype(*uniforms, "uniforms", at::kFloat);
    check_shape(*uniforms, "uniforms", {B, N, 2});
    check_contiguous(*uniforms, "uniforms");
  }
  if (draft_probs) {
    G4_CHECK(temperature.has_value(), "gemma4_mtp: draft_probs need temperature");
    check_tensor(*draft_probs, "draft_probs", 3, dev);
    check_dtype(*draft_probs, "draft_probs", at::kFloat, target_logits.scalar_type());
    check_shape(*draft_probs, "draft_probs", {B, N, V});
    check_inner(*draft_probs, "draft_probs");
  }
  check_tensor(accept_len, "accept_len", 1, dev);
  check_tensor(accepted_nodes, "accepted_nodes", 2, dev);
  check_tensor(output_tokens, "output_tokens", 2, dev);
  check_tensor(last_node, "last_node", 1, dev);
  check_dtype(accept_len, "accept_len", at::kInt);
  check_dtype(accepted_nodes, "accepted_nodes", at::kInt);
  check_dtype(output_tokens, "output_tokens", at::kLong);
  check_dtype(last_node, "last_node", at::kInt);
  check_shape(accept_len, "accept_len", {B});
  check_shape(accepted_nodes, "accepted_nodes", {B, N});
  check_shape(output_tokens, "output_tokens", {B, N});
  check_shape(last_node, "last_node", {B});
  for (auto [t, name] : {std::pair{&accept_len, "accept_len"}, {&accepted_nodes, "accepted_nodes"},
                         {&output_tokens, "output_tokens"}, {&last_node, "last_node"}})
    check_contiguous(*t, name);
  if (B == 0) return;

  const c10::cuda::CUDAGuard guard(dev);
  gemma4_mtp::TreeVerifyParams p{};
  p.draft_tokens = draft_tokens.data_ptr();
  p.draft_int64 = draft_tokens.scalar_type() == at::kLong;
  p.parents = parents.data_ptr<int32_t>();
  p.logits = target_logits.data_ptr();
  p.logits_stride[0] = stride(target_logits, 0);
  p.logits_stride[1] = stride(target_logits, 1);
  p.temperature = temperature ? temperature->data_ptr<float>() : nullptr;
  p.uniforms = uniforms ? uniforms->data_ptr<float>() : nullptr;
  if (draft_probs) {
    p.draft_probs = draft_probs->data_ptr();  // any alignment: misaligned rows take the scalar-load kernel
    p.draft_probs_fp32 = draft_probs->scalar_type() == at::kFloat;
    p.draft_probs_stride[0] = stride(*draft_probs, 0);
    p.draft_probs_stride[1] = stride(*draft_probs, 1);
  }
  p.B = static_cast<int>(B);
  p.N = static_cast<int>(N);
  p.V = V;
  p.accept_len = accept_len.data_ptr<int32_t>();
  p.accepted_nodes = accepted_nodes.data_ptr<int32_t>();
  p.output_tokens = output_tokens.data_ptr<int64_t>();
  p.last_node = last_node.data_ptr<int32_t>();
  const int64_t ws_bytes = gemma4_mtp::prepare_tree_verify(dt, p, sm_count());
  G4_CHECK_TYPE(ws_bytes >= 0, "gemma4_mtp::tree_verify: unsupported dtype");
  at::Tensor ws = at::empty({ws_bytes}, target_logits.options().dtype(at::kByte));
  p.workspace = ws.data_ptr();
  at::Tensor fresh;  // graph-private counters, alive until the launch is enqueued
  p.counters = zeroed_counters("tree_verify", gemma4_mtp::tree_verify_counters(p.B, p.N), target_logits, &fresh);
  check_launch(gemma4_mtp::launch_tree_verify(dt, p, at::cuda::getCurrentCUDAStream()), "tree_verify");
}

// dense_lm_head's weight [V, Hd] of `type` on dev and its k (dense_lm_head and the drafter step's head),
// each named.
void check_dense_head(const at::Tensor& lm_head, int64_t k, int64_t Hd, const at::Device& dev, at::ScalarType type,
                      DType dt) {
  check_tensor(lm_head, "lm_head", 2, dev);
  check_dtype(lm_head, "lm_head", type);
  const int64_t V = lm_head.size(0);
  G4_CHECK(lm_head.size(1) == Hd, "gemma4_mtp: lm_head must have Hd = ", Hd, " columns, got ", lm_head.sizes());
  G4_CHECK(V >= 1 && V <= INT32_MAX && Hd <= INT32_MAX,
           "gemma4_mtp: dense_lm_head sizes must fit 32-bit indices (and V >= 1): lm_head ", lm_head.sizes());
  check_inner(lm_head, "lm_head");
  G4_CHECK(gemma4_mtp::dense_lm_head_smem_bytes(dt, Hd) <= 48 * 1024,
           "gemma4_mtp: dense_lm_head stages 8 hidden rows in 48 KiB of shared memory: Hd ", Hd, " is too wide");
  G4_CHECK(1 <= k && k <= gemma4_mtp::kMaxDenseHeadK && k <= V, "gemma4_mtp: dense_lm_head k must be in [1, min(",
           gemma4_mtp::kMaxDenseHeadK, ", V)], got ", k);
}

// output "topk": ids / logits [T, k] (dense unused, may be empty); "dense": dense [T, V] fp32 (ids /
// logits unused). The top-k lists of kernel 1 go to a workspace from the caching allocator.
void dense_lm_head(const at::Tensor& hidden, const at::Tensor& lm_head, int64_t k, c10::string_view output,
                   at::Tensor& ids, at::Tensor& logits, at::Tensor& dense) {
  const auto dev = hidden.device();
  check_tensor(hidden, "hidden", 2, dev);
  const DType dt = float_dtype(hidden, "hidden");
  const int64_t T = hidden.size(0), Hd = hidden.size(1);
  G4_CHECK(T <= INT32_MAX, "gemma4_mtp: dense_lm_head hidden rows must fit 32-bit indices, got ", hidden.sizes());
  check_inner(hidden, "hidden");
  check_dense_head(lm_head, k, Hd, dev, hidden.scalar_type(), dt);
  const int64_t V = lm_head.size(0);
  const bool is_dense = output == "dense";
  G4_CHECK(is_dense || output == "topk", "gemma4_mtp: dense_lm_head output must be 'topk' or 'dense', got ",
           std::string(output));
  gemma4_mtp::DenseHeadParams p{};
  if (is_dense) {
    check_tensor(dense, "dense", 2, dev);
    check_dtype(dense, "dense", at::kFloat);
    check_shape(dense, "dense", {T, V});
    check_inner(dense, "dense");
    p.dense = dense.data_ptr<float>();
    p.dense_stride = dense.stride(0);
  } else {
    check_tensor(ids, "ids", 2, dev);
    check_tensor(logits, "logits", 2, dev);
    check_dtype(ids, "ids", at::kLong);
    check_dtype(logits, "logits", at::kFloat);
    check_shape(ids, "ids", {T, k});
    check_shape(logits, "logits", {T, k});
    check_contiguous(ids, "ids");
    check_contiguous(logits, "logits");
    p.out_ids = ids.data_ptr<int64_t>();
    p.out_logits = logits.data_ptr<float>();
  }
  if (T == 0) return;

  const c10::cuda::CUDAGuard guard(dev);
  p.hidden = hidden.data_ptr();
  p.lm_head = lm_head.data_ptr();
  p.hidden_stride = stride(hidden, 0);
  p.head_stride = stride(lm_head, 0);
  p.T = static_cast<int>(T);
  p.V = static_cast<int>(V);
  p.Hd = static_cast<int>(Hd);
  p.k = static_cast<int>(k);
  const int64_t ws_bytes = gemma4_mtp::prepare_dense_lm_head(p, sm_count());
  at::Tensor ws = at::empty({ws_bytes}, hidden.options().dtype(at::kByte));
  p.partial = ws_bytes ? reinterpret_cast<uint64_t*>(ws.data_ptr()) : nullptr;
  check_launch(gemma4_mtp::launch_dense_lm_head(dt, p, at::cuda::getCurrentCUDAStream()), "dense_lm_head");
}

// ---- the fused glue ops: rms_norm_linear, rms_norm_gate_up, rms_norm_q_rope (one kernel header,
// csrc/include/gemma4_mtp/rms_norm_linear.cuh). x [T, H] and the decoder-layer prologue are shared.

using OptTensor = std::optional<at::Tensor>;

void check_vector(const OptTensor& t, const char* name, int64_t n, const at::Tensor& x) {
  if (t) check_dense(*t, name, {n}, x.device(), x.scalar_type());
}

void check_rows(const OptTensor& t, const char* name, const at::Tensor& x) {
  if (!t) return;
  check_tensor(*t, name, 2, x.device());
  check_dtype(*t, name, x.scalar_type());
  check_shape(*t, name, x.sizes());
  check_inner(*t, name);
}

// A weight [rows (< 0: any), cols] of x's dtype and device, rows in 32 bits: cols is x's H unless given
// (`cols_name` says what it is in the message).
void check_weight(const at::Tensor& w, const char* name, int64_t rows, const at::Tensor& x, int64_t cols = -1,
                  const char* cols_name = "H") {
  if (cols < 0) cols = x.size(1);
  check_tensor(w, name, 2, x.device());
  check_dtype(w, name, x.scalar_type());
  G4_CHECK(w.size(1) == cols && (rows < 0 || w.size(0) == rows), "gemma4_mtp: ", name, " must have ",
           rows < 0 ? "" : std::to_string(rows) + " rows and ", cols_name, " = ", cols, " columns, got shape ",
           w.sizes());
  check_inner(w, name);
  G4_CHECK(w.size(0) <= INT32_MAX, "gemma4_mtp: ", name, " rows must fit 32-bit indices, got ", w.sizes());
}

// Checks x and the prologue's tensors (naming each) and fills their part of p; returns x's dtype.
DType glue_prologue(gemma4_mtp::GlueParams& p, gemma4_mtp::GlueKind kind, const at::Tensor& x,
                    const OptTensor& norm_weight, double eps, const OptTensor& residual,
                    const OptTensor& residual_norm_weight, const OptTensor& layer_scalar, const OptTensor& residual_out,
                    const OptTensor& normed_out) {
  check_tensor(x, "x", 2, x.device());
  const DType dt = float_dtype(x, "x");
  check_inner(x, "x");
  const int64_t T = x.size(0), H = x.size(1);
  G4_CHECK(T <= INT32_MAX && H <= INT32_MAX, "gemma4_mtp: x sizes must fit 32-bit indices, got ", x.sizes());
  check_vector(norm_weight, "norm_weight", H, x);
  check_rows(residual, "residual", x);
  check_vector(residual_norm_weight, "residual_norm_weight", H, x);
  check_vector(layer_scalar, "layer_scalar", 1, x);
  G4_CHECK(!residual || residual_norm_weight, "gemma4_mtp: residual_norm_weight is required with residual");
  G4_CHECK(residual || (!residual_norm_weight && !layer_scalar && !residual_out),
           "gemma4_mtp: residual_norm_weight, layer_scalar and residual_out need residual");
  G4_CHECK(!normed_out || norm_weight, "gemma4_mtp: normed_out needs norm_weight");
  check_rows(residual_out, "residual_out", x);
  check_rows(normed_out, "normed_out", x);
  auto ptr = [](const OptTensor& t) -> void* { return t ? t->data_ptr() : nullptr; };
  p.kind = kind;
  p.x = x.data_ptr();
  p.x_stride = stride(x, 0);
  p.residual = ptr(residual);
  p.residual_stride = residual ? stride(*residual, 0) : 0;
  p.residual_norm_weight = ptr(residual_norm_weight);
  p.layer_scalar = ptr(layer_scalar);
  p.norm_weight = ptr(norm_weight);
  p.eps = static_cast<float>(eps);
  p.residual_out = ptr(residual_out);
  p.residual_out_stride = residual_out ? stride(*residual_out, 0) : 0;
  p.normed_out = ptr(normed_out);
  p.normed_out_stride = normed_out ? stride(*normed_out, 0) : 0;
  p.T = static_cast<int>(T);
  p.H = static_cast<int>(H);
  return dt;
}

// Plans the launch for this device, takes its partials, workspace and cached counters, launches.
void launch_glue(gemma4_mtp::GlueParams& p, DType dt, const at::Tensor& x, const char* op,
                 cudaError_t (*launch)(DType, const gemma4_mtp::GlueParams&, cudaStream_t)) {
  if (p.T == 0 || p.N == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  int64_t ws_bytes = 0, n_counters = 0;
  const int64_t part_bytes = gemma4_mtp::prepare_rms_norm_glue(dt, p, sm_count(), &ws_bytes, &n_counters);
  at::Tensor fresh, partials, ws;
  p.counters = n_counters > 0 ? zeroed_counters(op, n_counters, x, &fresh) : nullptr;
  if (part_bytes > 0) {
    partials = at::empty({part_bytes / 4}, x.options().dtype(at::kFloat));
    p.partials = partials.data_ptr<float>();
  }
  if (ws_bytes > 0) {
    ws = at::empty({ws_bytes}, x.options().dtype(at::kByte));
    p.workspace = ws.data_ptr();
  }
  check_launch(launch(dt, p, at::cuda::getCurrentCUDAStream()), op);
}

// Checks the projection's weight [N, H] (`name`) and out (contiguous, `out_shape`: [T, N], or q_rope's
// [T, N / D, D]) and fills their part of p.
void glue_projection(gemma4_mtp::GlueParams& p, const at::Tensor& weight, const char* name, const at::Tensor& x,
                     at::Tensor& out, at::IntArrayRef out_shape) {
  check_weight(weight, name, -1, x);
  check_dense(out, "out", out_shape, x.device(), x.scalar_type());
  p.weight = weight.data_ptr();
  p.weight_stride = stride(weight, 0);
  p.out = out.data_ptr();
  p.out_stride = out.stride(0);
  p.N = static_cast<int>(weight.size(0));
}

void rms_norm_linear(const at::Tensor& x, const at::Tensor& weight, const OptTensor& norm_weight, double eps,
                     const OptTensor& residual, const OptTensor& residual_norm_weight, const OptTensor& layer_scalar,
                     at::Tensor& out, const OptTensor& residual_out, const OptTensor& normed_out) {
  gemma4_mtp::GlueParams p{};
  const DType dt = glue_prologue(p, gemma4_mtp::GlueKind::kLinear, x, norm_weight, eps, residual,
                                 residual_norm_weight, layer_scalar, residual_out, normed_out);
  glue_projection(p, weight, "weight", x, out, {x.size(0), weight.size(0)});
  launch_glue(p, dt, x, "rms_norm_linear", gemma4_mtp::launch_rms_norm_linear);
}

// With down_weight [N, I], the whole MLP into out [T, N]: one launch where glue_mlp_one_launch() says
// (the kernel's tree over the tiles' down partials), otherwise gate_up into m, then rms_norm_linear.
void rms_norm_gate_up(const at::Tensor& x, const at::Tensor& gate_weight, const at::Tensor& up_weight,
                      const OptTensor& down_weight, const OptTensor& norm_weight, double eps,
                      const OptTensor& residual, const OptTensor& residual_norm_weight, const OptTensor& layer_scalar,
                      at::Tensor& out, const OptTensor& residual_out) {
  gemma4_mtp::GlueParams p{};
  const DType dt = glue_prologue(p, gemma4_mtp::GlueKind::kGateUp, x, norm_weight, eps, residual,
                                 residual_norm_weight, layer_scalar, residual_out, std::nullopt);
  check_weight(gate_weight, "gate_weight", -1, x);
  const int64_t T = x.size(0), I = gate_weight.size(0);
  check_weight(up_weight, "up_weight", I, x);
  at::Tensor m = out;
  bool one_launch = false;
  if (down_weight) {
    check_weight(*down_weight, "down_weight", -1, x, I, "I = gate_weight.shape[0]");
    check_dense(out, "out", {T, down_weight->size(0)}, x.device(), x.scalar_type());
    if (I == 0) {  // an empty sum
      out.zero_();
      return;
    }
    one_launch = gemma4_mtp::glue_mlp_one_launch(T, x.size(1), I, down_weight->size(0), x.element_size());
    if (one_launch) {
      p.down_weight = down_weight->data_ptr();
      p.down_weight_stride = stride(*down_weight, 0);
      p.down_N = static_cast<int>(down_weight->size(0));
    } else {
      m = at::empty({T, I}, x.options());
    }
  }
  glue_projection(p, gate_weight, "gate_weight", x, m, {T, one_launch ? down_weight->size(0) : I});
  p.N = static_cast<int>(I);
  p.up_weight = up_weight.data_ptr();
  p.up_weight_stride = stride(up_weight, 0);
  launch_glue(p, dt, x, "rms_norm_gate_up", gemma4_mtp::launch_rms_norm_gate_up);
  if (down_weight && !one_launch)
    rms_norm_linear(m, *down_weight, std::nullopt, eps, std::nullopt, std::nullopt, std::nullopt, out, std::nullopt,
                    std::nullopt);
}

void rms_norm_q_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& q_norm_weight,
                     const at::Tensor& positions, const at::Tensor& inv_freq, const OptTensor& norm_weight, double eps,
                     const OptTensor& residual, const OptTensor& residual_norm_weight, const OptTensor& layer_scalar,
                     at::Tensor& out, const OptTensor& residual_out) {
  gemma4_mtp::GlueParams p{};
  const DType dt = glue_prologue(p, gemma4_mtp::GlueKind::kQRope, x, norm_weight, eps, residual,
                                 residual_norm_weight, layer_scalar, residual_out, std::nullopt);
  check_tensor(weight, "weight", 2, x.device());
  check_tensor(q_norm_weight, "q_norm_weight", 1, x.device());
  const int64_t D = q_norm_weight.size(0), N = weight.size(0);
  check_vector(q_norm_weight, "q_norm_weight", D, x);
  G4_CHECK(D == 64 || D == 128 || D == 256 || D == 512, "gemma4_mtp: q_norm_weight must have a head dim of 64, "
           "128, 256 or 512 elements, got ", D);
  G4_CHECK(N > 0 && N % D == 0, "gemma4_mtp: weight must have a positive multiple of the head dim ", D,
           " rows, got shape ", weight.sizes());
  check_tensor(positions, "positions", 1, x.device());
  check_dtype(positions, "positions", at::kInt, at::kLong);
  check_contiguous(positions, "positions");
  const int64_t T = x.size(0), P = positions.size(0);
  G4_CHECK(T == 0 || (P > 0 && T % P == 0), "gemma4_mtp: positions must have a length dividing T = ", T,
           ", got ", P);
  check_tensor(inv_freq, "inv_freq", 1, x.device());
  check_dtype(inv_freq, "inv_freq", at::kFloat);
  check_shape(inv_freq, "inv_freq", {D / 2});
  check_contiguous(inv_freq, "inv_freq");
  glue_projection(p, weight, "weight", x, out, {T, N / D, D});
  p.q_norm_weight = q_norm_weight.data_ptr();
  p.positions = positions.data_ptr();
  p.positions_int64 = positions.scalar_type() == at::kLong;
  p.inv_freq = inv_freq.data_ptr<float>();
  p.D = static_cast<int>(D);
  p.per_pos = P > 0 ? static_cast<int>(T / P) : 1;
  launch_glue(p, dt, x, "rms_norm_q_rope", gemma4_mtp::launch_rms_norm_q_rope);
}

// softmax_sample's per-row arguments for B rows of V logits on dev (softmax_sample and the drafter step's
// sampled head), each named.
void check_sampling(const at::Tensor& temperature, const at::Tensor& uniforms, const at::Tensor& probs, int64_t B,
                    int64_t V, const at::Device& dev) {
  check_tensor(temperature, "temperature", 1, dev);
  check_dtype(temperature, "temperature", at::kFloat);
  check_shape(temperature, "temperature", {B});
  check_tensor(uniforms, "uniforms", 1, dev);
  check_dtype(uniforms, "uniforms", at::kDouble);
  check_shape(uniforms, "uniforms", {B});
  check_tensor(probs, "probs", 2, dev);
  check_dtype(probs, "probs", at::kFloat);
  check_shape(probs, "probs", {B, V});
  check_inner(probs, "probs");
}

// q [B, V] fp32 (rows strided) and tokens [B] int64 are written; the chunk statistics and masses go to
// a workspace from the caching allocator, the per-row counters to the op's zeroed cache.
void softmax_sample(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& uniforms,
                    at::Tensor& probs, at::Tensor& tokens) {
  const auto dev = logits.device();
  check_tensor(logits, "logits", 2, dev);
  const DType dt = float_dtype(logits, "logits");
  const int64_t B = logits.size(0), V = logits.size(1);
  G4_CHECK(V >= 1 && V <= INT32_MAX && B <= 65535, "gemma4_mtp: softmax_sample needs 1 <= V < 2^31 and B <= 65535, "
           "got logits ", logits.sizes());
  check_inner(logits, "logits");
  check_sampling(temperature, uniforms, probs, B, V, dev);
  check_dense(tokens, "tokens", {B}, dev, at::kLong);
  if (B == 0) return;

  const c10::cuda::CUDAGuard guard(dev);
  gemma4_mtp::SoftmaxSampleParams p{};
  p.logits = logits.data_ptr();
  p.logit_stride = stride(logits, 0);
  p.temperature = temperature.data_ptr<float>();
  p.temp_stride = stride(temperature, 0);
  p.uniforms = uniforms.data_ptr<double>();
  p.u_stride = stride(uniforms, 0);
  p.probs = probs.data_ptr<float>();
  p.probs_stride = stride(probs, 0);
  p.tokens = tokens.data_ptr<int64_t>();
  p.B = static_cast<int>(B);
  p.V = static_cast<int>(V);
  p.P = gemma4_mtp::softmax_sample_chunks(p.V);
  at::Tensor ws = at::empty({gemma4_mtp::softmax_sample_workspace_bytes(p.B, p.P) / 8}, logits.options().dtype(at::kDouble));
  gemma4_mtp::softmax_sample_carve(p, ws.data_ptr());
  at::Tensor fresh;  // graph-private counters, alive until the launch is enqueued
  p.counters = zeroed_counters("softmax_sample", B, logits, &fresh);
  check_launch(gemma4_mtp::launch_softmax_sample(dt, p, at::cuda::getCurrentCUDAStream()), "softmax_sample");
}

// ---- a whole drafter step in one call (csrc/ops/drafter_step.cu) ----

// The names of a layer's 12 tensors in layer_weights, in order (python_api/gemma4_mtp/drafter.py
// _LayerWeights).
constexpr const char* kLayerWeightNames[] = {"input_norm", "q_proj", "q_norm", "inv_freq", "o_proj",
                                             "post_attn_norm", "pre_ff_norm", "gate", "up", "down",
                                             "post_ff_norm", "layer_scalar"};
constexpr int64_t kLayerWeights = 12;

// layer_weights[layer * 12 + i]: on the device, of dtype `type`, contiguous, of `shape`; the message
// names the layer and the weight.
const at::Tensor& step_weight(const at::TensorList& w, int64_t layer, int i, const at::Device& dev,
                              at::ScalarType type, at::IntArrayRef shape) {
  const at::Tensor& t = w[layer * kLayerWeights + i];
  const char* name = kLayerWeightNames[i];
  G4_CHECK(t.is_cuda() && t.device() == dev, "gemma4_mtp: drafter_step: layer ", layer, " ", name, " must be on ",
           dev, ", got ", t.device());
  G4_CHECK_TYPE(t.scalar_type() == type, "gemma4_mtp: drafter_step: layer ", layer, " ", name, " has dtype ",
           t.scalar_type(), ", expected ", type);
  G4_CHECK(t.sizes() == shape, "gemma4_mtp: drafter_step: layer ", layer, " ", name, " must have shape ", shape,
           ", got ", t.sizes());
  G4_CHECK(t.is_contiguous(), "gemma4_mtp: drafter_step: layer ", layer, " ", name, " must be contiguous, got strides ",
           t.strides());
  return t;
}

void drafter_step(const at::Tensor& token_ids, const at::Tensor& hidden, const at::Tensor& embed_table,
                  double embed_scale, const at::Tensor& pre_projection, at::TensorList layer_weights,
                  at::IntArrayRef layer_kv, at::TensorList k_caches, at::TensorList v_caches,
                  at::TensorList block_tables, at::IntArrayRef windows, const at::Tensor& seq_lens,
                  const at::Tensor& positions, const at::Tensor& final_norm, const at::Tensor& post_projection,
                  double eps, const OptTensor& centroids, const OptTensor& token_ordering, const OptTensor& lm_head,
                  int64_t centroid_top_k, const OptTensor& temperature, const OptTensor& uniforms, at::Tensor& last,
                  at::Tensor& proj, const OptTensor& ids, const OptTensor& scores, const OptTensor& probs) {
  const auto dev = hidden.device();
  G4_CHECK(std::isfinite(embed_scale), "gemma4_mtp: drafter_step: embed_scale must be finite, got ",
           std::to_string(embed_scale));
  G4_CHECK(std::isfinite(eps) && eps >= 0, "gemma4_mtp: drafter_step: eps must be finite and >= 0, got ",
           std::to_string(eps));
  check_tensor(token_ids, "token_ids", 2, dev);
  check_dtype(token_ids, "token_ids", at::kInt, at::kLong);
  check_contiguous(token_ids, "token_ids");
  const int64_t B = token_ids.size(0), Q = token_ids.size(1), T = B * Q;
  G4_CHECK(B >= 1 && Q >= 1, "gemma4_mtp: drafter_step: token_ids must be a non-empty [B, Q], got ", token_ids.sizes());
  check_tensor(hidden, "hidden", 2, dev);
  const DType dt = float_dtype(hidden, "hidden");
  const at::ScalarType type = hidden.scalar_type();
  const int64_t Hb = hidden.size(1);
  G4_CHECK(hidden.size(0) == T, "gemma4_mtp: drafter_step: hidden must have T = B * Q = ", T, " rows, got ",
           hidden.sizes());
  check_inner(hidden, "hidden");
  check_tensor(embed_table, "embed_table", 2, dev);
  check_dtype(embed_table, "embed_table", type);
  G4_CHECK(embed_table.size(1) == Hb, "gemma4_mtp: drafter_step: embed_table must have Hb = ", Hb, " columns, got ",
           embed_table.sizes());
  check_inner(embed_table, "embed_table");
  check_tensor(pre_projection, "pre_projection", 2, dev);  // before its rows are read
  const int64_t Hd = pre_projection.size(0);
  check_dense(pre_projection, "pre_projection", {Hd, 2 * Hb}, dev, type);
  check_dense(final_norm, "final_norm", {Hd}, dev, type);
  check_dense(post_projection, "post_projection", {Hb, Hd}, dev, type);
  check_dense(seq_lens, "seq_lens", {B}, dev, at::kInt);
  check_dense(positions, "positions", {B}, dev, at::kInt, at::kLong);
  check_dense(last, "last", {B, Q, Hd}, dev, type);
  check_dense(proj, "proj", {B, Q, Hb}, dev, type);

  gemma4_mtp::DrafterStepParams p{};
  const int64_t L = static_cast<int64_t>(layer_kv.size()), K = static_cast<int64_t>(k_caches.size());
  G4_CHECK(L >= 1 && static_cast<int64_t>(layer_weights.size()) == kLayerWeights * L,
           "gemma4_mtp: drafter_step: layer_kv must name at least one layer and layer_weights hold 12 tensors a "
           "layer, got ", L, " layers and ", layer_weights.size(), " tensors");
  G4_CHECK(K >= 1 && static_cast<int64_t>(v_caches.size()) == K && static_cast<int64_t>(block_tables.size()) == K &&
               static_cast<int64_t>(windows.size()) == K,
           "gemma4_mtp: drafter_step: k_caches, v_caches, block_tables and windows must hold one entry per attention "
           "type, got ", K, ", ", v_caches.size(), ", ", block_tables.size(), ", ", windows.size());
  std::vector<gemma4_mtp::DrafterStepKV> kvs(static_cast<size_t>(K));
  std::vector<gemma4_mtp::DrafterStepLayer> layers(static_cast<size_t>(L));
  p.kv = kvs.data();
  p.layers = layers.data();
  for (int64_t j = 0; j < K; ++j) {
    const at::Tensor &k = k_caches[j], &v = v_caches[j], &table = block_tables[j];
    const std::string index = "[" + std::to_string(j) + "]", kn = "k_caches" + index, vn = "v_caches" + index,
                      tn = "block_tables" + index;
    check_tensor(k, kn.c_str(), 4, dev);
    check_dtype(k, kn.c_str(), type);
    check_16_byte_rows(k, kn.c_str());
    check_inner(k, kn.c_str());
    check_tensor(v, vn.c_str(), 4, dev);
    check_dtype(v, vn.c_str(), type);
    check_shape(v, vn.c_str(), k.sizes());
    check_16_byte_rows(v, vn.c_str());
    check_inner(v, vn.c_str());
    check_tensor(table, tn.c_str(), 2, dev);
    check_dtype(table, tn.c_str(), at::kInt);
    G4_CHECK(table.size(0) == B, "gemma4_mtp: drafter_step: block_tables[", j, "] must have B = ", B, " rows, got ",
             table.sizes());
    check_inner(table, tn.c_str());
    const int64_t D = k.size(3);
    G4_CHECK(D == 64 || D == 128 || D == 256 || D == 512, "gemma4_mtp: drafter_step: k_caches[", j,
             "] head dim must be 64, 128, 256 or 512, got shape ", k.sizes());
    G4_CHECK(k.size(0) <= INT32_MAX && k.size(1) > 0 && k.size(2) > 0 && table.size(1) <= INT32_MAX,
             "gemma4_mtp: drafter_step: k_caches[", j, "] ", k.sizes(), " or block_tables[", j, "] ", table.sizes(),
             " out of range");
    gemma4_mtp::DrafterStepKV& kv = kvs[j];
    kv.k_cache = k.data_ptr();
    kv.v_cache = v.data_ptr();
    for (int i = 0; i < 3; ++i) {
      kv.k_stride[i] = stride(k, i);
      kv.v_stride[i] = stride(v, i);
    }
    kv.block_table = table.data_ptr<int32_t>();
    kv.block_table_stride = table.stride(0);
    kv.num_blocks = static_cast<int>(k.size(0));
    kv.block_size = static_cast<int>(k.size(1));
    kv.Hkv = static_cast<int>(k.size(2));
    kv.D = static_cast<int>(D);
    kv.max_blocks = static_cast<int>(table.size(1));
    kv.window = windows[j];
  }
  int64_t Hq = 0;
  for (int64_t i = 0; i < L; ++i) {
    G4_CHECK(layer_kv[i] >= 0 && layer_kv[i] < K, "gemma4_mtp: drafter_step: layer_kv[", i, "] must be in [0, ", K,
             "), got ", layer_kv[i]);
    const gemma4_mtp::DrafterStepKV& kv = p.kv[layer_kv[i]];
    const int64_t D = kv.D;
    const at::Tensor& q_proj = layer_weights[i * kLayerWeights + 1];
    if (i == 0) Hq = q_proj.dim() == 2 ? q_proj.size(0) / D : 0;
    G4_CHECK(Hq >= 1 && Hq % kv.Hkv == 0, "gemma4_mtp: drafter_step: layer ", i, " q_proj ", q_proj.sizes(),
             " must hold a multiple of the KV heads (", kv.Hkv, ") of head dim ", D);
    const int64_t I = layer_weights[i * kLayerWeights + 7].dim() == 2 ? layer_weights[i * kLayerWeights + 7].size(0) : 0;
    G4_CHECK(I >= 1 && I <= INT32_MAX, "gemma4_mtp: drafter_step: layer ", i, " gate must be [I, Hd], got ",
             layer_weights[i * kLayerWeights + 7].sizes());
    gemma4_mtp::DrafterStepLayer& w = layers[i];
    auto vec = [&](int k) { return step_weight(layer_weights, i, k, dev, type, {Hd}).data_ptr(); };
    w.kv = static_cast<int>(layer_kv[i]);
    w.input_norm = vec(0);
    w.q_proj = step_weight(layer_weights, i, 1, dev, type, {Hq * D, Hd}).data_ptr();
    w.q_norm = step_weight(layer_weights, i, 2, dev, type, {D}).data_ptr();
    w.inv_freq = step_weight(layer_weights, i, 3, dev, at::kFloat, {D / 2}).data_ptr<float>();
    w.o_proj = step_weight(layer_weights, i, 4, dev, type, {Hd, Hq * D}).data_ptr();
    w.post_attn_norm = vec(5);
    w.pre_ff_norm = vec(6);
    w.gate = step_weight(layer_weights, i, 7, dev, type, {I, Hd}).data_ptr();
    w.up = step_weight(layer_weights, i, 8, dev, type, {I, Hd}).data_ptr();
    w.down = step_weight(layer_weights, i, 9, dev, type, {Hd, I}).data_ptr();
    w.post_ff_norm = vec(10);
    w.layer_scalar = step_weight(layer_weights, i, 11, dev, type, {1}).data_ptr();
    w.I = static_cast<int>(I);
  }
  // the kernels index rows, heads and columns with 32-bit ints
  G4_CHECK(T * Hq <= INT32_MAX && 2 * Hb <= INT32_MAX && Hd <= INT32_MAX && Hq * 512 <= INT32_MAX,
           "gemma4_mtp: drafter_step sizes must fit 32-bit indices: hidden ", hidden.sizes(), ", pre_projection ",
           pre_projection.sizes());
  p.B = static_cast<int>(B);
  p.Q = static_cast<int>(Q);
  p.Hb = static_cast<int>(Hb);
  p.Hd = static_cast<int>(Hd);
  p.Hq = static_cast<int>(Hq);
  p.num_layers = static_cast<int>(L);
  p.num_kv = static_cast<int>(K);
  p.eps = static_cast<float>(eps);
  p.token_ids = token_ids.data_ptr();
  p.token_ids_int64 = token_ids.scalar_type() == at::kLong;
  p.embed_table = embed_table.data_ptr();
  p.table_stride = embed_table.stride(0);
  p.vocab = embed_table.size(0);
  p.embed_scale = static_cast<float>(embed_scale);
  p.hidden = hidden.data_ptr();
  p.hidden_stride = hidden.stride(0);
  p.pre_projection = pre_projection.data_ptr();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.positions = positions.data_ptr();
  p.positions_int64 = positions.scalar_type() == at::kLong;
  p.final_norm = final_norm.data_ptr();
  p.post_projection = post_projection.data_ptr();
  p.last = last.data_ptr();
  p.proj = proj.data_ptr();
  // the LM head's k best tokens of last (Gemma4MTPDrafter.step_top_tokens), or with temperature a token
  // drawn per row (step_sample_tokens): the centroid head with centroids and token_ordering, the dense one
  // without
  const bool sampled = temperature.has_value();
  G4_CHECK(lm_head.has_value() == ids.has_value() &&
               (sampled ? lm_head && !scores : ids.has_value() == scores.has_value()) &&
               uniforms.has_value() == sampled && probs.has_value() == sampled &&
               centroids.has_value() == token_ordering.has_value() && (lm_head || !centroids),
           "gemma4_mtp: drafter_step: a head needs lm_head, ids and scores (sampled: lm_head, ids, temperature, "
           "uniforms and probs, no scores; and centroids with token_ordering for the centroid head), or none of them");
  if (lm_head) {
    check_tensor(*ids, "ids", 3, dev);
    const int64_t k = ids->size(2);
    check_dense(*ids, "ids", {B, Q, k}, dev, at::kLong);
    G4_CHECK(!sampled || k == 1, "gemma4_mtp: drafter_step: a sampled head's ids must be [B, Q, 1], got ",
             ids->sizes());
    if (!sampled) check_dense(*scores, "scores", {B, Q, k}, dev, at::kFloat);
    gemma4_mtp::DrafterStepHead& h = p.head;
    if (centroids) {
      const int64_t K = check_centroid_head(*centroids, *token_ordering, *lm_head, centroid_top_k, Hd, dev, type);
      G4_CHECK(k >= 1 && k <= std::min<int64_t>(K, gemma4_mtp::kMaxTopK), "gemma4_mtp: drafter_step: ids must be "
               "[B, Q, k] with 1 <= k <= min(K = top_k * V / C, ", gemma4_mtp::kMaxTopK, ") = ",
               std::min<int64_t>(K, gemma4_mtp::kMaxTopK), ", got ", ids->sizes());
      check_contiguous(*centroids, "centroids");
      h.kind = gemma4_mtp::DrafterStepHeadKind::kCentroid;
      h.centroids = centroids->data_ptr();
      h.token_ordering = token_ordering->data_ptr();
      h.ordering_int64 = token_ordering->scalar_type() == at::kLong;
      h.C = static_cast<int>(centroids->size(0));
      h.top_k = static_cast<int>(centroid_top_k);
    } else {
      check_dense_head(*lm_head, k, Hd, dev, type, dt);
      h.kind = gemma4_mtp::DrafterStepHeadKind::kDense;
    }
    check_contiguous(*lm_head, "lm_head");
    h.lm_head = lm_head->data_ptr();
    h.V = lm_head->size(0);
    h.k = static_cast<int>(k);
    h.ids = ids->data_ptr<int64_t>();
    if (sampled) {  // softmax_sample's limits and arguments over the step's T rows
      G4_CHECK(T <= 65535 && h.V <= INT32_MAX, "gemma4_mtp: drafter_step: a sampled head needs B * Q <= 65535 and "
               "V < 2^31, got token_ids ", token_ids.sizes(), ", lm_head ", lm_head->sizes());
      check_sampling(*temperature, *uniforms, *probs, T, h.V, dev);
      h.temperature = temperature->data_ptr<float>();
      h.temp_stride = stride(*temperature, 0);
      h.uniforms = uniforms->data_ptr<double>();
      h.u_stride = stride(*uniforms, 0);
      h.probs = probs->data_ptr<float>();
      h.probs_stride = stride(*probs, 0);
    } else {
      h.scores = scores->data_ptr<float>();
    }
  }

  const c10::cuda::CUDAGuard guard(dev);
  const int sms = sm_count();
  int64_t n_counters = 0;
  const int64_t bytes = gemma4_mtp::prepare_drafter_step(dt, p, sms, &n_counters);
  // the caching allocator's blocks are 512-byte aligned, as the step's carving needs
  at::Tensor ws = at::empty({bytes}, hidden.options().dtype(at::kByte)), fresh;
  int32_t* counters = zeroed_counters("drafter_step", n_counters, hidden, &fresh);
  check_launch(gemma4_mtp::launch_drafter_step(dt, p, sms, ws.data_ptr(), counters, at::cuda::getCurrentCUDAStream()),
               "drafter_step");
}

}  // namespace

TORCH_LIBRARY(gemma4_mtp, m) {
  m.def("fused_concat_down_proj(Tensor token_ids, Tensor embed_table, Tensor hidden, Tensor weight, "
        "float embed_scale, Tensor(a!) out) -> ()");
  m.def("q_only_paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
        "float scale, int window, float softcap, Tensor(a!) out, Tensor(b!) lse) -> ()");
  m.def("centroid_logits(Tensor hidden, Tensor centroids, Tensor token_ordering, Tensor lm_head, int top_k, "
        "str output, Tensor(a!) ids, Tensor(b!) logits, str order=\"auto\") -> ()");
  m.def("tree_verify(Tensor draft_tokens, Tensor parents, Tensor target_logits, Tensor? temperature, "
        "Tensor? uniforms, Tensor? draft_probs, Tensor(a!) accept_len, Tensor(b!) accepted_nodes, "
        "Tensor(c!) output_tokens, Tensor(d!) last_node) -> ()");
  m.def("dense_lm_head(Tensor hidden, Tensor lm_head, int k, str output, Tensor(a!) ids, Tensor(b!) logits, "
        "Tensor(c!) dense) -> ()");
  m.def("rms_norm_linear(Tensor x, Tensor weight, Tensor? norm_weight, float eps, Tensor? residual, "
        "Tensor? residual_norm_weight, Tensor? layer_scalar, Tensor(a!) out, Tensor(b!)? residual_out, "
        "Tensor(c!)? normed_out) -> ()");
  m.def("rms_norm_gate_up(Tensor x, Tensor gate_weight, Tensor up_weight, Tensor? down_weight, "
        "Tensor? norm_weight, float eps, Tensor? residual, Tensor? residual_norm_weight, Tensor? layer_scalar, "
        "Tensor(a!) out, Tensor(b!)? residual_out) -> ()");
  m.def("rms_norm_q_rope(Tensor x, Tensor weight, Tensor q_norm_weight, Tensor positions, Tensor inv_freq, "
        "Tensor? norm_weight, float eps, Tensor? residual, Tensor? residual_norm_weight, Tensor? layer_scalar, "
        "Tensor(a!) out, Tensor(b!)? residual_out) -> ()");
  m.def("softmax_sample(Tensor logits, Tensor temperature, Tensor uniforms, Tensor(a!) probs, Tensor(b!) tokens) "
        "-> ()");
  m.def("drafter_step(Tensor token_ids, Tensor hidden, Tensor embed_table, float embed_scale, Tensor pre_projection, "
        "Tensor[] layer_weights, int[] layer_kv, Tensor[] k_caches, Tensor[] v_caches, Tensor[] block_tables, "
        "int[] windows, Tensor seq_lens, Tensor positions, Tensor final_norm, Tensor post_projection, float eps, "
        "Tensor? centroids, Tensor? token_ordering, Tensor? lm_head, int centroid_top_k, Tensor? temperature, "
        "Tensor? uniforms, Tensor(a!) last, Tensor(b!) proj, Tensor(c!)? ids, Tensor(d!)? scores, "
        "Tensor(e!)? probs) -> ()");
}

TORCH_LIBRARY_IMPL(gemma4_mtp, CUDA, m) {
  m.impl("fused_concat_down_proj", &fused_concat_down_proj);
  m.impl("q_only_paged_attention", &q_only_paged_attention);
  m.impl("centroid_logits", &centroid_logits);
  m.impl("tree_verify", &tree_verify);
  m.impl("dense_lm_head", &dense_lm_head);
  m.impl("rms_norm_linear", &rms_norm_linear);
  m.impl("rms_norm_gate_up", &rms_norm_gate_up);
  m.impl("rms_norm_q_rope", &rms_norm_q_rope);
  m.impl("softmax_sample", &softmax_sample);
  m.impl("drafter_step", &drafter_step);
}

// The extension is imported as the Python module gemma4_mtp_kernels._C only for its side effect of
// registering the ops above; it exposes no Python functions.
extern "C" PyObject* PyInit__C() {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, 0, nullptr};
  return PyModule_Create(&module);
}
