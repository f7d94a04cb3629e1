// Runs csrc/include/gemma4_mtp/centroid_logits.cuh (prepare, launcher and the one cooperative kernel) on
// the CUDA emulator (emu.h), every program of the launch resident at once, for one call whose tensors
// tests/test_centroid_logits_emulated.py wrote to a directory; writes the outputs back there. Prints one
// line "OK ..." or "FAIL ..." (exit 1).
//
//   dir=PATH dtype=bf16|f16|f32 T= Hd= C= V= top_k= output=argmax|topk|sparse|dense k= fill= ord64=0|1 sms=
//   schedule=rr|ahead|behind (emu::Schedule: ahead / behind run each program as far as it goes)
//   order=auto|tokens|clusters (phase 2's order: the plan's, or forced)
//   hs= cs= ls= (row strides of the hidden states, centroids, LM head) ho= (the hidden states' offset)
// Inputs: DIR/{hidden,centroids,token_ordering,lm_head}.bin (io.h: allocations of exactly their extent).
// Outputs DIR/ids.bin (argmax, topk, sparse) and DIR/logits.bin start poisoned (-1, NaN; dense: the fill
// value, as the binding fills it), the workspace with NaN bits, the two counters zero; the launch must
// be the only one and leave them zero.
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "emu.h"
#include "io.h"
#include "gemma4_mtp/centroid_logits.cuh"

using namespace gemma4_mtp;
using namespace emu_io;

namespace {

template <class T>
int run(Args& a) {
  const int64_t E = sizeof(T);
  const std::string dir = a.str("dir"), output = a.str("output");
  const int T_ = static_cast<int>(a.num("T", 1)), Hd = static_cast<int>(a.num("Hd", 0));
  const int C = static_cast<int>(a.num("C", 1)), top_k = static_cast<int>(a.num("top_k", 1));
  const int64_t V = a.num("V", 1), hs = a.num("hs", Hd), cs = a.num("cs", Hd), ls = a.num("ls", Hd);
  const bool ord64 = a.num("ord64", 1);

  Buffer hidden = load(dir, "hidden", T_, Hd, hs, E, a.num("ho", 0));
  Buffer centroids = load(dir, "centroids", C, Hd, cs, E);
  Buffer ordering = load(dir, "token_ordering", 1, V, V, ord64 ? 8 : 4);
  Buffer head = load(dir, "lm_head", V, Hd, ls, E);
  CentroidParams p{};
  p.output = output == "argmax"   ? CentroidOutput::kArgmax
             : output == "topk"   ? CentroidOutput::kTopK
             : output == "sparse" ? CentroidOutput::kSparse
                                  : CentroidOutput::kDense;
  p.k = static_cast<int>(a.num("k", 1));
  const std::string order = a.str("order", "auto");
  p.order = order == "tokens" ? CentroidOrder::kTokens : order == "clusters" ? CentroidOrder::kClusters
                                                                              : CentroidOrder::kAuto;
  const int64_t K = output == "argmax" ? 1 : output == "topk" ? p.k : output == "sparse" ? top_k * (V / C) : V;
  Buffer ids = strided(output == "dense" ? 0 : T_, K, K, 8), logits = strided(T_, K, K, 4);
  if (output == "dense") {
    const float fill = std::stof(a.str("fill"));
    for (int64_t i = 0; i < T_ * K; ++i) std::memcpy(logits.base() + 4 * i, &fill, 4);
  }
  p.hidden = hidden.data();
  p.centroids = centroids.data();
  p.token_ordering = ordering.data();
  p.ordering_int64 = ord64;
  p.lm_head = head.data();
  p.hidden_stride = T_ == 1 ? 0 : hs;  // as the binding passes a size-1 dimension's stride
  p.centroid_stride = cs;
  p.lm_head_stride = ls;
  p.T = T_;
  p.Hd = Hd;
  p.C = C;
  p.top_k = top_k;
  p.V = V;
  p.ids = output == "dense" ? nullptr : static_cast<int64_t*>(ids.data());
  p.logits = static_cast<float*>(logits.data());

  const int sms = static_cast<int>(a.num("sms", 4));
  use_device(kH100SmemOptin, 9, sms, a.str("schedule", "rr"));
  std::vector<float> ws(static_cast<size_t>((centroid_prepare(p, sms) + 3) / 4), NAN);
  std::vector<int32_t> counters(2, 0);
  p.workspace = ws.data();
  p.counters = counters.data();
  if (!launched_as_expected(centroid_logits<T>(p, nullptr), 1, false, counters)) return 1;
  if (output != "dense") store(dir, "ids", ids);
  store(dir, "logits", logits);
  std::printf("OK grid=%d chunks=%d rows=%d order=%s\n", p.grid, p.chunks, p.rows,
              p.cluster_major ? "clusters" : "tokens");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  auto a = parse(argc, argv);
  return finish(a, with_dtype(a.str("dtype"), [&](auto tag) { return run<decltype(tag)>(a); }));
}
