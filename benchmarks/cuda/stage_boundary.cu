// The GPU side of benchmarks/bench_stage_boundary.py (which builds and runs it): times the chains of
// stage_boundary.cuh in CUDA graphs and prints one JSON object.
//
//   stage_boundary [programs=1,8,32,66,132,264] [cluster_programs=2,4,8,16] [n=2048] [stages=32] [replays=40]
//                  [repeats=7] [stream_programs=1,8,16,132] [wide_programs=128] [sliding_layer=STAGES]
//                  [full_layer=STAGES] [step=STAGES] [wide=STAGES] [attention=LAYERS] [attention_programs=128]
//
// STAGES: n:k:norm:glu[:window],... (cluster_gemv::append_stages); LAYERS: heads:dim:kv_heads:ctx,... (a layer's
// query heads on a key-value head, their dimension, its key-value heads, the keys attended). The drafters' shapes
// are not written here: bench_stage_boundary.py passes them, from gemma4_mtp_kernels.drafter_shapes.
//
// For each mode and program count: the chain with 1 stage and with `stages` stages, each captured in a
// graph and replayed `replays` times between two events, `repeats` times; us_per_stage is the slope
// (median(t_stages) - median(t_1)) / (stages - 1), the cost of one more dependent stage with the graph's
// own launch taken out. Each graph's first replay is checked against the chain computed on the host.
// A mode that cannot run a program count (PDL before sm_90, a cooperative grid that is not resident at
// once) is reported with "skipped" and the reason; a chain that stream capture refuses is timed as
// stream launches ("graph": false); a CUDA error is reported for its configuration ("error"), and the
// exit status is then 1, as for a wrong result. The cluster modes run one cluster of each of
// cluster_programs (sm_90; sizes above 8 opted in, skipped where cudaOccupancyMaxActiveClusters finds none).
// Then "stream": for each of stream_programs, what that many programs (one an SM) read per second from L2
// (a 256 KiB slice each, re-read) and from DRAM (8 MiB each at least, 128 MiB in all at least), the slope
// between 1 and 9 passes (L2) or 1 and 3 (DRAM), each program's sums checked. Then "gemv": layers in one
// cluster of each of cluster_programs (cluster_gemv.cuh): 1 and 4 of full_layer (a full layer's GEMVs) and of
// sliding_layer (a whole sliding layer), then the chain `step` (a drafter step's stages in order), checked
// against float64. Then "wide_gemv": each GEMV of `wide` on each of wide_programs (stream_gemv.cuh), µs a
// launch with every launch's weights cold in L2, checked against float64. Then "attention": each layer of
// `attention` at B = 1 on each of attention_programs (stream_attention.cuh), µs a launch with every launch's cache
// cold in L2, checked against float64, each on the CUDA cores ("kernel": "scalar") and on tensor cores ("mma").
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <array>
#include <functional>
#include <initializer_list>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cluster_gemv.cuh"
#include "stream_attention.cuh"
#include "stream_gemv.cuh"
#include "stage_boundary.cuh"

namespace {

using stage_boundary::Chain;
using stage_boundary::Mode;

#define CHECK(call)                                                                                  \
  do {                                                                                               \
    const cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess) {                                                                         \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));     \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)

std::vector<uint32_t> initial(int n) {
  std::vector<uint32_t> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<uint32_t>(i) * 2654435761u;
  return v;
}

// The chain on the host: what vector stages % 2 must hold after one run from initial(n).
std::vector<uint32_t> expected(int n, int stages) {
  std::vector<uint32_t> v = initial(n);
  for (int s = 0; s < stages; ++s) {
    uint32_t sum = 0;
    for (uint32_t x : v) sum += x;
    for (uint32_t& x : v) x += sum + 1u;
  }
  return v;
}

struct Timing {
  bool ok = false;
  bool graph = true;     // false: the chain could not be captured and ran as stream launches
  double median_us = 0;  // one replay of the graph (or one enqueue of the chain)
};

// Fails the enclosing function with the call and CUDA's message.
#define TRY(call)                                                                                    \
  do {                                                                                               \
    const cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess) return std::string(#call) + ": " + cudaGetErrorString(e_);                \
  } while (0)

// The median over `repeats` runs of `replays` calls of `enqueue` (each enqueues work on `stream`)
// between two events: µs per call, into *us.
template <class Enqueue>
std::string median_us(Enqueue&& enqueue, int replays, int repeats, cudaStream_t stream, double* us) {
  cudaEvent_t a, b;
  TRY(cudaEventCreate(&a));
  TRY(cudaEventCreate(&b));
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    TRY(cudaEventRecord(a, stream));
    for (int i = 0; i < replays; ++i) TRY(enqueue());
    TRY(cudaEventRecord(b, stream));
    TRY(cudaEventSynchronize(b));
    float ms = 0;
    TRY(cudaEventElapsedTime(&ms, a, b));
    t.push_back(1000.0 * ms / replays);
  }
  std::sort(t.begin(), t.end());
  *us = t[t.size() / 2];
  TRY(cudaEventDestroy(a));
  TRY(cudaEventDestroy(b));
  return "";
}

