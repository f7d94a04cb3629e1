// Runs csrc/include/gemma4_mtp/q_only_attention.cuh's launcher and kernels on the CUDA emulator (emu.h)
// for one case given as key=value arguments, and checks out / lse against a double-precision reference.
// Driven by tests/test_q_only_attention_emulated.py. Prints one line "OK ..." or "FAIL ..." (exit 1);
// OK names the merge the launch took (merge=none|in_kernel|merge_kernel, from the launches it made).
// The counters of an in-kernel merge start zero and must be left zero.
//
//   dtype=bf16|f16|f32 D=64..512 Q= Hq= Hkv= bs= lens=700,3,0 window= softcap= scale=
//   layout=nhd|hnd|kvsplit|padded sms= smem= major= copies=late|early schedule=rr|ahead|behind seed=
//   wide=N (N garbage block-table columns past the end)  bad_block=b (an out-of-range id in request b)
//   bad_len=b (request b's seq_len past the table)  out_offset=1 (out one element into its allocation)
//   expect=refused (the launcher must return cudaErrorInvalidConfiguration and launch nothing)
//   counters=none expect=invalid (no counters where the kernel merges: cudaErrorInvalidValue, no launch)
#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <utility>

#include "emu.h"
#include "io.h"
#include "gemma4_mtp/q_only_attention.cuh"

using namespace gemma4_mtp;

namespace {

struct Args {
  std::string dtype = "bf16", layout = "nhd", copies = "late", schedule = "rr", expect = "ok", counters = "yes";
  int D = 256, Q = 1, Hq = 4, Hkv = 1, bs = 16, sms = 8, smem = emu_io::kH100SmemOptin, major = 9, seed = 1, wide = 0;
  int bad_block = -1, bad_len = -1, out_offset = 0;
  int64_t window = 0;
  double softcap = 0, scale = -1;
  std::vector<int> lens{100};
};

// The case, from key=value arguments (io.h: every key given must be read, see finish()).
Args parse(const emu_io::Args& kv) {
  Args a;
  a.dtype = kv.str("dtype", a.dtype);
  a.layout = kv.str("layout", a.layout);
  a.copies = kv.str("copies", a.copies);
  a.schedule = kv.str("schedule", a.schedule);
  a.expect = kv.str("expect", a.expect);
  a.counters = kv.str("counters", a.counters);
  for (auto [key, field] : {std::pair{"D", &a.D}, {"Q", &a.Q}, {"Hq", &a.Hq}, {"Hkv", &a.Hkv}, {"bs", &a.bs},
                            {"sms", &a.sms}, {"smem", &a.smem}, {"major", &a.major}, {"seed", &a.seed},
                            {"wide", &a.wide}, {"bad_block", &a.bad_block}, {"bad_len", &a.bad_len},
                            {"out_offset", &a.out_offset}})
    *field = static_cast<int>(kv.num(key, *field));
  a.window = kv.num("window", a.window);
  a.softcap = kv.real("softcap", a.softcap);
  a.scale = kv.real("scale", a.scale);
  if (kv.has("lens")) {
    a.lens.clear();
    std::stringstream ss(kv.str("lens"));
    for (std::string t; std::getline(ss, t, ',');) a.lens.push_back(std::stoi(t));
  }
  if (a.scale < 0) a.scale = 1.0 / std::sqrt(static_cast<double>(a.D));
  return a;
}

template <class T>
int run(const Args& a) {
  constexpr int E = static_cast<int>(sizeof(T));
  std::mt19937 rng(a.seed);
  std::normal_distribution<float> normal;
  const int B = static_cast<int>(a.lens.size()), D = a.D, bs = a.bs, Hkv = a.Hkv, G = a.Hq / a.Hkv;
  std::vector<int> per_req(B);
  int max_blocks = 1, num_blocks = 3;
  for (int b = 0; b < B; ++b) {
    per_req[b] = std::max(1, (a.lens[b] + bs - 1) / bs);
    max_blocks = std::max(max_blocks, per_req[b] + 1);
    num_blocks += per_req[b];
  }
  max_blocks += a.wide;

  // Cache storage and element strides per layout; K and V rows are D contiguous elements.
  const int pad = a.layout == "padded" ? 16 / E : 0;
  int64_t ks[3], vs[3], k_off = 0, v_off = 0, total = 0;
  if (a.layout == "nhd" || a.layout == "padded") {
    const int64_t P = D + pad;
    ks[0] = vs[0] = bs * Hkv * P;
    ks[1] = vs[1] = Hkv * P;
    ks[2] = vs[2] = P;
    total = num_blocks * ks[0];
  } else if (a.layout == "hnd") {  // [nb, Hkv, bs, D] storage seen as [nb, bs, Hkv, D]
    ks[0] = vs[0] = int64_t{Hkv} * bs * D;
    ks[1] = vs[1] = D;
    ks[2] = vs[2] = int64_t{bs} * D;
    total = num_blocks * ks[0];
  } else if (a.layout == "kvsplit") {  // one [nb, 2, bs, Hkv, D] buffer; K = [:, 0], V = [:, 1]
    ks[0] = vs[0] = 2LL * bs * Hkv * D;
    ks[1] = vs[1] = int64_t{Hkv} * D;
    ks[2] = vs[2] = D;
    v_off = int64_t{bs} * Hkv * D;
    total = num_blocks * ks[0];
  } else {
    emu::fail("unknown layout");
  }
  const bool shared_kv = a.layout == "kvsplit";
  std::vector<T> kbuf(total, from_float<T>(NAN)), vbuf(shared_kv ? 0 : total, from_float<T>(NAN));
  T* kc = kbuf.data() + k_off;
  T* vc = (shared_kv ? kbuf.data() : vbuf.data()) + v_off;

  // Block table: a random permutation of the blocks; columns a call must not read hold garbage ids.
  std::vector<int32_t> table(int64_t{B} * max_blocks);
  std::vector<int> perm(num_blocks);
  for (int i = 0; i < num_blocks; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), rng);
  std::uniform_int_distribution<int> garbage(-1000000, 1000000);
  for (auto& t : table) t = garbage(rng) | 0x40000;  // never a valid id
  std::vector<int32_t> lens(a.lens.begin(), a.lens.end());
  for (int b = 0; b < B; ++b) {
    const int n = lens[b];
    const int start = a.window > 0 ? std::max<int64_t>(0, n - a.window) : 0;
    for (int j = 0; j < per_req[b]; ++j) {
      const int blk = perm.back();
      perm.pop_back();
      if ((j + 1) * bs > start) table[int64_t{b} * max_blocks + j] = blk;  // blocks wholly before the window: garbage
      for (int s = 0; s < bs && j * bs + s < n; ++s)
        for (int h = 0; h < Hkv; ++h)
          for (int d = 0; d < D; ++d) {
            kc[blk * ks[0] + s * ks[1] + h * ks[2] + d] = from_float<T>(normal(rng));
            vc[blk * vs[0] + s * vs[1] + h * vs[2] + d] = from_float<T>(normal(rng));
          }
    }
  }
  std::vector<T> q(int64_t{B} * a.Q * a.Hq * D);
  for (auto& x : q) x = from_float<T>(normal(rng));
  std::vector<bool> expect_nan(B, false);
  if (a.bad_block >= 0) {  // an out-of-range id among the blocks request bad_block reads
    const int b = a.bad_block, n = lens[b];
    table[int64_t{b} * max_blocks + (n - 1) / bs] = num_blocks + 7;
    expect_nan[b] = true;
  }
  if (a.bad_len >= 0) {
    lens[a.bad_len] = max_blocks * bs + 5;
    expect_nan[a.bad_len] = true;
  }

