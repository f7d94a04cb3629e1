// Runs benchmarks/cuda/stage_boundary.cuh (the chains whose stage boundaries bench_stage_boundary.py
// times on a GPU) on the CUDA emulator (emu.h): one run of a chain from DIR/start.bin, the result (the
// vector the last stage wrote) to DIR/result.bin, the other vector poisoned. Prints one line "OK ..." or
// "FAIL ..." (exit 1).
//
//   dir=PATH mode=launch|pdl|barrier|barrier_fence|cluster|cluster_shared|cluster_push programs= n= stages=
//   sms= major= counter= (the barrier's at launch) schedule=rr|ahead|behind (emu::Schedule: ahead / behind run each
//   program as far as it goes)
// The launcher must make `stages` launches (launch, pdl: with programmatic dependent launch exactly for
// pdl) or one cooperative or cluster launch (barrier, barrier_fence, cluster*), all of them
// succeeding; a cluster the launch refuses (too many programs, sm_80) prints "REFUSED" instead.
//   dir=PATH mode=stream programs= words= passes=: stream_kernel over DIR/start.bin (programs x words
//   16-byte words), each program's sum to DIR/result.bin.
//   dir=PATH mode=gemv programs= chain=n:k:norm:glu[:window],...: cluster_gemv's chain from DIR/x.bin (fp32)
//   and DIR/w.bin (bf16, the stages' [n, k] weights or [2, window, k] keys and values end to end), its output
//   to DIR/result.bin; a chain the launcher refuses prints "REFUSED".
//   dir=PATH mode=wide programs= n= k= norm=: stream_gemv's GEMV of DIR/w.bin ([n, k] bf16) and DIR/x.bin
//   (fp32), its output to DIR/result.bin; a shape or device the launcher refuses prints "REFUSED".
//   misalign=NAME (gemv: w; wide: w, x; attention: q, k, v): that pointer 4 bytes off its buffer's start.
//   dir=PATH mode=attention heads= dim= kv_heads= kernel=scalar|mma programs= ctx= pages= launches=:
//   stream_attention's attention (on the CUDA cores or tensor cores) of the layer of `heads` query heads of `dim`
//   on a key-value head (default E2B's full layer, 4 of 512, one head) of DIR/q.bin (fp32 [kv_heads * heads, dim])
//   over DIR/k.bin and DIR/v.bin (bf16 [pages, 16, kv_heads, dim]) through DIR/table.bin (int32 [ctx / 16]),
//   `launches` times (each must leave the merge's counters zero for the next), the last output to DIR/result.bin;
//   what the launcher refuses prints "REFUSED", a layer it has no kernel for "FAIL".
//   cluster_order=evens_first (any mode): a cluster launch runs its even-indexed clusters first (emu.h).
#include <algorithm>
#include <cstdio>
#include <string>
#include <type_traits>
#include <vector>

#include "emu.h"
#include "io.h"
#include "cluster_gemv.cuh"
#include "stage_boundary.cuh"
#include "stream_attention.cuh"
#include "stream_gemv.cuh"

using namespace emu_io;

