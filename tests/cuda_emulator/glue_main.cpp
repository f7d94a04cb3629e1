// Runs csrc/include/gemma4_mtp/rms_norm_linear.cuh (rms_norm_linear, rms_norm_gate_up, rms_norm_q_rope:
// prepare, launcher and kernels) on the CUDA emulator (emu.h) for one call whose tensors
// tests/test_fused_glue_emulated.py wrote to a directory; writes the outputs back there for the test to
// compare with the fp64 oracle. Prints one line "OK ..." (the plan and the launch) or "FAIL ..." (exit 1).
//
//   dir=PATH op=linear|gate_up|q_rope dtype=bf16|f16|f32 T= H= N= [D= P=] eps= sms= major=
//   res=0|1 scale=0|1 norm=0|1 rout=0|1 nout=0|1 pos64=0|1 xs= rs= (row strides of x and the residual)
//   xo= (x's element offset in its allocation)   again_T= (then a second rms_norm_linear launch with T rows)
//   down= (gate_up: the rows of a down_weight [down, N], the whole MLP in one launch; ds= its row stride)
//   schedule=rr|ahead|behind
// Inputs: DIR/<name>.bin, rows packed (the test's bytes), copied here into allocations of exactly
// (rows - 1) * stride + cols elements, so any read past a row's end or the last row is an
// AddressSanitizer error. Outputs start as NaN; every launch must leave its counters zero.
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "emu.h"
#include "io.h"
#include "gemma4_mtp/rms_norm_linear.cuh"

using namespace gemma4_mtp;
using namespace emu_io;