// One chain timed; returns "" or what failed (reported for this configuration only: the others run).
std::string time_chain(Mode mode, Chain c, int programs, int replays, int repeats, cudaStream_t stream, Timing* t) {
  const size_t bytes = static_cast<size_t>(c.n) * sizeof(uint32_t);
  const std::vector<uint32_t> start = initial(c.n);
  // on the chain's stream: a non-blocking stream does not wait for the legacy stream's memset, nor for a
  // pageable copy's DMA, which cudaMemcpy may return before
  TRY(cudaMemcpyAsync(c.vec[0], start.data(), bytes, cudaMemcpyHostToDevice, stream));
  TRY(cudaMemsetAsync(c.vec[1], 0, bytes, stream));
  TRY(cudaStreamSynchronize(stream));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TRY(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const cudaError_t launched = stage_boundary::run(mode, c, programs, stream);
  const cudaError_t captured = cudaStreamEndCapture(stream, &graph);
  if (launched == cudaSuccess && captured == cudaSuccess && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
    t->graph = true;
  } else {  // e.g. a launch kind that stream capture refuses: time the stream launches instead
    (void)cudaGetLastError();
    if (graph != nullptr) cudaGraphDestroy(graph);
    graph = nullptr;
    exec = nullptr;
    t->graph = false;
  }
  auto replay = [&] { return exec != nullptr ? cudaGraphLaunch(exec, stream) : stage_boundary::run(mode, c, programs, stream); };
  TRY(replay());
  TRY(cudaStreamSynchronize(stream));
  std::vector<uint32_t> got(static_cast<size_t>(c.n));
  TRY(cudaMemcpy(got.data(), c.vec[c.stages & 1], bytes, cudaMemcpyDeviceToHost));
  t->ok = got == expected(c.n, c.stages);
  for (int i = 0; i < 10; ++i) TRY(replay());
  const std::string timed = median_us(replay, replays, repeats, stream, &t->median_us);
  if (!timed.empty()) return timed;
  if (exec != nullptr) TRY(cudaGraphExecDestroy(exec));
  if (graph != nullptr) TRY(cudaGraphDestroy(graph));
  return "";
}

// Why `programs` blocks of `threads` threads and `smem` bytes of `kernel`, in clusters of `cluster` (default: one
// cluster of them all), cannot run here (nullptr: they can).
const char* cluster_unfit(const void* kernel, int programs, int threads, size_t smem, int major, int cluster = 0) {
  cluster = cluster > 0 ? cluster : programs;
  if (major < 9) return "thread block clusters need sm_90";
  if (cluster < 1 || cluster > gemma4_mtp::kMaxCluster) return "a cluster has 1 to 16 programs";
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
          cudaSuccess) {
    (void)cudaGetLastError();
    return "the kernel's cluster or shared memory attribute was refused";
  }
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1] = {gemma4_mtp::cluster_dimension(cluster)};
  cfg.gridDim = dim3(static_cast<unsigned>(programs));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess || clusters < 1) {
    (void)cudaGetLastError();
    return "cudaOccupancyMaxActiveClusters: no cluster of this size fits";
  }
  return nullptr;
}

// The same for a cluster mode's chain kernel over n elements.
const char* cluster_skip(Mode mode, int programs, int n, int major) {
  using stage_boundary::cluster_chain_kernel, stage_boundary::cluster_push_chain_kernel,
      stage_boundary::cluster_shared_chain_kernel;
  const void* kernel = mode == Mode::kClusterShared ? reinterpret_cast<const void*>(cluster_shared_chain_kernel)
                       : mode == Mode::kClusterPush ? reinterpret_cast<const void*>(cluster_push_chain_kernel)
                                                    : reinterpret_cast<const void*>(cluster_chain_kernel);
  const size_t smem = mode == Mode::kClusterShared ? stage_boundary::shared_smem(n, programs)
                      : mode == Mode::kClusterPush ? stage_boundary::push_smem(n)
                                                   : stage_boundary::kSmem;
  return cluster_unfit(kernel, programs, stage_boundary::kThreads, smem, major);
}

// One stream measurement: us per pass (the slope between `lo` and `hi` passes of `replays` launches,
// median of `repeats`), and whether every program's sum matched the host's.
std::string time_stream(const uint4* buf, const std::vector<uint32_t>& slice_sums, int per_vec, int programs, int lo,
                        int hi, int replays, int repeats, uint32_t* sums, cudaStream_t stream, double* us_per_pass,
                        bool* ok) {
  double median[2] = {0, 0};
  const int passes[2] = {lo, hi};
  *ok = true;
  for (int k = 0; k < 2; ++k) {
    TRY(stage_boundary::stream(buf, per_vec, passes[k], sums, programs, stream));
    TRY(cudaStreamSynchronize(stream));
    std::vector<uint32_t> got(static_cast<size_t>(programs));
    TRY(cudaMemcpy(got.data(), sums, got.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost));
    for (int p = 0; p < programs; ++p)
      *ok = *ok && got[static_cast<size_t>(p)] == slice_sums[static_cast<size_t>(p)] * static_cast<uint32_t>(passes[k]);
    const std::string timed = median_us(
        [&] { return stage_boundary::stream(buf, per_vec, passes[k], sums, programs, stream); }, replays, repeats,
        stream, &median[k]);
    if (!timed.empty()) return timed;
  }
  *us_per_pass = (median[1] - median[0]) / (hi - lo);
  return "";
}

// An instantiated graph's median replay in µs (after `warmups` replays), then the graph and `buffers` freed.
std::string time_graph(cudaGraph_t graph, cudaGraphExec_t exec, int warmups, int replays, int repeats,
                       cudaStream_t stream, double* us, std::initializer_list<void*> buffers) {
  for (int i = 0; i < warmups; ++i) TRY(cudaGraphLaunch(exec, stream));
  const std::string timed = median_us([&] { return cudaGraphLaunch(exec, stream); }, replays, repeats, stream, us);
  if (!timed.empty()) return timed;
  TRY(cudaGraphExecDestroy(exec));
  TRY(cudaGraphDestroy(graph));
  for (void* b : buffers) TRY(cudaFree(b));
  return "";
}

