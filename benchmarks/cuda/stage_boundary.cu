// The GPU side of benchmarks/bench_stage_boundary.py (which builds and runs it): times the chains of
// stage_boundary.cuh in CUDA graphs and prints one JSON object.
//
//   stage_boundary [programs=1,8,32,66,132,264] [n=2048] [stages=32] [replays=40] [repeats=7]
//
// For each mode and program count: the chain with 1 stage and with `stages` stages, each captured in a
// graph and replayed `replays` times between two events, `repeats` times; us_per_stage is the slope
// (median(t_stages) - median(t_1)) / (stages - 1), the cost of one more dependent stage with the graph's
// own launch taken out. Each graph's first replay is checked against the chain computed on the host.
// A mode that cannot run a program count (PDL before sm_90, a cooperative grid that is not resident at
// once) is reported with "skipped" and the reason; a chain that stream capture refuses is timed as
// stream launches ("graph": false); a CUDA error is reported for its configuration ("error"), and the
// exit status is then 1, as for a wrong result.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

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
  cudaEvent_t a, b;
  TRY(cudaEventCreate(&a));
  TRY(cudaEventCreate(&b));
  std::vector<double> us;
  for (int r = 0; r < repeats; ++r) {
    TRY(cudaEventRecord(a, stream));
    for (int i = 0; i < replays; ++i) TRY(replay());
    TRY(cudaEventRecord(b, stream));
    TRY(cudaEventSynchronize(b));
    float ms = 0;
    TRY(cudaEventElapsedTime(&ms, a, b));
    us.push_back(1000.0 * ms / replays);
  }
  std::sort(us.begin(), us.end());
  t->median_us = us[us.size() / 2];
  TRY(cudaEventDestroy(a));
  TRY(cudaEventDestroy(b));
  if (exec != nullptr) TRY(cudaGraphExecDestroy(exec));
  if (graph != nullptr) TRY(cudaGraphDestroy(graph));
  return "";
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
  std::vector<int> programs_list = {1, 8, 32, 66, 132, 264};
  int n = 2048, stages = 32, replays = 40, repeats = 7;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const size_t eq = arg.find('=');
    const std::string key = arg.substr(0, eq), value = eq == std::string::npos ? "" : arg.substr(eq + 1);
    if (key == "programs") programs_list = parse_list(value);
    else if (key == "n") n = std::atoi(value.c_str());
    else if (key == "stages") stages = std::atoi(value.c_str());
    else if (key == "replays") replays = std::atoi(value.c_str());
    else if (key == "repeats") repeats = std::atoi(value.c_str());
    else {
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
  CHECK(cudaMemset(c.counter, 0, sizeof(int32_t)));
  c.n = n;

  std::printf("{\"device\": \"%s\", \"sms\": %d, \"cc\": \"%d.%d\", \"n\": %d, \"stages\": %d, \"replays\": %d, "
              "\"repeats\": %d, \"results\": [",
              prop.name, sms, major, minor, n, stages, replays, repeats);
  const struct {
    Mode mode;
    const char* name;
  } modes[] = {{Mode::kLaunch, "launch"}, {Mode::kPdl, "pdl"}, {Mode::kBarrier, "barrier"},
               {Mode::kBarrierFence, "barrier_fence"}};
  bool first = true, all_ok = true;
  for (const auto& m : modes) {
    for (int programs : programs_list) {
      std::printf("%s\n  {\"mode\": \"%s\", \"programs\": %d", first ? "" : ",", m.name, programs);
      first = false;
      const char* skip = nullptr;
      if (programs < 1) skip = "programs must be >= 1";
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
      if (!error.empty()) {
        std::replace(error.begin(), error.end(), '"', '\'');
        std::printf(", \"error\": \"%s\"}", error.c_str());
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
  std::printf("\n]}\n");
  return all_ok ? 0 : 1;
}