namespace {

template <class T>
int run(Args& a) {
  const int64_t E = sizeof(T);
  const std::string dir = a.str("dir"), op = a.str("op");
  const int T_ = static_cast<int>(a.num("T", 1)), H = static_cast<int>(a.num("H", 0)), N = static_cast<int>(a.num("N", 0));
  const bool res = a.num("res", 0), scale = a.num("scale", 0), norm = a.num("norm", 0);
  const bool rout = a.num("rout", 0), nout = a.num("nout", 0);
  const int64_t xs = a.num("xs", H), rs = a.num("rs", H);

  GlueParams p{};
  p.kind = op == "linear" ? GlueKind::kLinear : op == "gate_up" ? GlueKind::kGateUp : GlueKind::kQRope;
  Buffer x = load(dir, "x", T_, H, xs, E, a.num("xo", 0)), residual, rw, sc, nw, up, down, qnw, pos, freq;
  Buffer weight = load(dir, "weight", N, H, H, E);
  p.x = x.data();
  p.x_stride = T_ == 1 ? 0 : xs;  // as the binding passes a size-1 dimension's stride
  if (res) {
    residual = load(dir, "residual", T_, H, rs, E);
    rw = load(dir, "residual_norm_weight", 1, H, H, E);
    p.residual = residual.data();
    p.residual_stride = T_ == 1 ? 0 : rs;
    p.residual_norm_weight = rw.data();
    if (scale) {
      sc = load(dir, "layer_scalar", 1, 1, 1, E);
      p.layer_scalar = sc.data();
    }
  }
  if (norm) {
    nw = load(dir, "norm_weight", 1, H, H, E);
    p.norm_weight = nw.data();
  }
  p.eps = std::stof(a.str("eps"));
  p.weight = weight.data();
  p.weight_stride = H;
  if (p.kind == GlueKind::kGateUp) {
    up = load(dir, "up_weight", N, H, H, E);
    p.up_weight = up.data();
    p.up_weight_stride = H;
  }
  const int Nd = static_cast<int>(a.num("down", 0)), N_out = Nd > 0 ? Nd : N;
  if (Nd > 0) {
    const int64_t ds = a.num("ds", N);
    down = load(dir, "down_weight", Nd, N, ds, E);
    p.down_weight = down.data();
    p.down_weight_stride = Nd == 1 ? 0 : ds;
    p.down_N = Nd;
  }
  Buffer out = strided(T_, N_out, N_out, E), hout, nout_b;
  p.out = out.data();
  p.out_stride = N_out;
  if (rout) {
    hout = strided(T_, H, H, E);
    p.residual_out = hout.data();
    p.residual_out_stride = H;
  }
  if (nout) {
    nout_b = strided(T_, H, H, E);
    p.normed_out = nout_b.data();
    p.normed_out_stride = H;
  }
  if (p.kind == GlueKind::kQRope) {
    p.D = static_cast<int>(a.num("D", 64));
    const int P = static_cast<int>(a.num("P", T_));
    const bool pos64 = a.num("pos64", 1);
    qnw = load(dir, "q_norm_weight", 1, p.D, p.D, E);
    pos = load(dir, "positions", 1, P, P, pos64 ? 8 : 4);
    freq = load(dir, "inv_freq", 1, p.D / 2, p.D / 2, 4);
    p.q_norm_weight = qnw.data();
    p.positions = pos.data();
    p.positions_int64 = pos64;
    p.inv_freq = static_cast<const float*>(freq.data());
    p.per_pos = P > 0 ? T_ / P : 1;
  }
  p.T = T_;
  p.H = H;
  p.N = N;

  int64_t ws_bytes = 0, n_counters = 0;
  const int64_t part_bytes = glue_prepare<T>(p, static_cast<int>(a.num("sms", 8)), &ws_bytes, &n_counters);
  std::vector<float> partials(static_cast<size_t>(part_bytes / 4), NAN);
  std::vector<unsigned char> ws(static_cast<size_t>(ws_bytes), 0xFF);  // NaN as fp32, and as 16-bit elements
  std::vector<int32_t> counters(static_cast<size_t>(n_counters), 0);
  p.partials = partials.empty() ? nullptr : partials.data();
  p.workspace = ws.empty() ? nullptr : ws.data();
  p.counters = counters.empty() ? nullptr : counters.data();

  const int major = static_cast<int>(a.num("major", 9));
  use_device(kH100SmemOptin, major, static_cast<int>(a.num("sms", 8)), a.str("schedule"));
  const cudaError_t err = p.kind == GlueKind::kLinear   ? rms_norm_linear<T>(p, nullptr)
                          : p.kind == GlueKind::kGateUp ? rms_norm_gate_up<T>(p, nullptr)
                                                        : rms_norm_q_rope<T>(p, nullptr);
  if (!launched_as_expected(err, 1, major >= 9, counters)) return 1;
  const auto& log = emu::launch_log();
  if (a.has("again_T")) {  // a second launch in this process: another kernel of the same signature
    GlueParams q = p;
    q.T = static_cast<int>(a.num("again_T", 1));
    q.residual = q.residual_norm_weight = q.layer_scalar = q.norm_weight = nullptr;
    q.residual_out = q.normed_out = nullptr;
    q.kind = GlueKind::kLinear;
    Buffer x2 = strided(q.T, H, H, E), out2 = strided(q.T, N, N, E);
    std::memset(x2.data(), 0, x2.bytes.size());
    q.x = x2.data();
    q.x_stride = H;
    q.out = out2.data();
    int64_t ws2 = 0, n2 = 0;
    std::vector<float> part2(static_cast<size_t>(glue_prepare<T>(q, static_cast<int>(a.num("sms", 8)), &ws2, &n2) / 4));
    std::vector<int32_t> cnt2(static_cast<size_t>(n2), 0);
    q.partials = part2.empty() ? nullptr : part2.data();
    q.counters = cnt2.empty() ? nullptr : cnt2.data();
    const cudaError_t err2 = rms_norm_linear<T>(q, nullptr);
    if (err2 != cudaSuccess || emu::launch_log().size() != 2) {
      std::printf("FAIL the second launch (T=%d) returned %d\n", q.T, err2);
      return 1;
    }
  }
  store(dir, "out", out);
  if (rout) store(dir, "residual_out", hout);
  if (nout) store(dir, "normed_out", nout_b);
  std::printf("OK path=%s splits=%d steps=%d m16=%d grid=%ux%ux%u smem=%zu groups=%d\n",
              glue::uses_mma<T>(p) ? "mma" : "scalar", p.plan.splits, p.plan.steps_per_split, p.plan.token_tiles_m16,
              log[0].grid.x, log[0].grid.y, log[0].grid.z, log[0].smem, Nd > 0 ? glue_mlp_groups(p.plan.row_tiles) : 0);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  auto a = parse(argc, argv);
  return finish(a, with_dtype(a.str("dtype"), [&](auto tag) { return run<decltype(tag)>(a); }));
}
