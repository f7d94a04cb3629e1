// Runs a whole drafter step in one host call (csrc/ops/drafter_step.cu: prepare_drafter_step,
// launch_drafter_step, and through them the launchers of csrc/ops and the kernels they launch) on the
// CUDA emulator (emu.h), for a step whose tensors tests/test_drafter_step_emulated.py wrote to a
// directory; writes `last` and `proj` back there (and, with a head, `ids` and `scores`) for the test to
// compare with the PyTorch step.
// Prints one line "OK launches=..." or "FAIL ..." (exit 1).
//
//   dir=PATH dtype=bf16|f16|f32 B= Q= Hb= Hd= Hq= V= I= layers= kinds=0,0,0,1 (each layer's attention
//   type) eps= embed_scale= sms= major= schedule=rr|ahead|behind tok64=0|1 pos64=0|1 offset=0|1 (the
//   workspace's first 256 bytes skipped: a workspace the sizing pass did not see must still work)
//   and per attention type j: D<j>= Hkv<j>= nb<j>= (cache blocks) bs<j>= (block size) mb<j>= (table
//   columns) window<j>= (0: none); head=none|centroid|dense k= (answers per token) C= top_k= ord64=0|1
//   (the centroid head's clusters, clusters kept, int64 token_ordering) sample=0|1 qs= (with sample=1, a
//   token drawn per row instead of the top k: k=1, probs' row stride qs >= V)
// Inputs (packed rows): token_ids, hidden, embed_table, pre_projection, final_norm, post_projection,
// seq_lens, positions, k<j>, v<j>, block_table<j>, l<i>_<name> for each layer's weights, and the head's
// lm_head (and centroids, token_ordering; sampled: temperature [T] fp32, uniforms [T] fp64); sampled,
// the drawn tokens are written as `ids` and q as `probs`.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "emu.h"
#include "io.h"
// the host-side launchers exactly as the extension compiles them
#include "../../csrc/ops/centroid_logits.cu"
#include "../../csrc/ops/dense_lm_head.cu"
#include "../../csrc/ops/drafter_step.cu"
#include "../../csrc/ops/fused_concat_down_proj.cu"
#include "../../csrc/ops/q_only_attention.cu"
#include "../../csrc/ops/rms_norm_gate_up.cu"
#include "../../csrc/ops/rms_norm_linear.cu"
#include "../../csrc/ops/rms_norm_q_rope.cu"
#include "../../csrc/ops/softmax_sample.cu"

using namespace emu_io;
using gemma4_mtp::DrafterStepParams;