// An attention stage on the host, in double: x (heads x k) each head normed (s.norm), softmax(q K^T) V over
// the window's keys K and values V (bf16 as floats, [2, window, k] at kv).
std::vector<double> attention_reference(const cluster_gemv::Stage& s, const float* kv, std::vector<double> x) {
  const size_t k = static_cast<size_t>(s.k), window = static_cast<size_t>(s.window);
  std::vector<double> out(x.size());
  for (size_t h = 0; h < x.size() / k; ++h) {
    double* q = x.data() + h * k;
    if (s.norm) {
      double sq = 0;
      for (size_t i = 0; i < k; ++i) sq += q[i] * q[i];
      const double r = 1.0 / std::sqrt(sq / static_cast<double>(k) + 1e-6);
      for (size_t i = 0; i < k; ++i) q[i] *= r;
    }
    std::vector<double> p(window);
    double m = -INFINITY, l = 0;
    for (size_t t = 0; t < window; ++t) {
      p[t] = 0;
      for (size_t i = 0; i < k; ++i) p[t] += q[i] * kv[t * k + i];
      m = std::max(m, p[t]);
    }
    for (size_t t = 0; t < window; ++t) l += (p[t] = std::exp(p[t] - m));
    for (size_t i = 0; i < k; ++i) {
      double acc = 0;
      for (size_t t = 0; t < window; ++t) acc += p[t] * kv[(window + t) * k + i];
      out[h * k + i] = acc / l;
    }
  }
  return out;
}

// The chain on the host, in double, from the bf16 weights (as floats) `w` laid end to end.
std::vector<double> gemv_reference(const std::vector<cluster_gemv::Stage>& st, const std::vector<float>& w,
                                   const std::vector<float>& x0) {
  std::vector<double> x(x0.begin(), x0.end());
  size_t off = 0;
  for (const auto& s : st) {
    if (s.window) {
      x = attention_reference(s, w.data() + off, x);
      off += cluster_gemv::weight_count(s);
      continue;
    }
    if (s.glu)
      for (int i = 0; i < s.k; ++i) {
        const double a = x[static_cast<size_t>(i)];
        x[static_cast<size_t>(i)] = 0.5 * a * (1.0 + std::tanh(0.7978845608 * (a + 0.044715 * a * a * a))) *
                                    x[static_cast<size_t>(s.k + i)];
      }
    double scale = 1.0;
    if (s.norm) {
      double sq = 0;
      for (int i = 0; i < s.k; ++i) sq += x[static_cast<size_t>(i)] * x[static_cast<size_t>(i)];
      scale = 1.0 / std::sqrt(sq / s.k + 1e-6);
    }
    std::vector<double> y(static_cast<size_t>(s.n));
    for (int r = 0; r < s.n; ++r) {
      double acc = 0;
      for (int i = 0; i < s.k; ++i) acc += w[off + static_cast<size_t>(r) * s.k + i] * x[static_cast<size_t>(i)];
      y[static_cast<size_t>(r)] = scale * acc;
    }
    off += cluster_gemv::weight_count(s);
    x = y;
  }
  return x;
}

// `count` weights ~ U(-1, 1) / 16 through bf16 (a hash of the index), and the same as floats for the host.
struct HostWeights {
  std::vector<__nv_bfloat16> bf16;
  std::vector<float> f32;
};
HostWeights host_weights(size_t count) {
  HostWeights w{std::vector<__nv_bfloat16>(count), std::vector<float>(count)};
  for (size_t i = 0; i < count; ++i) {
    w.bf16[i] = __float2bfloat16((static_cast<float>((i * 2654435761u) >> 8 & 0xFFFF) / 32768.0f - 1.0f) / 16.0f);
    w.f32[i] = __bfloat162float(w.bf16[i]);
  }
  return w;
}

// A GEMV's or a chain's input: k smooth entries.
std::vector<float> host_input(int k) {
  std::vector<float> x(static_cast<size_t>(k));
  for (int i = 0; i < k; ++i) x[static_cast<size_t>(i)] = std::sin(0.37f * static_cast<float>(i)) + 0.1f;
  return x;
}

// Whether the device's output matches the host's within 1e-3 of the largest entry.
bool matches(const std::vector<double>& want, const std::vector<float>& got) {
  double top = 0, err = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    top = std::max(top, std::fabs(want[i]));
    err = std::max(err, std::fabs(want[i] - static_cast<double>(got[i])));
  }
  return err <= 1e-3 * top;
}