// The end of a mode that makes one launch: "REFUSED" when the launcher refused before launching anything,
// else the launch checked and `out` stored as the result.
int one_launch(const Args& a, const std::string& dir, cudaError_t err, const Buffer& out) {
  if (err == cudaErrorInvalidValue && emu::launch_log().empty()) {
    std::printf("REFUSED launches=0\n");
    return finish(a, 0);
  }
  if (!launched_as_expected(err, 1, false, {})) return 1;
  store(dir, "result", out);
  std::printf("OK launches=1\n");
  return finish(a, 0);
}

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  const std::string dir = a.str("dir"), mode_name = a.str("mode");
  const int programs = static_cast<int>(a.num("programs", 1)), n = static_cast<int>(a.num("n", 4));
  const int stages = static_cast<int>(a.num("stages", 1));
  // misalign=NAME: that pointer 4 bytes past its buffer's (16-byte aligned) start, which the launcher must refuse
  const std::string misalign = a.str("misalign", "");
  auto at = [&](const char* name, const void* p) {
    return static_cast<const void*>(static_cast<const unsigned char*>(p) + (misalign == name ? 4 : 0));
  };
  use_device(kH100SmemOptin, static_cast<int>(a.num("major", 9)), static_cast<int>(a.num("sms", 8)),
             a.str("schedule", "rr"));
  emu::clusters_evens_first() = a.str("cluster_order", "index") == "evens_first";
  if (mode_name == "stream") {
    const int words = static_cast<int>(a.num("words", 1)), passes = static_cast<int>(a.num("passes", 1));
    Buffer buf = load(dir, "start", 1, programs * words * 4, programs * words * 4, 4);
    Buffer sums = strided(1, programs, programs, 4);
    const cudaError_t err = stage_boundary::stream(static_cast<const uint4*>(buf.data()), words, passes,
                                                   static_cast<uint32_t*>(sums.data()), programs, nullptr);
    if (!launched_as_expected(err, 1, false, {})) return 1;
    store(dir, "result", sums);
    std::printf("OK launches=1\n");
    return finish(a, 0);
  }
  if (mode_name == "wide") {
    stream_gemv::Gemv g{};
    g.n = n;
    g.k = static_cast<int>(a.num("k", 256));
    g.norm = static_cast<int>(a.num("norm", 0));
    Buffer x = load(dir, "x", 1, g.k, g.k, 4);
    Buffer w = load(dir, "w", g.n, g.k, g.k, 2);
    Buffer y = strided(1, g.n, g.n, 4);
    g.w = static_cast<const __nv_bfloat16*>(at("w", w.data()));
    g.x = static_cast<const float*>(at("x", x.data()));
    g.y = static_cast<float*>(y.data());
    return one_launch(a, dir, stream_gemv::run(g, programs, nullptr), y);
  }
  if (mode_name == "attention") {
    namespace sa = stream_attention;
    const int ctx = static_cast<int>(a.num("ctx", 16)), pages = static_cast<int>(a.num("pages", 1));
    const int launches = static_cast<int>(a.num("launches", 1)), kv_heads = static_cast<int>(a.num("kv_heads", 1));
    const int heads = static_cast<int>(a.num("heads", sa::E2bFull::kHeads));
    const int dim = static_cast<int>(a.num("dim", sa::E2bFull::kDim));
    int rc = 1;
    const bool mma = a.str("kernel", "scalar") == "mma";
    auto attend = [&](auto layer, auto path) {
      using L = decltype(layer);
      constexpr bool kMma = decltype(path)::value;
      const int64_t rows = std::max(kv_heads, 1);  // the buffers of one head where kv_heads (refused) is not positive
      const int64_t q_len = rows * L::kHeads * L::kDim, page = rows * sa::kPage * L::kDim;
      Buffer q = load(dir, "q", 1, q_len, q_len, 4);
      Buffer k = load(dir, "k", pages, page, page, 2);
      Buffer v = load(dir, "v", pages, page, page, 2);
      Buffer table = load(dir, "table", 1, ctx / sa::kPage, ctx / sa::kPage, 4);
      Buffer out = strided(1, q_len, q_len, 4);
      const int64_t slots = static_cast<int64_t>(programs) * L::kSlot;
      Buffer workspace = strided(1, slots, slots, 4);
      std::vector<int32_t> counters(static_cast<size_t>(rows) * sa::kCluster, 0);
      sa::Attention att{static_cast<const float*>(at("q", q.data())),
                        static_cast<const __nv_bfloat16*>(at("k", k.data())),
                        static_cast<const __nv_bfloat16*>(at("v", v.data())),
                        static_cast<const int32_t*>(table.data()), ctx, kv_heads, static_cast<float*>(out.data()),
                        static_cast<float*>(workspace.data()), counters.data()};
      for (int l = 0; l + 1 < launches; ++l) {  // the earlier launches, each checked; the last is one_launch's
        const cudaError_t err = sa::run<L, kMma>(att, programs, nullptr);
        if (!launched_as_expected(err, 1, false, {})) return;
        emu::launch_log().clear();
        std::memset(out.data(), 0xFF, out.bytes.size());  // NaN again: the next launch must write every entry
      }
      rc = one_launch(a, dir, sa::run<L, kMma>(att, programs, nullptr), out);
      for (int32_t c : counters)
        if (c != 0) {
          std::printf("FAIL a launch left a merge counter at %d\n", c);
          rc = 1;
          return;
        }
    };
    const bool known = sa::with_layer(heads, dim, [&](auto layer) {
      if (mma) attend(layer, std::true_type{});
      else attend(layer, std::false_type{});
    });
    if (!known) std::printf("FAIL no layer of stream_attention.cuh has %d heads of %d\n", heads, dim);
    return rc;
  }
  if (mode_name == "gemv") {
    cluster_gemv::Chain c{};
    if (!cluster_gemv::append_stages(a.str("chain"), &c) || c.stages == 0) {
      std::printf("FAIL chain=%s is not n:k:norm:glu[:window],...\n", a.str("chain").c_str());
      return 1;
    }
    size_t weights = 0;
    for (int i = 0; i < c.stages; ++i) weights += cluster_gemv::weight_count(c.stage[i]);
    const int in = cluster_gemv::input_len(c.stage[0]), out = c.stage[c.stages - 1].n;
    Buffer x = load(dir, "x", 1, in, in, 4);
    Buffer w = load(dir, "w", 1, static_cast<int64_t>(weights), static_cast<int64_t>(weights), 2);
    Buffer y = strided(1, out, out, 4);
    size_t off = 0;
    for (int i = 0; i < c.stages; ++i) {
      c.stage[i].w = static_cast<const __nv_bfloat16*>(at("w", w.data())) + off;
      off += cluster_gemv::weight_count(c.stage[i]);
    }
    c.x = static_cast<const float*>(x.data());
    c.y = static_cast<float*>(y.data());
    return one_launch(a, dir, cluster_gemv::run(c, programs, nullptr), y);
  }
  const stage_boundary::Mode mode = mode_name == "pdl"              ? stage_boundary::Mode::kPdl
                                    : mode_name == "barrier"        ? stage_boundary::Mode::kBarrier
                                    : mode_name == "barrier_fence"  ? stage_boundary::Mode::kBarrierFence
                                    : mode_name == "cluster"        ? stage_boundary::Mode::kCluster
                                    : mode_name == "cluster_shared" ? stage_boundary::Mode::kClusterShared
                                    : mode_name == "cluster_push"   ? stage_boundary::Mode::kClusterPush
                                                                    : stage_boundary::Mode::kLaunch;
  const bool cluster = mode == stage_boundary::Mode::kCluster || mode == stage_boundary::Mode::kClusterShared ||
                       mode == stage_boundary::Mode::kClusterPush;
  Buffer vec[2] = {load(dir, "start", 1, n, n, 4), strided(1, n, n, 4)};
  std::vector<int32_t> counter = {static_cast<int32_t>(a.num("counter", 0))};  // grid_barrier: low 31 bits zero
  stage_boundary::Chain c{};
  c.vec[0] = static_cast<uint32_t*>(vec[0].data());
  c.vec[1] = static_cast<uint32_t*>(vec[1].data());
  c.n = n;
  c.stages = stages;
  c.counter = counter.data();
  const cudaError_t err = stage_boundary::run(mode, c, programs, nullptr);
  if (cluster && err == cudaErrorInvalidValue && emu::launch_log().empty()) {
    std::printf("REFUSED launches=0\n");
    return finish(a, 0);
  }
  const bool one = cluster || mode == stage_boundary::Mode::kBarrier || mode == stage_boundary::Mode::kBarrierFence;
  if (!launched_as_expected(err, one ? 1 : static_cast<size_t>(stages), mode == stage_boundary::Mode::kPdl, {}))
    return 1;
  if ((counter[0] & 0x7FFFFFFF) != 0) {  // what the next launch's barriers need
    std::printf("FAIL the barrier left its counter at %d\n", counter[0]);
    return 1;
  }
  store(dir, "result", vec[stages & 1]);
  std::printf("OK launches=%zu counter=%d\n", emu::launch_log().size(), counter[0]);
  return finish(a, 0);
}
