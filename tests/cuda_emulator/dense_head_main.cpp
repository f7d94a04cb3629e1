// Runs csrc/include/gemma4_mtp/dense_lm_head.cuh (launcher and both kernels) on the CUDA emulator (emu.h)
// for one call whose tensors tests/test_dense_lm_head_emulated.py wrote to a directory; writes the
// outputs back there for the test to check against the fp64 oracle. Prints one line "OK ..." or
// "FAIL ..." (exit 1).
//
//   dir=PATH dtype=bf16|f16|f32 T= Hd= V= k= dense=0|1 sms= major= schedule=rr|ahead|behind
//   hs= ws= (row strides of the hidden states and the head) ho= (hidden's element offset)
// Inputs: DIR/{hidden,lm_head}.bin (io.h: allocations of exactly their extent). Outputs: DIR/ids.bin,
// DIR/logits.bin (top-k) or DIR/dense.bin. Outputs start as NaN / -1, the workspace as all-ones keys
// (which outrank every real key: a list never written shows up); launches: the rows kernel, then the
// merge for top-k, each with programmatic dependent launch on sm_90.
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "emu.h"
#include "io.h"
#include "gemma4_mtp/dense_lm_head.cuh"

using namespace gemma4_mtp;
using namespace emu_io;

namespace {

template <class T>
int run(Args& a) {
  const int64_t E = sizeof(T);
  const std::string dir = a.str("dir");
  const int T_ = static_cast<int>(a.num("T", 1)), Hd = static_cast<int>(a.num("Hd", 0)), V = static_cast<int>(a.num("V", 1));
  const int k = static_cast<int>(a.num("k", 1));
  const bool dense = a.num("dense", 0);
  const int64_t hs = a.num("hs", Hd), ws = a.num("ws", Hd);

  Buffer hidden = load(dir, "hidden", T_, Hd, hs, E, a.num("ho", 0));
  Buffer head = load(dir, "lm_head", V, Hd, ws, E);
  Buffer ids = strided(T_, dense ? 0 : k, dense ? 0 : k, 8), logits = strided(T_, dense ? 0 : k, dense ? 0 : k, 4);
  Buffer full = strided(dense ? T_ : 0, V, V, 4);

  DenseHeadParams p{};
  p.hidden = hidden.data();
  p.lm_head = head.data();
  p.hidden_stride = T_ == 1 ? 0 : hs;  // as the binding passes a size-1 dimension's stride
  p.head_stride = ws;
  p.T = T_;
  p.V = V;
  p.Hd = Hd;
  p.k = dense ? 1 : k;
  p.dense = dense ? static_cast<float*>(full.data()) : nullptr;
  p.dense_stride = V;
  p.out_ids = dense ? nullptr : static_cast<int64_t*>(ids.data());
  p.out_logits = dense ? nullptr : static_cast<float*>(logits.data());
  const int sms = static_cast<int>(a.num("sms", 8)), major = static_cast<int>(a.num("major", 9));
  p.num_ctas = dense_head_ctas(V, sms);
  std::vector<unsigned char> partial(static_cast<size_t>(dense_head_workspace_bytes(p)), 0xFF);
  p.partial = partial.empty() ? nullptr : reinterpret_cast<uint64_t*>(partial.data());

  use_device(kH100SmemOptin, major, sms, a.str("schedule", "rr"));
  if (!launched_as_expected(dense_lm_head<T>(p, nullptr), dense ? 1 : 2, major >= 9, {})) return 1;
  const auto& log = emu::launch_log();
  if (dense) {
    store(dir, "dense", full);
  } else {
    store(dir, "ids", ids);
    store(dir, "logits", logits);
  }
  std::printf("OK ctas=%d smem=%zu\n", p.num_ctas, log[0].smem);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  auto a = parse(argc, argv);
  return finish(a, with_dtype(a.str("dtype"), [&](auto tag) { return run<decltype(tag)>(a); }));
}
