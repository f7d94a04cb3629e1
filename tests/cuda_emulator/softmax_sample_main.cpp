// Runs csrc/include/gemma4_mtp/softmax_sample.cuh (launcher and both kernels) on the CUDA emulator (emu.h)
// for one call whose tensors tests/test_softmax_sample_emulated.py wrote to a directory; writes q and the
// tokens back there for the test to check against its oracle. Prints one line "OK ..." or "FAIL ..."
// (exit 1).
//
//   dir=PATH dtype=bf16|f16|f32 B= V= ls= (the logits' row stride, >= V) qs= (q's row stride, >= V)
//   us= (the uniforms' stride) major= schedule=rr|ahead|behind
// Inputs: DIR/{logits,temperature,uniforms}.bin in allocations of exactly their extent (io.h). Outputs
// start poisoned (NaN q, -1 tokens: all-ones bytes), the workspace too; the counters start zero and
// must be left zero; two launches, with programmatic dependent launch on sm_90.
#include <cstdio>
#include <string>
#include <vector>

#include "emu.h"
#include "io.h"
#include "gemma4_mtp/softmax_sample.cuh"

using namespace gemma4_mtp;
using namespace emu_io;

namespace {

template <class T>
int run(Args& a) {
  const std::string dir = a.str("dir");
  const int B = static_cast<int>(a.num("B", 1)), V = static_cast<int>(a.num("V", 1));
  const int64_t ls = a.num("ls", V), qs = a.num("qs", V), us = a.num("us", 1);

  Buffer logits = load(dir, "logits", B, V, ls, sizeof(T));
  Buffer temperature = load(dir, "temperature", 1, B, B, 4);
  Buffer uniforms = load(dir, "uniforms", B, 1, us, 8);
  Buffer probs = strided(B, V, qs, 4), tokens = strided(1, B, B, 8);

  SoftmaxSampleParams p{};
  p.logits = logits.data();
  p.logit_stride = B == 1 ? 0 : ls;  // as the binding passes a size-1 dimension's stride
  p.temperature = static_cast<const float*>(temperature.data());
  p.temp_stride = 1;
  p.uniforms = static_cast<const double*>(uniforms.data());
  p.u_stride = B == 1 ? 0 : us;
  p.probs = static_cast<float*>(probs.data());
  p.probs_stride = B == 1 ? 0 : qs;
  p.tokens = static_cast<int64_t*>(tokens.data());
  p.B = B;
  p.V = V;
  p.P = softmax_sample_chunks(V);
  std::vector<unsigned char> ws(static_cast<size_t>(softmax_sample_workspace_bytes(B, p.P)), 0xFF);
  softmax_sample_carve(p, ws.data());
  std::vector<int32_t> counters(static_cast<size_t>(B), 0);
  p.counters = counters.data();

  const int major = static_cast<int>(a.num("major", 9));
  use_device(kH100SmemOptin, major, 132, a.str("schedule", "rr"));
  if (!launched_as_expected(softmax_sample<T>(p, nullptr), 2, major >= 9, counters)) return 1;
  store(dir, "probs", probs);
  store(dir, "tokens", tokens);
  std::printf("OK chunks=%d\n", p.P);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  auto a = parse(argc, argv);
  return finish(a, with_dtype(a.str("dtype"), [&](auto tag) { return run<decltype(tag)>(a); }));
}
