// Runs csrc/include/gemma4_mtp/fused_concat_down_proj.cuh (prepare, launcher and kernels) on the CUDA
// emulator (emu.h) for one call whose tensors tests/test_fused_concat_down_proj_emulated.py wrote to a
// directory; writes the output back there for the test to compare with the fp64 oracle. Prints one
// line "OK ..." (the path, the plan and the launch) or "FAIL ..." (exit 1).
//
//   dir=PATH dtype=bf16|f16|f32 T= Hb= Hd= V= ids64=0|1 sms= major= schedule=rr|ahead|behind
//   ts= hs= (row strides of the embedding table and the hidden states) ho= (hidden's element offset)
// Inputs: DIR/{token_ids,embed_table,hidden,weight}.bin (io.h: allocations of exactly their extent).
// The output and the partials start as NaN; the launch must be the only one and leave its counters zero.
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "emu.h"
#include "io.h"
#include "gemma4_mtp/fused_concat_down_proj.cuh"

using namespace gemma4_mtp;
using namespace emu_io;

namespace {

template <class T>
int run(Args& a) {
  const int64_t E = sizeof(T);
  const std::string dir = a.str("dir");
  const int T_ = static_cast<int>(a.num("T", 1)), Hb = static_cast<int>(a.num("Hb", 0));
  const int Hd = static_cast<int>(a.num("Hd", 0));
  const int64_t V = a.num("V", 1), ts = a.num("ts", Hb), hs = a.num("hs", Hb);
  const bool ids64 = a.num("ids64", 1);

  Buffer ids = load(dir, "token_ids", 1, T_, T_, ids64 ? 8 : 4);
  Buffer table = load(dir, "embed_table", V, Hb, ts, E);
  Buffer hidden = load(dir, "hidden", T_, Hb, hs, E, a.num("ho", 0));
  Buffer weight = load(dir, "weight", Hd, 2 * Hb, 2 * Hb, E);
  Buffer out = strided(T_, Hd, Hd, E);

  DownProjParams p{};
  p.token_ids = ids.data();
  p.token_ids_int64 = ids64;
  p.embed_table = table.data();
  p.hidden = hidden.data();
  p.weight = weight.data();
  p.out = out.data();
  p.table_stride = ts;
  p.hidden_stride = T_ == 1 ? 0 : hs;  // as the binding passes a size-1 dimension's stride
  p.weight_stride = 2 * Hb;
  p.out_stride = Hd;
  p.vocab = V;
  p.T = T_;
  p.Hb = Hb;
  p.Hd = Hd;
  p.embed_scale = std::stof(a.str("scale"));

  const int sms = static_cast<int>(a.num("sms", 8)), major = static_cast<int>(a.num("major", 9));
  use_device(kH100SmemOptin, major, sms, a.str("schedule"));
  int64_t n_counters = 0;
  const int64_t part_bytes = down_proj_prepare<T>(p, sms, &n_counters);
  std::vector<float> partials(static_cast<size_t>(part_bytes / 4), NAN);
  std::vector<int32_t> counters(static_cast<size_t>(n_counters), 0);
  p.partials = partials.empty() ? nullptr : partials.data();
  p.counters = counters.empty() ? nullptr : counters.data();

  if (!launched_as_expected(fused_concat_down_proj<T>(p, nullptr), 1, major >= 9, counters)) return 1;
  const auto& log = emu::launch_log();
  store(dir, "out", out);
  std::printf("OK path=%s splits=%d steps=%d m16=%d grid=%ux%ux%u\n", down_proj_uses_mma<T>(p) ? "mma" : "scalar",
              p.plan.splits, p.plan.steps_per_split, p.plan.token_tiles_m16, log[0].grid.x, log[0].grid.y,
              log[0].grid.z);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  auto a = parse(argc, argv);
  return finish(a, with_dtype(a.str("dtype"), [&](auto tag) { return run<decltype(tag)>(a); }));
}