// One chain of stages (`st`: E2B layers, as bench_stage_boundary.py writes them) on one cluster of `programs`:
// its graph replay's median time and whether its output matches the host's (relative 1e-3 of the largest entry).
std::string time_gemv(const std::vector<cluster_gemv::Stage>& st, int programs, int replays, int repeats,
                      cudaStream_t stream, double* us, bool* ok) {
  size_t total = 0;
  for (const auto& s : st) total += cluster_gemv::weight_count(s);
  const HostWeights wh = host_weights(total);
  const std::vector<float> x0 = host_input(cluster_gemv::input_len(st.front()));
  const size_t out = static_cast<size_t>(st.back().n);
  __nv_bfloat16* w = nullptr;
  float *x = nullptr, *y = nullptr;
  TRY(cudaMalloc(&w, total * sizeof(__nv_bfloat16)));
  TRY(cudaMalloc(&x, x0.size() * sizeof(float)));
  TRY(cudaMalloc(&y, out * sizeof(float)));
  // on the timed stream: a non-blocking stream does not wait for the legacy stream's copies
  TRY(cudaMemcpyAsync(w, wh.bf16.data(), total * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice, stream));
  TRY(cudaMemcpyAsync(x, x0.data(), x0.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
  TRY(cudaMemsetAsync(y, 0xFF, out * sizeof(float), stream));  // NaN until the chain writes it
  cluster_gemv::Chain c{};
  size_t off = 0;
  for (size_t i = 0; i < st.size(); ++i) {
    c.stage[i] = st[i];
    c.stage[i].w = w + off;
    off += cluster_gemv::weight_count(st[i]);
  }
  c.stages = static_cast<int>(st.size());
  c.x = x;
  c.y = y;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TRY(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const cudaError_t launched = cluster_gemv::run(c, programs, stream);
  TRY(cudaStreamEndCapture(stream, &graph));
  TRY(launched);
  TRY(cudaGraphInstantiate(&exec, graph, 0));
  TRY(cudaGraphLaunch(exec, stream));
  TRY(cudaStreamSynchronize(stream));
  std::vector<float> got(out);
  TRY(cudaMemcpy(got.data(), y, out * sizeof(float), cudaMemcpyDeviceToHost));
  *ok = matches(gemv_reference(st, wh.f32, x0), got);
  return time_graph(graph, exec, 10, replays, repeats, stream, us, {w, x, y});
}

// How many copies of a launch's `bytes` of inputs its timing rotates through: together >= 3x the L2, so that the
// launches read DRAM, at least 2 and at most 64 (as benchmarks/timer.py rotates its input sets).
int rotation_copies(size_t bytes, size_t l2_bytes) {
  return static_cast<int>(std::min<size_t>(64, std::max<size_t>(2, (3 * l2_bytes + bytes - 1) / bytes)));
}

// µs a launch of `copies` back-to-back launches captured in one graph, launch(c) enqueuing the one over copy c of
// its inputs; `buffers` freed after.
std::string time_rotated(int copies, const std::function<cudaError_t(int)>& launch, int replays, int repeats,
                         cudaStream_t stream, double* us, std::initializer_list<void*> buffers) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  TRY(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  cudaError_t launched = cudaSuccess;
  for (int c = 0; c < copies && launched == cudaSuccess; ++c) launched = launch(c);
  TRY(cudaStreamEndCapture(stream, &graph));
  TRY(launched);
  TRY(cudaGraphInstantiate(&exec, graph, 0));
  const std::string timed = time_graph(graph, exec, 3, replays, repeats, stream, us, buffers);
  *us /= copies;
  return timed;
}

// One wide GEMV (a stage of n, k and norm: a drafter's glue GEMV at one token, as bench_stage_boundary.py writes
// them) on `programs`: µs a launch, rotating through `copies` copies of the weights (rotation_copies,
// time_rotated), and whether the first launch matches the host's float64 GEMV (relative 1e-3 of the largest
// entry).
std::string time_wide(const cluster_gemv::Stage& shape, int programs, size_t l2_bytes, int replays, int repeats,
                      cudaStream_t stream, double* us, int* copies, bool* ok) {
  const size_t count = static_cast<size_t>(shape.n) * shape.k, bytes = count * sizeof(__nv_bfloat16);
  *copies = rotation_copies(bytes, l2_bytes);
  const HostWeights wh = host_weights(count);
  const std::vector<float> x0 = host_input(shape.k);
  __nv_bfloat16* w = nullptr;
  float *x = nullptr, *y = nullptr;
  TRY(cudaMalloc(&w, bytes * static_cast<size_t>(*copies)));
  TRY(cudaMalloc(&x, x0.size() * sizeof(float)));
  TRY(cudaMalloc(&y, static_cast<size_t>(shape.n) * sizeof(float)));
  // on the timed stream: a non-blocking stream does not wait for the legacy stream's copies and memsets
  TRY(cudaMemcpyAsync(w, wh.bf16.data(), bytes, cudaMemcpyHostToDevice, stream));
  for (int c = 1; c < *copies; ++c)
    TRY(cudaMemcpyAsync(w + c * count, w, bytes, cudaMemcpyDeviceToDevice, stream));
  TRY(cudaMemcpyAsync(x, x0.data(), x0.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
  TRY(cudaMemsetAsync(y, 0xFF, static_cast<size_t>(shape.n) * sizeof(float), stream));  // NaN until written
  stream_gemv::Gemv g{w, x, y, shape.n, shape.k, shape.norm};
  TRY(stream_gemv::run(g, programs, stream));  // the first launch, checked
  TRY(cudaStreamSynchronize(stream));
  std::vector<float> got(static_cast<size_t>(shape.n));
  TRY(cudaMemcpy(got.data(), y, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  // the chain's reference of one GEMV stage (normed as the glue norms)
  *ok = matches(gemv_reference({shape}, wh.f32, x0), got);
  return time_rotated(*copies, [&](int c) {
           g.w = w + c * count;
           return stream_gemv::run(g, programs, stream);
         }, replays, repeats, stream, us, {w, x, y});
}

// The float64 attention of `heads` query heads of `dim` on each of `kv_heads` key-value heads over `ctx` keys (the
// cache `kv`, keys then values, [pages, kPage, kv_heads, dim] each, the request's pages in `perm`'s order), the
// key-value heads' outputs one after another. Computed once per layer (0.13-0.27 G multiply-adds at E2B's 32K and
// 31B's full layer, half of them strided) and kept for the layer's other rows, both kernels and every program
// count: their inputs are the same (host_weights, host_input and the seeded shuffle are functions of the shape).
const std::vector<double>& attention_want(int heads, int dim, int kv_heads, int ctx, const std::vector<float>& kv,
                                          const std::vector<float>& q0, const std::vector<int32_t>& perm) {
  static std::map<std::array<int, 4>, std::vector<double>> done;
  std::vector<double>& want = done[{heads, dim, kv_heads, ctx}];
  if (!want.empty()) return want;
  const size_t row = static_cast<size_t>(kv_heads) * dim, page_elems = stream_attention::kPage * row;
  const size_t count = static_cast<size_t>(ctx) * row, head_elems = static_cast<size_t>(ctx) * dim;
  const size_t q_elems = static_cast<size_t>(heads) * dim;
  std::vector<float> logical(2 * head_elems);  // one key-value head's keys then values in the request's order
  for (int h = 0; h < kv_heads; ++h) {
    for (int half = 0; half < 2; ++half)
      for (int i = 0; i < ctx; ++i)
        std::copy_n(kv.begin() + half * count + static_cast<size_t>(perm[i / stream_attention::kPage]) * page_elems +
                        static_cast<size_t>(i % stream_attention::kPage) * row + static_cast<size_t>(h) * dim,
                    dim, logical.begin() + half * head_elems + static_cast<size_t>(i) * dim);
    const cluster_gemv::Stage shape{nullptr, heads * dim, dim, 0, 0, ctx};
    const std::vector<double> out = attention_reference(
        shape, logical.data(), std::vector<double>(q0.begin() + h * q_elems, q0.begin() + (h + 1) * q_elems));
    want.insert(want.end(), out.begin(), out.end());
  }
  return want;
}

// Layer L's attention at B = 1 over `ctx` keys of each of `kv_heads` key-value heads on `programs`, on the CUDA
// cores or (kMma) tensor cores (stream_attention.cuh): µs a launch, rotating through `copies` copies of the cache
// (rotation_copies, time_rotated), the pages of each copy in a shuffled order (a request's pages are scattered in
// a cache), and whether the first launch matches the host's float64 attention (relative 1e-3 of the largest
// entry).
template <class L, bool kMma>
std::string time_attention(int kv_heads, int ctx, int programs, size_t l2_bytes, int replays, int repeats,
                           cudaStream_t stream, double* us, int* copies, bool* ok) {
  namespace sa = stream_attention;
  const int pages = ctx / sa::kPage;
  const size_t row = static_cast<size_t>(kv_heads) * L::kDim;  // a key's (or value's) row of every head
  const size_t page_elems = sa::kPage * row, count = pages * page_elems;
  const size_t bytes = 2 * count * sizeof(__nv_bfloat16);  // keys and values of one copy
  *copies = rotation_copies(bytes, l2_bytes);
  const HostWeights kv = host_weights(2 * count);  // keys, then values, in the cache's (physical) page order
  const std::vector<float> q0 = host_input(kv_heads * L::kHeads * L::kDim);
  std::vector<int32_t> perm(static_cast<size_t>(pages));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(12345));
  std::vector<int32_t> tables(static_cast<size_t>(*copies) * pages);  // copy c's pages follow copy c - 1's
  for (int c = 0; c < *copies; ++c)
    for (int i = 0; i < pages; ++i) tables[static_cast<size_t>(c) * pages + i] = c * pages + perm[i];
  __nv_bfloat16 *k = nullptr, *v = nullptr;
  float *q = nullptr, *out = nullptr, *workspace = nullptr;
  int32_t *table = nullptr, *counters = nullptr;
  const size_t n_counters = static_cast<size_t>(kv_heads) * sa::kCluster;
  TRY(cudaMalloc(&k, bytes / 2 * *copies));
  TRY(cudaMalloc(&v, bytes / 2 * *copies));
  TRY(cudaMalloc(&q, q0.size() * sizeof(float)));
  TRY(cudaMalloc(&out, q0.size() * sizeof(float)));
  TRY(cudaMalloc(&workspace, static_cast<size_t>(programs) * L::kSlot * sizeof(float)));
  TRY(cudaMalloc(&table, tables.size() * sizeof(int32_t)));
  TRY(cudaMalloc(&counters, n_counters * sizeof(int32_t)));
  // on the timed stream: a non-blocking stream does not wait for the legacy stream's copies and memsets
  TRY(cudaMemcpyAsync(k, kv.bf16.data(), bytes / 2, cudaMemcpyHostToDevice, stream));
  TRY(cudaMemcpyAsync(v, kv.bf16.data() + count, bytes / 2, cudaMemcpyHostToDevice, stream));
  for (int c = 1; c < *copies; ++c) {
    TRY(cudaMemcpyAsync(k + c * count, k, bytes / 2, cudaMemcpyDeviceToDevice, stream));
    TRY(cudaMemcpyAsync(v + c * count, v, bytes / 2, cudaMemcpyDeviceToDevice, stream));
  }
  TRY(cudaMemcpyAsync(q, q0.data(), q0.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
  TRY(cudaMemcpyAsync(table, tables.data(), tables.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
  TRY(cudaMemsetAsync(counters, 0, n_counters * sizeof(int32_t), stream));
  TRY(cudaMemsetAsync(out, 0xFF, q0.size() * sizeof(float), stream));  // NaN until written
  sa::Attention a{q, k, v, table, ctx, kv_heads, out, workspace, counters};
  TRY((sa::run<L, kMma>(a, programs, stream)));  // the first launch, checked
  TRY(cudaStreamSynchronize(stream));
  std::vector<float> got(q0.size());
  TRY(cudaMemcpy(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  const std::vector<double>& want = attention_want(L::kHeads, L::kDim, kv_heads, ctx, kv.f32, q0, perm);
  *ok = true;
  const size_t q_elems = static_cast<size_t>(L::kHeads) * L::kDim;
  for (int h = 0; h < kv_heads; ++h)  // each key-value head's outputs within 1e-3 of its own largest
    *ok = matches(std::vector<double>(want.begin() + h * q_elems, want.begin() + (h + 1) * q_elems),
                  std::vector<float>(got.begin() + h * q_elems, got.begin() + (h + 1) * q_elems)) && *ok;
  return time_rotated(*copies, [&](int c) {
           a.block_table = table + static_cast<size_t>(c) * pages;
           return sa::run<L, kMma>(a, programs, stream);
         }, replays, repeats, stream, us, {k, v, q, out, workspace, table, counters});
}

// Closes a result row with what failed ("error", quotes made JSON-safe); false when nothing did.
bool print_error(std::string error) {
  if (error.empty()) return false;
  std::replace(error.begin(), error.end(), '"', '\'');
  std::printf(", \"error\": \"%s\"}", error.c_str());
  return true;
}

// Closes a row whose opening is printed: "skipped" and why (skip), or what its timing returned: an error, or its
// result ("copies" where the timing rotates copies of its inputs, "ok", "us"). False when it failed.
bool close_row(const char* skip, const std::function<std::string(double* us, int* copies, bool* ok)>& time) {
  if (skip != nullptr) {
    std::printf(", \"skipped\": \"%s\"}", skip);
    return true;
  }
  double us = 0;
  int copies = 0;
  bool ok = false;
  if (print_error(time(&us, &copies, &ok))) return false;
  if (copies > 0) std::printf(", \"copies\": %d", copies);
  std::printf(", \"ok\": %s, \"us\": %.3f}", ok ? "true" : "false", us);
  std::fflush(stdout);
  return ok;
}

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t comma = s.find(',', pos);
    out.push_back(std::atoi(s.substr(pos, comma - pos).c_str()));
    pos = comma == std::string::npos ? s.size() : comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> programs_list = {1, 8, 32, 66, 132, 264}, cluster_list = {2, 4, 8, 16};
  std::vector<int> stream_list = {1, 8, 16, 132}, wide_list = {128};
  std::vector<int> attention_list = {128};
  int n = 2048, stages = 32, replays = 40, repeats = 7;
  // the layers and GEMVs of the "gemv" and "wide_gemv" rows: none unless given (bench_stage_boundary.py writes
  // them from the drafters' shapes)
  cluster_gemv::Chain sliding_layer{}, full_layer{}, step{}, wide{};
  std::vector<std::vector<int>> attention;  // heads, dim, kv_heads, ctx of each "attention" row's layer
  auto chain_arg = [](const std::string& key, const std::string& value, cluster_gemv::Chain* c) {
    *c = cluster_gemv::Chain{};
    if (cluster_gemv::append_stages(value, c)) return true;
    std::fprintf(stderr, "%s=%s: expected n:k:norm:glu[:window],... (at most %d)\n", key.c_str(), value.c_str(),
                 cluster_gemv::kMaxStages);
    return false;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    const std::string key = arg.substr(0, eq), value = eq == std::string::npos ? "" : arg.substr(eq + 1);
    if (key == "programs") programs_list = parse_list(value);
    else if (key == "cluster_programs") cluster_list = parse_list(value);
    else if (key == "stream_programs") stream_list = parse_list(value);
    else if (key == "wide_programs") wide_list = parse_list(value);
    else if (key == "attention") {
      attention.clear();
      for (size_t pos = 0; pos < value.size();) {
        const size_t comma = std::min(value.find(',', pos), value.size());
        std::string item = value.substr(pos, comma - pos);
        std::replace(item.begin(), item.end(), ':', ',');
        attention.push_back(parse_list(item));
        pos = comma + 1;
        if (attention.back().size() != 4) {
          std::fprintf(stderr, "attention=%s: expected heads:dim:kv_heads:ctx,...\n", value.c_str());
          return 2;
        }
      }
    }
    else if (key == "attention_programs") attention_list = parse_list(value);
    else if (key == "n") n = std::atoi(value.c_str());
    else if (key == "stages") stages = std::atoi(value.c_str());
    else if (key == "replays") replays = std::atoi(value.c_str());
    else if (key == "repeats") repeats = std::atoi(value.c_str());
    else if (key == "sliding_layer" || key == "full_layer" || key == "step" || key == "wide") {
      cluster_gemv::Chain* c = key == "wide"         ? &wide
                               : key == "step"       ? &step
                               : key == "full_layer" ? &full_layer
                                                     : &sliding_layer;
      if (!chain_arg(key, value, c)) return 2;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  if (n < 4 || n % 4 != 0 || stages < 2 || replays < 1 || repeats < 1) {
    std::fprintf(stderr, "n must be a positive multiple of 4, stages >= 2, replays and repeats >= 1\n");
    return 2;
  }
  int dev = 0, sms = 0, major = 0, minor = 0, resident = 0;
  CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  for (auto kernel : {stage_boundary::chain_kernel<gemma4_mtp::Arrival::kRelease>,
                      stage_boundary::chain_kernel<gemma4_mtp::Arrival::kFence>}) {  // programs per SM of both
    int per_sm = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, stage_boundary::kThreads, stage_boundary::kSmem));
    resident = resident == 0 ? per_sm : std::min(resident, per_sm);
  }
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Chain c{};
  const size_t bytes = static_cast<size_t>(n) * sizeof(uint32_t);
  CHECK(cudaMalloc(&c.vec[0], bytes));
  CHECK(cudaMalloc(&c.vec[1], bytes));
  CHECK(cudaMalloc(&c.counter, sizeof(int32_t)));
  CHECK(cudaMemsetAsync(c.counter, 0, sizeof(int32_t), stream));  // the chains run on `stream`
  c.n = n;

  std::printf("{\"device\": \"%s\", \"sms\": %d, \"cc\": \"%d.%d\", \"n\": %d, \"stages\": %d, \"replays\": %d, "
              "\"repeats\": %d, \"results\": [",
              prop.name, sms, major, minor, n, stages, replays, repeats);
  const struct {
    Mode mode;
    const char* name;
  } modes[] = {{Mode::kLaunch, "launch"}, {Mode::kPdl, "pdl"}, {Mode::kBarrier, "barrier"},
               {Mode::kBarrierFence, "barrier_fence"}, {Mode::kCluster, "cluster"},
               {Mode::kClusterShared, "cluster_shared"}, {Mode::kClusterPush, "cluster_push"}};
  bool first = true, all_ok = true;
  for (const auto& m : modes) {
    const bool cluster = m.mode == Mode::kCluster || m.mode == Mode::kClusterShared || m.mode == Mode::kClusterPush;
    for (int programs : cluster ? cluster_list : programs_list) {
      std::printf("%s\n  {\"mode\": \"%s\", \"programs\": %d", first ? "" : ",", m.name, programs);
      first = false;
      const char* skip = nullptr;
      if (programs < 1) skip = "programs must be >= 1";
      else if (cluster) skip = cluster_skip(m.mode, programs, n, major);
      else if (m.mode == Mode::kPdl && major < 9) skip = "programmatic dependent launch needs sm_90";
      else if ((m.mode == Mode::kBarrier || m.mode == Mode::kBarrierFence) && programs > resident * sms)
        skip = "not resident at once";
      if (skip != nullptr) {
        std::printf(", \"skipped\": \"%s\"}", skip);
        continue;
      }
      Timing one, many;
      c.stages = 1;
      std::string error = time_chain(m.mode, c, programs, replays, repeats, stream, &one);
      c.stages = stages;
      if (error.empty()) error = time_chain(m.mode, c, programs, replays, repeats, stream, &many);
      if (print_error(error)) {
        all_ok = false;
        continue;
      }
      const bool ok = one.ok && many.ok;
      all_ok = all_ok && ok;
      std::printf(", \"ok\": %s, \"graph\": %s, \"us_one_stage\": %.3f, \"us_all_stages\": %.3f, "
                  "\"us_per_stage\": %.3f}",
                  ok ? "true" : "false", one.graph && many.graph ? "true" : "false", one.median_us, many.median_us,
                  (many.median_us - one.median_us) / (stages - 1));
      std::fflush(stdout);
    }
  }
  std::printf("\n], \"stream\": [");
  first = true;
  // per program: L2, 256 KiB (all of them L2-resident at once); DRAM, at least 8 MiB and 128 MiB in all (more
  // than L2 holds: each pass misses)
  const struct {
    const char* source;
    size_t min_bytes, min_total;
    int lo, hi;
  } sources[] = {{"l2", 256u << 10, 0, 1, 9}, {"dram", 8u << 20, 128u << 20, 1, 3}};
  uint32_t* sums = nullptr;
  CHECK(cudaMalloc(&sums, sizeof(uint32_t) * 1024));
  for (const auto& src : sources) {
    for (int programs : stream_list) {
      const size_t share = programs < 1 ? 0 : src.min_total / static_cast<size_t>(programs);
      const size_t bytes = programs < 1 ? 0 : std::max(src.min_bytes, share) / 16 * 16;
      std::printf("%s\n  {\"source\": \"%s\", \"programs\": %d, \"bytes_per_program\": %zu", first ? "" : ",",
                  src.source, programs, bytes);
      first = false;
      if (programs < 1 || programs > 1024) {
        std::printf(", \"skipped\": \"programs must be 1 to 1024\"}");
        continue;
      }
      const size_t words = bytes / sizeof(uint32_t);
      std::vector<uint32_t> host(words * static_cast<size_t>(programs));
      for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint32_t>(i * 2654435761u);
      std::vector<uint32_t> slice_sums(static_cast<size_t>(programs), 0u);
      for (size_t i = 0; i < host.size(); ++i) slice_sums[i / words] += host[i];
      void* buf = nullptr;
      CHECK(cudaMalloc(&buf, host.size() * sizeof(uint32_t)));
      CHECK(cudaMemcpyAsync(buf, host.data(), host.size() * sizeof(uint32_t), cudaMemcpyHostToDevice, stream));
      double us = 0;
      bool ok = false;
      std::string error = time_stream(static_cast<const uint4*>(buf), slice_sums, static_cast<int>(bytes / 16),
                                      programs, src.lo, src.hi, std::max(2, replays / 4), repeats, sums, stream, &us,
                                      &ok);
      CHECK(cudaFree(buf));
      if (print_error(error)) {
        all_ok = false;
        continue;
      }
      all_ok = all_ok && ok;
      const double gbps = us > 0 ? static_cast<double>(bytes) / (us * 1e3) : 0.0;
      std::printf(", \"ok\": %s, \"us_per_pass\": %.3f, \"gb_per_s_per_program\": %.1f, \"tb_per_s\": %.3f}",
                  ok ? "true" : "false", us, gbps, gbps * programs / 1e3);
      std::fflush(stdout);
    }
  }
  CHECK(cudaFree(sums));
  // E2B's layers in one cluster: the full layer's GEMVs (its attention is the whole GPU's), whole sliding layers,
  // 1 and 4 of each (the slope is a layer without the launch), then the step's stages in order in one chain
  std::printf("\n], \"gemv\": [");
  first = true;
  struct GemvRow {
    const char* layer;
    int layers;  // of a layer repeated; 0 for the step, a chain of its own
    std::vector<cluster_gemv::Stage> stages;
  };
  std::vector<GemvRow> gemv_rows;
  for (const auto& [kind, l] : {std::make_pair("full", &full_layer), std::make_pair("sliding", &sliding_layer)})
    for (int layers : {1, 4}) {
      GemvRow row{kind, layers, {}};
      for (int r = 0; r < layers; ++r) row.stages.insert(row.stages.end(), l->stage, l->stage + l->stages);
      if (!row.stages.empty()) gemv_rows.push_back(row);
    }
  if (step.stages > 0) gemv_rows.push_back({"step", 0, {step.stage, step.stage + step.stages}});
  for (const GemvRow& row : gemv_rows) {
    size_t bytes = 0;
    for (const auto& st : row.stages) bytes += cluster_gemv::weight_count(st) * sizeof(__nv_bfloat16);
    for (int programs : cluster_list) {
      std::printf("%s\n  {\"layer\": \"%s\", \"programs\": %d", first ? "" : ",", row.layer, programs);
      if (row.layers > 0) std::printf(", \"layers\": %d", row.layers);
      std::printf(", \"stages\": %zu, \"bytes\": %zu", row.stages.size(), bytes);
      first = false;
      cluster_gemv::Chain shape{};
      const bool fits = row.stages.size() <= static_cast<size_t>(cluster_gemv::kMaxStages);
      for (size_t i = 0; fits && i < row.stages.size(); ++i) shape.stage[i] = row.stages[i];
      shape.stages = static_cast<int>(row.stages.size());
      const char* skip =
          !fits || !cluster_gemv::valid(shape, programs)
              ? "the stages do not split over this many programs (or exceed the chain's stages)"
              : cluster_unfit(reinterpret_cast<const void*>(cluster_gemv::chain_kernel), programs,
                              cluster_gemv::kThreads, cluster_gemv::smem_bytes(shape, programs), major);
      all_ok = close_row(skip, [&](double* us, int*, bool* ok) {
                 return time_gemv(row.stages, programs, replays, repeats, stream, us, ok);
               }) && all_ok;
    }
  }
  // the drafters' glue GEMVs, each on every SM (one program an SM) from a ring of bulk copies
  int l2 = 0;
  CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  std::printf("\n], \"wide_gemv\": [");
  first = true;
  for (int i = 0; i < wide.stages; ++i) {
    const cluster_gemv::Stage& shape = wide.stage[i];
    for (int programs : wide_list) {
      std::printf("%s\n  {\"n\": %d, \"k\": %d, \"norm\": %d, \"programs\": %d, \"bytes\": %zu", first ? "" : ",",
                  shape.n, shape.k, shape.norm, programs,
                  static_cast<size_t>(shape.n) * shape.k * sizeof(__nv_bfloat16));
      first = false;
      const stream_gemv::Gemv g{nullptr, nullptr, nullptr, shape.n, shape.k, shape.norm};
      const char* skip = shape.glu || shape.window                ? "a GEMV has no glu or window"
                         : major < 9                              ? "needs sm_90 (bulk copies)"
                         : !stream_gemv::valid(g, programs)        ? "the shape does not split over this many programs"
                         : stream_gemv::smem_bytes(g, programs) > static_cast<size_t>(prop.sharedMemPerBlockOptin)
                             ? "its shared memory exceeds the device's"
                             : nullptr;
      all_ok = close_row(skip, [&](double* us, int* copies, bool* ok) {
                 return time_wide(shape, programs, static_cast<size_t>(l2), replays, repeats, stream, us, copies, ok);
               }) && all_ok;
    }
  }
  // the drafters' attention at B = 1 on every SM, merged in clusters
  std::printf("\n], \"attention\": [");
  first = true;
  for (const std::vector<int>& layer : attention) {
    const int heads = layer[0], dim = layer[1], kv_heads = layer[2], ctx = layer[3];
    for (const bool mma : {false, true}) {
      for (int programs : attention_list) {
        std::printf("%s\n  {\"heads\": %d, \"dim\": %d, \"kv_heads\": %d, \"ctx\": %d, \"kernel\": \"%s\", "
                    "\"programs\": %d, \"bytes\": %zu", first ? "" : ",", heads, dim, kv_heads, ctx,
                    mma ? "mma" : "scalar", programs, static_cast<size_t>(ctx) * kv_heads * 2 * dim * 2);
        first = false;
        const stream_attention::Attention shape{nullptr, nullptr, nullptr, nullptr, ctx, kv_heads,
                                                nullptr, nullptr, nullptr};
        auto row = [&](auto layer, auto path) {
          using L = decltype(layer);
          constexpr bool kMma = decltype(path)::value;
          const char* skip =
              !stream_attention::valid(shape, programs)
                  ? "the keys do not split into whole pages over whole clusters of each key-value head's programs"
                  : cluster_unfit(reinterpret_cast<const void*>(stream_attention::attention_kernel<L, kMma>), programs,
                                  stream_attention::kThreads, stream_attention::smem_bytes<L, kMma>(), major,
                                  stream_attention::kCluster);
          all_ok = close_row(skip, [&](double* us, int* copies, bool* ok) {
                     return time_attention<L, kMma>(kv_heads, ctx, programs, static_cast<size_t>(l2), replays, repeats,
                                                    stream, us, copies, ok);
                   }) && all_ok;
        };
        const bool known = stream_attention::with_layer(heads, dim, [&](auto layer) {
          if (mma) row(layer, std::true_type{});
          else row(layer, std::false_type{});
        });
        if (!known) all_ok = close_row("no layer of stream_attention.cuh has this many heads of this dimension",
                                       nullptr) && all_ok;
      }
    }
  }
  std::printf("\n]}\n");
  return all_ok ? 0 : 1;
}