namespace {

const char* kLayerVectors[] = {"input_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm"};

std::vector<int> split_ints(const std::string& s) {
  std::vector<int> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = s.find(',', start);
    out.push_back(std::stoi(s.substr(start, comma == std::string::npos ? std::string::npos : comma - start)));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

template <class T>
int run(Args& a) {
  const int64_t E = sizeof(T);
  const std::string dir = a.str("dir");
  DrafterStepParams p{};
  p.B = static_cast<int>(a.num("B", 1));
  p.Q = static_cast<int>(a.num("Q", 1));
  p.Hb = static_cast<int>(a.num("Hb", 0));
  p.Hd = static_cast<int>(a.num("Hd", 0));
  p.Hq = static_cast<int>(a.num("Hq", 0));
  const int64_t T_ = int64_t{p.B} * p.Q, V = a.num("V", 0), I = a.num("I", 0);
  const std::vector<int> kinds = split_ints(a.str("kinds"));
  p.num_layers = static_cast<int>(a.num("layers", 0));
  if (static_cast<int>(kinds.size()) != p.num_layers) emu::fail("kinds must name each layer's attention type");
  p.num_kv = 0;
  for (int k : kinds) p.num_kv = std::max(p.num_kv, k + 1);
  p.eps = static_cast<float>(a.real("eps", 1e-6));
  p.embed_scale = static_cast<float>(a.real("embed_scale", 1.0));

  std::vector<Buffer> keep;  // every loaded tensor lives until the launch is done
  auto in = [&](const std::string& name, int64_t rows, int64_t cols, int64_t elem) -> const void* {
    keep.push_back(load(dir, name, rows, cols, cols, elem));
    return keep.back().data();
  };
  keep.reserve(256);
  const bool tok64 = a.num("tok64", 1), pos64 = a.num("pos64", 1);
  p.token_ids = in("token_ids", 1, T_, tok64 ? 8 : 4);
  p.token_ids_int64 = tok64;
  p.embed_table = in("embed_table", V, p.Hb, E);
  p.table_stride = p.Hb;
  p.vocab = V;
  p.hidden = in("hidden", T_, p.Hb, E);
  p.hidden_stride = p.Hb;
  p.pre_projection = in("pre_projection", p.Hd, 2 * int64_t{p.Hb}, E);
  p.seq_lens = static_cast<const int32_t*>(in("seq_lens", 1, p.B, 4));
  p.positions = in("positions", 1, p.B, pos64 ? 8 : 4);
  p.positions_int64 = pos64;
  std::vector<gemma4_mtp::DrafterStepKV> kvs(static_cast<size_t>(p.num_kv));
  std::vector<gemma4_mtp::DrafterStepLayer> layers(static_cast<size_t>(p.num_layers));
  p.kv = kvs.data();
  p.layers = layers.data();
  for (int j = 0; j < p.num_kv; ++j) {
    const std::string s = std::to_string(j);
    gemma4_mtp::DrafterStepKV& kv = kvs[j];
    kv.D = static_cast<int>(a.num(("D" + s).c_str(), 64));
    kv.Hkv = static_cast<int>(a.num(("Hkv" + s).c_str(), 1));
    kv.num_blocks = static_cast<int>(a.num(("nb" + s).c_str(), 1));
    kv.block_size = static_cast<int>(a.num(("bs" + s).c_str(), 16));
    kv.max_blocks = static_cast<int>(a.num(("mb" + s).c_str(), 1));
    kv.window = a.num(("window" + s).c_str(), 0);
    const int64_t rows = int64_t{kv.num_blocks} * kv.block_size * kv.Hkv;
    kv.k_cache = in("k" + s, rows, kv.D, E);
    kv.v_cache = in("v" + s, rows, kv.D, E);
    const int64_t st[3] = {int64_t{kv.block_size} * kv.Hkv * kv.D, int64_t{kv.Hkv} * kv.D, kv.D};
    for (int i = 0; i < 3; ++i) {  // as the binding passes them: a size-1 dimension's stride is 0
      const int64_t size = i == 0 ? kv.num_blocks : i == 1 ? kv.block_size : kv.Hkv;
      kv.k_stride[i] = kv.v_stride[i] = size == 1 ? 0 : st[i];
    }
    kv.block_table = static_cast<const int32_t*>(in("block_table" + s, p.B, kv.max_blocks, 4));
    kv.block_table_stride = kv.max_blocks;
  }
  for (int i = 0; i < p.num_layers; ++i) {
    gemma4_mtp::DrafterStepLayer& w = layers[i];
    const std::string l = "l" + std::to_string(i) + "_";
    w.kv = kinds[i];
    w.I = static_cast<int>(I);
    const int64_t D = p.kv[w.kv].D, N = p.Hq * D;
    const void* vec[4];
    for (int v = 0; v < 4; ++v) vec[v] = in(l + kLayerVectors[v], 1, p.Hd, E);
    w.input_norm = vec[0];
    w.post_attn_norm = vec[1];
    w.pre_ff_norm = vec[2];
    w.post_ff_norm = vec[3];
    w.q_proj = in(l + "q_proj", N, p.Hd, E);
    w.q_norm = in(l + "q_norm", 1, D, E);
    w.inv_freq = static_cast<const float*>(in(l + "inv_freq", 1, D / 2, 4));
    w.o_proj = in(l + "o_proj", p.Hd, N, E);
    w.gate = in(l + "gate", I, p.Hd, E);
    w.up = in(l + "up", I, p.Hd, E);
    w.down = in(l + "down", p.Hd, I, E);
    w.layer_scalar = in(l + "layer_scalar", 1, 1, E);
  }
  p.final_norm = in("final_norm", 1, p.Hd, E);
  p.post_projection = in("post_projection", p.Hb, p.Hd, E);
  Buffer last = strided(T_, p.Hd, p.Hd, E), proj = strided(T_, p.Hb, p.Hb, E);
  p.last = last.data();
  p.proj = proj.data();
  const std::string head = a.str("head", "none");
  const int k = static_cast<int>(a.num("k", 1));
  Buffer ids = strided(T_, k, k, 8), scores = strided(T_, k, k, 4);
  const bool sample = a.num("sample", 0);
  Buffer probs = strided(T_, V, a.num("qs", V), 4);
  if (head != "none") {
    gemma4_mtp::DrafterStepHead& h = p.head;
    h.kind = head == "dense" ? gemma4_mtp::DrafterStepHeadKind::kDense : gemma4_mtp::DrafterStepHeadKind::kCentroid;
    h.lm_head = in("lm_head", V, p.Hd, E);
    h.V = V;
    h.k = k;
    h.ids = static_cast<int64_t*>(ids.data());
    h.scores = static_cast<float*>(scores.data());
    if (head == "centroid") {
      h.C = static_cast<int>(a.num("C", 1));
      h.top_k = static_cast<int>(a.num("top_k", 1));
      h.centroids = in("centroids", h.C, p.Hd, E);
      h.ordering_int64 = a.num("ord64", 1);
      h.token_ordering = in("token_ordering", 1, V, h.ordering_int64 ? 8 : 4);
    } else if (head != "dense") {
      emu::fail("head must be none, centroid or dense");
    }
    if (sample) {
      h.scores = nullptr;  // not written by a sampled head
      h.temperature = static_cast<const float*>(in("temperature", 1, T_, 4));
      h.temp_stride = 1;
      h.uniforms = static_cast<const double*>(in("uniforms", 1, T_, 8));
      h.u_stride = 1;
      h.probs = static_cast<float*>(static_cast<void*>(probs.data()));
      h.probs_stride = probs.stride;
    }
  }

  const int sms = static_cast<int>(a.num("sms", 8)), major = static_cast<int>(a.num("major", 9));
  use_device(kH100SmemOptin, major, sms, a.str("schedule"));
  const gemma4_mtp::DType dt = sizeof(T) == 4 ? gemma4_mtp::DType::kFloat32
                     : std::is_same_v<T, __half> ? gemma4_mtp::DType::kFloat16
                                                 : gemma4_mtp::DType::kBFloat16;
  int64_t n_counters = 0;
  const int64_t bytes = gemma4_mtp::prepare_drafter_step(dt, p, sms, &n_counters);
  // the workspace poisoned (NaN in every float type): the step must write whatever it reads
  const int64_t offset = a.num("offset", 0) ? 256 : 0;
  void* raw = std::aligned_alloc(256, static_cast<size_t>((bytes + offset + 255) / 256 * 256));
  std::memset(raw, 0xFF, static_cast<size_t>(bytes + offset));
  std::vector<int32_t> counters(static_cast<size_t>(n_counters), 0);
  const cudaError_t err = gemma4_mtp::launch_drafter_step(dt, p, sms, static_cast<char*>(raw) + offset,
                                                          counters.data(), nullptr);
  std::free(raw);
  const size_t launches = emu::launch_log().size();
  // every launch under programmatic dependent launch on sm_90 but the centroid head's cooperative one
  // (last, or before softmax_sample's two)
  if (!launched_as_expected(err, launches, major >= 9, counters, head != "centroid" ? 0 : sample ? 3 : 1)) return 1;
  // the refusals: a workspace off the 256-byte grid, no counters
  if (gemma4_mtp::launch_drafter_step(dt, p, sms, reinterpret_cast<void*>(16), counters.data(), nullptr) !=
          cudaErrorInvalidValue ||
      gemma4_mtp::launch_drafter_step(dt, p, sms, reinterpret_cast<void*>(256), nullptr, nullptr) !=
          cudaErrorInvalidValue) {
    std::printf("FAIL a bad workspace or missing counters was not refused\n");
    return 1;
  }
  store(dir, "last", last);
  store(dir, "proj", proj);
  if (head != "none") {
    store(dir, "ids", ids);
    if (sample) store(dir, "probs", probs);
    else store(dir, "scores", scores);
  }
  std::printf("OK launches=%zu workspace=%lld counters=%lld\n", launches, static_cast<long long>(bytes),
              static_cast<long long>(n_counters));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  auto a = parse(argc, argv);
  return finish(a, emu_io::with_dtype(a.str("dtype"), [&](auto tag) { return run<decltype(tag)>(a); }));
}
