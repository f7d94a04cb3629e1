// Runs benchmarks/cuda/stage_boundary.cuh (the chains whose stage boundaries bench_stage_boundary.py
// times on a GPU) on the CUDA emulator (emu.h): one run of a chain from DIR/start.bin, the result (the
// vector the last stage wrote) to DIR/result.bin, the other vector poisoned. Prints one line "OK ..." or
// "FAIL ..." (exit 1).
//
//   dir=PATH mode=launch|pdl|barrier|barrier_fence programs= n= stages= sms= major= counter= (the barrier's at launch)
//   schedule=rr|ahead|behind (emu::Schedule: ahead / behind run each program as far as it goes)
// The launcher must make `stages` launches (launch, pdl: with programmatic dependent launch exactly for
// pdl) or one cooperative launch (barrier, barrier_fence), all of them succeeding.
#include <cstdio>
#include <string>
#include <vector>

#include "emu.h"
#include "io.h"
#include "stage_boundary.cuh"

using namespace emu_io;

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  const std::string dir = a.str("dir"), mode_name = a.str("mode");
  const int programs = static_cast<int>(a.num("programs", 1)), n = static_cast<int>(a.num("n", 4));
  const int stages = static_cast<int>(a.num("stages", 1));
  use_device(kH100SmemOptin, static_cast<int>(a.num("major", 9)), static_cast<int>(a.num("sms", 8)),
             a.str("schedule", "rr"));
  const stage_boundary::Mode mode = mode_name == "pdl"             ? stage_boundary::Mode::kPdl
                                    : mode_name == "barrier"       ? stage_boundary::Mode::kBarrier
                                    : mode_name == "barrier_fence" ? stage_boundary::Mode::kBarrierFence
                                                                   : stage_boundary::Mode::kLaunch;
  Buffer vec[2] = {load(dir, "start", 1, n, n, 4), strided(1, n, n, 4)};
  std::vector<int32_t> counter = {static_cast<int32_t>(a.num("counter", 0))};  // grid_barrier: low 31 bits zero
  stage_boundary::Chain c{};
  c.vec[0] = static_cast<uint32_t*>(vec[0].data());
  c.vec[1] = static_cast<uint32_t*>(vec[1].data());
  c.n = n;
  c.stages = stages;
  c.counter = counter.data();
  const cudaError_t err = stage_boundary::run(mode, c, programs, nullptr);
  const bool barrier = mode == stage_boundary::Mode::kBarrier || mode == stage_boundary::Mode::kBarrierFence;
  if (!launched_as_expected(err, barrier ? 1 : static_cast<size_t>(stages), mode == stage_boundary::Mode::kPdl, {}))
    return 1;
  if ((counter[0] & 0x7FFFFFFF) != 0) {  // what the next launch's barriers need
    std::printf("FAIL the barrier left its counter at %d\n", counter[0]);
    return 1;
  }
  store(dir, "result", vec[stages & 1]);
  std::printf("OK launches=%zu counter=%d\n", emu::launch_log().size(), counter[0]);
  return finish(a, 0);
}