  const int64_t out_elems = int64_t{B} * a.Q * a.Hq * D;
  std::vector<T> out_buf(out_elems + a.out_offset, from_float<T>(NAN));
  T* out = out_buf.data() + a.out_offset;
  std::vector<float> lse(int64_t{B} * a.Q * a.Hq, NAN);

  AttentionParams p{};
  auto st = [](int64_t size, int64_t stride) { return size == 1 ? int64_t{0} : stride; };  // as the binding
  p.q = q.data();
  p.q_stride[0] = st(B, int64_t{a.Q} * a.Hq * D);
  p.q_stride[1] = st(a.Q, int64_t{a.Hq} * D);
  p.q_stride[2] = st(a.Hq, D);
  p.k_cache = kc;
  p.v_cache = vc;
  p.k_stride[0] = st(num_blocks, ks[0]);
  p.k_stride[1] = st(bs, ks[1]);
  p.k_stride[2] = st(Hkv, ks[2]);
  p.v_stride[0] = st(num_blocks, vs[0]);
  p.v_stride[1] = st(bs, vs[1]);
  p.v_stride[2] = st(Hkv, vs[2]);
  p.block_table = table.data();
  p.block_table_stride = max_blocks;
  p.seq_lens = lens.data();
  p.out = out;
  p.lse = lse.data();
  p.B = B;
  p.Q = a.Q;
  p.Hq = a.Hq;
  p.Hkv = Hkv;
  p.D = D;
  p.num_blocks = num_blocks;
  p.block_size = bs;
  p.max_blocks = max_blocks;
  p.scale = static_cast<float>(a.scale);
  p.softcap = static_cast<float>(a.softcap);
  p.window = a.window;
  p.num_splits = attention_plan_for(E, p, a.sms).num_splits;
  std::vector<float> ws(attention::workspace_floats(B, a.Q, a.Hq, D, p.num_splits), NAN);
  p.workspace = ws.empty() ? nullptr : ws.data();
  std::vector<int32_t> counters(static_cast<size_t>(attention_counters_for(E, p)), 0);
  p.counters = counters.empty() || a.counters == "none" ? nullptr : counters.data();

