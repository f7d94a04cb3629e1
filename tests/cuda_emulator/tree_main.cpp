// Runs csrc/include/gemma4_mtp/tree_verify.cuh (prepare, launcher and kernel) on the CUDA emulator (emu.h)
// for one call whose tensors tests/test_tree_verify_emulated.py wrote to a directory; writes the four
// outputs back there for the test to compare with the reference. Prints one line "OK ..." or "FAIL ..."
// (exit 1).
//
//   dir=PATH dtype=bf16|f16|f32 B= N= V= ids64=0|1 ls= (the logits' row stride, >= V) sample=0|1
//   draft=0|1 qf32=0|1 (draft probabilities in fp32, else in the logits' type) sms= schedule=rr|ahead|behind
// Inputs: DIR/{draft_tokens,parents,logits}.bin, with sampling DIR/{temperature,uniforms}.bin, with
// draft probabilities DIR/draft_probs.bin (rows at stride V), in allocations of exactly their extent
// (io.h). Outputs start poisoned (-1 / all ones), the workspace too; the counters start zero and the
// launch (the only one, without programmatic dependent launch) must leave them zero.
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "emu.h"
#include "io.h"
#include "gemma4_mtp/tree_verify.cuh"

using namespace gemma4_mtp;
using namespace emu_io;

namespace {

template <class T>
int run(Args& a) {
  const int64_t E = sizeof(T);
  const std::string dir = a.str("dir");
  const int B = static_cast<int>(a.num("B", 1)), N = static_cast<int>(a.num("N", 1));
  const int64_t V = a.num("V", 1), ls = a.num("ls", V);
  const bool ids64 = a.num("ids64", 1), sample = a.num("sample", 0), draft = a.num("draft", 0), qf32 = a.num("qf32", 1);

  Buffer tokens = load(dir, "draft_tokens", B, N, N, ids64 ? 8 : 4);
  Buffer parents = load(dir, "parents", B, N, N, 4);
  Buffer logits = load(dir, "logits", static_cast<int64_t>(B) * N, V, ls, E);
  Buffer temperature, uniforms, q;
  TreeVerifyParams p{};
  if (sample) {
    temperature = load(dir, "temperature", 1, B, B, 4);
    uniforms = load(dir, "uniforms", B, 2 * N, 2 * N, 4);
    p.temperature = static_cast<const float*>(temperature.data());
    p.uniforms = static_cast<const float*>(uniforms.data());
  }
  if (draft) {
    q = load(dir, "draft_probs", static_cast<int64_t>(B) * N, V, V, qf32 ? 4 : E);
    p.draft_probs = q.data();
    p.draft_probs_fp32 = qf32;
    p.draft_probs_stride[0] = N * V;
    p.draft_probs_stride[1] = V;
  }
  Buffer accept_len = strided(1, B, B, 4), accepted = strided(B, N, N, 4), out_tokens = strided(B, N, N, 8);
  Buffer last = strided(1, B, B, 4);
  p.draft_tokens = tokens.data();
  p.draft_int64 = ids64;
  p.parents = static_cast<const int32_t*>(parents.data());
  p.logits = logits.data();
  p.logits_stride[0] = N * ls;
  p.logits_stride[1] = ls;
  p.B = B;
  p.N = N;
  p.V = V;
  p.accept_len = static_cast<int32_t*>(accept_len.data());
  p.accepted_nodes = static_cast<int32_t*>(accepted.data());
  p.output_tokens = static_cast<int64_t*>(out_tokens.data());
  p.last_node = static_cast<int32_t*>(last.data());

  const int sms = static_cast<int>(a.num("sms", 8));
  use_device(kH100SmemOptin, 9, sms, a.str("schedule", "rr"));
  std::vector<unsigned char> ws(static_cast<size_t>(tree_verify_prepare<T>(p, sms)), 0xFF);
  std::vector<int32_t> counters(static_cast<size_t>(tree_verify_counter_ints(B, N)), 0);
  p.workspace = ws.data();
  p.counters = counters.data();

  if (!launched_as_expected(tree_verify<T>(p, nullptr), 1, false, counters)) return 1;
  const auto& log = emu::launch_log();
  store(dir, "accept_len", accept_len);
  store(dir, "accepted_nodes", accepted);
  store(dir, "output_tokens", out_tokens);
  store(dir, "last_node", last);
  std::printf("OK path=%s chunks=%d granule=%lld grid=%u\n", tree_verify_vectorized<T>(p) ? "vec" : "scalar",
              p.num_chunks, static_cast<long long>(p.granule), log[0].grid.x);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  auto a = parse(argc, argv);
  return finish(a, with_dtype(a.str("dtype"), [&](auto tag) { return run<decltype(tag)>(a); }));
}