  emu_io::use_device(a.smem, a.major, a.sms, a.schedule);
  emu::late_copies() = a.copies == "late";
  const cudaError_t err = q_only_paged_attention<T>(p, nullptr);
  if (a.expect == "refused" || a.expect == "invalid") {
    const cudaError_t want = a.expect == "refused" ? cudaErrorInvalidConfiguration : cudaErrorInvalidValue;
    const bool ok = err == want && emu::launch_log().empty();
    std::printf("%s launcher returned %d after %zu launches\n", ok ? "OK refused:" : "FAIL", err, emu::launch_log().size());
    return ok ? 0 : 1;
  }
  // An in-kernel merge is one launch; the merge kernel a second one.
  const size_t want_launches = p.num_splits > 1 && counters.empty() ? 2 : 1;
  if (!emu_io::launched_as_expected(err, want_launches, a.major >= 9, counters)) return 1;
  const auto& log = emu::launch_log();
  const char* merge = p.num_splits == 1 ? "none" : log.size() == 1 ? "in_kernel" : "merge_kernel";

  // Reference in double from the same (rounded) inputs.
  double worst = 0, worst_lse = 0;
  const double tol_abs = E == 4 ? 1e-4 : (std::is_same_v<T, __half> ? 4e-3 : 2e-2);
  const double tol_rel = E == 4 ? 1e-4 : (std::is_same_v<T, __half> ? 2e-3 : 1e-2);
  int bad = 0;
  for (int b = 0; b < B; ++b) {
    const int n = a.lens[b];
    const int start = a.window > 0 ? std::max<int64_t>(0, n - a.window) : 0;
    for (int qi = 0; qi < a.Q; ++qi)
      for (int h = 0; h < a.Hq; ++h) {
        const int kvh = h / G;
        const int64_t row = (int64_t{b} * a.Q + qi) * a.Hq + h;
        const T* qr = q.data() + row * D;
        std::vector<double> s;
        double mx = -INFINITY;
        for (int pos = start; pos < n; ++pos) {
          const int blk = table[int64_t{b} * max_blocks + pos / bs];
          const T* kr = kc + blk * ks[0] + (pos % bs) * ks[1] + kvh * ks[2];
          double dot = 0;
          if (!expect_nan[b])
            for (int d = 0; d < D; ++d) dot += double(to_float(qr[d])) * double(to_float(kr[d]));
          double x = a.scale * dot;
          if (a.softcap > 0) x = a.softcap * std::tanh(x / a.softcap);
          s.push_back(x);
          mx = std::max(mx, x);
        }
        double l = 0;
        std::vector<double> o(D, 0.0);
        for (size_t i = 0; i < s.size() && !expect_nan[b]; ++i) {
          const int pos = start + static_cast<int>(i);
          const int blk = table[int64_t{b} * max_blocks + pos / bs];
          const T* vr = vc + blk * vs[0] + (pos % bs) * vs[1] + kvh * vs[2];
          const double w = std::exp(s[i] - mx);
          l += w;
          for (int d = 0; d < D; ++d) o[d] += w * to_float(vr[d]);
        }
        const double ref_lse = s.empty() ? -INFINITY : mx + std::log(l);
        const float got_lse = lse[row];
        for (int d = 0; d < D; ++d) {
          const float g = to_float(out[row * D + d]);
          if (expect_nan[b]) {
            if (!std::isnan(g)) ++bad;
            continue;
          }
          const double ref = s.empty() ? 0.0 : o[d] / l;
          const double e = std::fabs(g - ref);
          if (!(e <= tol_abs + tol_rel * std::fabs(ref))) {
            if (bad < 5)
              std::fprintf(stderr, "out[b=%d q=%d h=%d d=%d] = %g, reference %g\n", b, qi, h, d, g, ref);
            ++bad;
          }
          worst = std::max(worst, std::isnan(e) ? INFINITY : e);
        }
        if (expect_nan[b]) {
          if (!std::isnan(got_lse)) ++bad;
        } else if (s.empty()) {
          if (!(std::isinf(got_lse) && got_lse < 0)) ++bad;
        } else {
          const double e = std::fabs(got_lse - ref_lse);
          if (!(e <= 1e-3 + 1e-5 * std::fabs(ref_lse))) {
            if (bad < 5) std::fprintf(stderr, "lse[b=%d q=%d h=%d] = %g, reference %g\n", b, qi, h, got_lse, ref_lse);
            ++bad;
          }
          worst_lse = std::max(worst_lse, std::isnan(e) ? INFINITY : e);
        }
      }
  }
  if (a.out_offset && !std::isnan(to_float(out_buf[0]))) ++bad;  // the element before out is untouched
  std::printf("%s splits=%d launches=%zu merge=%s counters=%zu smem=%zu grid=%ux%u max_err=%.3g lse_err=%.3g "
              "mismatches=%d\n",
              bad ? "FAIL" : "OK", p.num_splits, log.size(), merge, counters.size(), log[0].smem, log[0].grid.x,
              log[0].grid.y, worst, worst_lse, bad);
  return bad ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  const emu_io::Args kv = emu_io::parse(argc, argv);
  const Args a = parse(kv);
  return emu_io::finish(kv, emu_io::with_dtype(a.dtype, [&](auto tag) { return run<decltype(tag)>(a); }));
}
