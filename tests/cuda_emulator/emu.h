// A CPU emulation of the CUDA features the attention kernels use, so that the kernels' own source
// (csrc/include/gemma4_mtp/q_only_attention.cuh) runs on a machine without a GPU, under AddressSanitizer.
//
// Threads of a block are fibers scheduled round robin on one OS thread (switched without a system call, see Context,
// annotated for AddressSanitizer); they switch only in barriers and warp-collective operations, each of which waits for
// all participants. The warp-level instructions (shuffles, ldmatrix, mma.m16n8k16) follow the PTX ISA's definitions of
// their operand fragments; cp.async groups and bulk copies complete either at issue ("early") or as late as the
// program's waits allow ("late"), which exposes missing waits. Global memory is host memory: a read outside an
// allocation is an AddressSanitizer error. Data one block reads of another's (__ldcg) must still hold what it read when
// the launch ends (check_published_reads): a block that reads other blocks' partials before its election, run before
// them, fails. What this cannot show: timing, memory-model races between warps that real hardware would reorder, bank
// conflicts, or a misreading of the PTX fragment layouts shared by this file and the kernel.
#pragma once

#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
// The running launch's shape (threads along x only), set by cudaLaunchKernelEx.
inline dim3 gridDim, blockDim;

// Aligned as CUDA aligns them: a kernel dereferencing one at an address that is not a multiple of its size
// faults on the GPU ("misaligned address"), and here under -fsanitize=alignment (tests/emulated.py).
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

// 16-bit float types as the kernels see them: storage only, converted by the common.cuh shim.
struct __nv_bfloat16 {
  uint16_t bits;
};
struct __half {
  uint16_t bits;
};

// ---- CUDA runtime subset ----
typedef int cudaError_t;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorInvalidValue = 1;
constexpr cudaError_t cudaErrorInvalidConfiguration = 9;
constexpr cudaError_t cudaErrorMisalignedAddress = 716;
constexpr cudaError_t cudaErrorCooperativeLaunchTooLarge = 720;
typedef void* cudaStream_t;
enum cudaDeviceAttr {
  cudaDevAttrMaxSharedMemoryPerBlockOptin,
  cudaDevAttrComputeCapabilityMajor,
  cudaDevAttrMultiProcessorCount
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize, cudaFuncAttributeNonPortableClusterSizeAllowed };
enum cudaLaunchAttributeID {
  cudaLaunchAttributeProgrammaticStreamSerialization,
  cudaLaunchAttributeCooperative,
  cudaLaunchAttributeClusterDimension
};
struct cudaLaunchAttributeValue {
  int programmaticStreamSerializationAllowed;
  int cooperative;
  struct {
    unsigned x, y, z;
  } clusterDim;
};
struct cudaLaunchAttribute {
  cudaLaunchAttributeID id;
  cudaLaunchAttributeValue val;
};
struct cudaLaunchConfig_t {
  dim3 gridDim, blockDim;
  size_t dynamicSmemBytes;
  cudaStream_t stream;
  cudaLaunchAttribute* attrs;
  unsigned numAttrs;
};

namespace emu {

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "emulator: %s\n", what);
  std::abort();
}

struct Device {
  int smem_optin;
  int major;
  int sms = 132;
};
inline std::vector<Device>& devices() {
  static std::vector<Device> d;
  return d;
}
inline int& current_device() {
  static int d = 0;
  return d;
}
inline bool& late_copies() {  // complete copies as late as the waits allow (else at issue)
  static bool late = true;
  return late;
}
// Scheduling: round robin (all warps advance in step; a launch's blocks in index order, a cooperative
// launch's in turn), or one warp at a time as far as it can go before any other runs, lowest warp first
// or highest first (a warp racing ahead of the others exposes shared memory it rewrites before they have
// read it; under kWarpAhead the thread whose arrival releases a block or cluster barrier resumes only in
// the next round, after the lower warps: see wait); then a cooperative or cluster launch's blocks, too,
// each run as far as it can before the next (a block racing ahead exposes a missing grid barrier), and
// with kWarpBehind every launch's blocks run from the highest index down (the last block to arrive at a
// counter is not the last one by index).
enum class Schedule { kRoundRobin, kWarpAhead, kWarpBehind };
inline Schedule& schedule() {
  static Schedule s = Schedule::kRoundRobin;
  return s;
}
// A cluster launch's clusters run in index order (reversed under kWarpBehind), or with this set the
// even-indexed ones first and then the odd ones: clusters that must count on counters of their own (a key-value
// head's) then arrive mixed with others, as they may on a GPU, and a counter they wrongly share is seen.
inline bool& clusters_evens_first() {
  static bool on = false;
  return on;
}
struct LaunchRecord {
  dim3 grid, block;
  size_t smem;
  bool pdl;
};
inline std::vector<LaunchRecord>& launch_log() {
  static std::vector<LaunchRecord> log;
  return log;
}

// Loads of data other blocks of the launch write (__ldcg: the kernels read such data only once the
// election or grid barrier that completes it has passed), with the bytes each returned. At the end of
// the launch each must still find those bytes: a value rewritten after it was read was read too early,
// by a block that merges without being elected or reads before the barrier. Blocks run one after
// another, so such a block reads the partials of the blocks still to come.
struct PublishedRead {
  const void* addr;
  unsigned bytes;
  unsigned char value[16];
  unsigned block[3];
};
inline std::vector<PublishedRead>& published_reads() {
  static std::vector<PublishedRead> reads;
  return reads;
}
inline void check_published_reads() {
  for (const PublishedRead& r : published_reads())
    if (std::memcmp(r.addr, r.value, r.bytes) != 0) {
      std::fprintf(stderr, "emulator: block (%u, %u, %u) read %u bytes at %p that another block wrote after the read "
                   "(a read of other blocks' data before the election or barrier that completes it)\n",
                   r.block[0], r.block[1], r.block[2], r.bytes, r.addr);
      std::abort();
    }
  published_reads().clear();
}

struct Barrier {
  int expected = 0, count = 0;
  unsigned generation = 0;
};

// Bumped by every state change a waiting thread could be waiting for: arrivals, copies, completions,
// exits. A scheduler round without one means every thread waits for something that cannot happen.
inline uint64_t& progress() {
  static uint64_t n = 0;
  return n;
}

struct Copy {
  void* dst;
  const void* src;  // nullptr: zero fill
  unsigned bytes;
};

inline void perform(const Copy& c) {
  if (c.src)
    std::memcpy(c.dst, c.src, c.bytes);
  else
    std::memset(c.dst, 0, c.bytes);
}

// A fiber's (or the scheduler's) saved execution state; switch_to(from, to) saves the running one in `from`
// and resumes `to`, which returns when something switches back to `from`. _setjmp / _longjmp make no
// system call, but under AddressSanitizer every _longjmp first runs __asan_handle_no_return, which asks
// the kernel for the signal stack (sigaltstack) and clears shadow memory of the stack it leaves: 15x the
// unsanitized time of a switch-bound kernel (2026-12-07, dense_head at the 31B width, T = 19 on 132 SMs:
// 47 s, 3 s without the sanitizer; 11 s with it and this switch). On x86-64 the switch is a function of its
// own, as coroutine libraries write it (the callee-saved registers pushed on the running stack, the stack
// pointers exchanged), an ordinary call to AddressSanitizer; elsewhere (or with EMU_SETJMP_SWITCH defined:
// tests/test_cuda_emulator.py runs both) _setjmp / _longjmp, the first entry through swapcontext.
#if defined(__x86_64__) && !defined(EMU_SETJMP_SWITCH)
struct Context {
  void* sp = nullptr;  // the saved stack: callee-saved registers, then the return address
};
// Pushes rbp, rbx, r12-r15 (what the SysV ABI has a callee keep) on the running stack, stores its stack
// pointer in *from, loads `to` and pops them there: returns into whoever saved `to` (or make_context's entry).
[[gnu::naked, gnu::noinline]] inline void switch_stack(void** /*from: rdi*/, void* /*to: rsi*/) {
  asm("pushq %rbp\n\tpushq %rbx\n\tpushq %r12\n\tpushq %r13\n\tpushq %r14\n\tpushq %r15\n\t"
      "movq %rsp, (%rdi)\n\tmovq %rsi, %rsp\n\t"
      "popq %r15\n\tpopq %r14\n\tpopq %r13\n\tpopq %r12\n\tpopq %rbx\n\tpopq %rbp\n\tret");
}
inline void switch_to(Context& from, Context& to) { switch_stack(&from.sp, to.sp); }
// A context that enters `entry` (which must never return) on [stack, stack + size): zeroed registers
// and entry's address below a null return address, entry starting with its stack pointer 8 past a
// 16-byte boundary, as after a call.
inline void make_context(Context& c, char* stack, size_t size, void (*entry)()) {
  auto* top = reinterpret_cast<uintptr_t*>(reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t{15});
  top[-1] = 0;
  top[-2] = reinterpret_cast<uintptr_t>(entry);
  for (int r = 3; r <= 8; ++r) top[-r] = 0;
  c.sp = top - 8;
}
#else
struct Context {
  jmp_buf jb;          // where it was left
  bool saved = false;  // jb holds it (else: first entry, through `first`)
  ucontext_t first;
};
inline void switch_to(Context& from, Context& to) {
  from.saved = true;
  if (_setjmp(from.jb)) return;  // switched back
  if (to.saved) _longjmp(to.jb, 1);
  ucontext_t unused;  // `from` resumes through its jb, never through what swapcontext saves
  swapcontext(&unused, &to.first);
}
inline void make_context(Context& c, char* stack, size_t size, void (*entry)()) {
  getcontext(&c.first);
  c.first.uc_stack.ss_sp = stack;
  c.first.uc_stack.ss_size = size;
  c.first.uc_link = nullptr;
  makecontext(&c.first, entry, 0);
  c.saved = false;
}
#endif

struct Fiber {
  Context ctx;
  dim3 tid;
  bool done = false;
  bool parked = false;  // released the last barrier it met: resumes only in the next round (kWarpAhead)
  unsigned collective = 0;               // warp collectives passed (selects the exchange buffer)
  std::deque<std::vector<Copy>> groups;  // committed cp.async groups, oldest first
  std::vector<Copy> open;                // cp.async since the last commit
};

struct MBarrier {
  int expected = 0, pending = 0;
  int64_t tx = 0;
  unsigned phase = 0;        // completed phases
  std::vector<Copy> copies;  // bulk copies of the current phase not yet performed (late mode)
};

// Per-warp exchange area of the collectives: two buffers (collective parity) x 32 lanes x 16 words.
struct WarpExchange {
  uint64_t slot[2][32][16];
};

struct Block {
  std::vector<Fiber> fibers;
  int current = 0;
  dim3 idx;
  Barrier cta;
  std::vector<Barrier> warp_bar;
  std::vector<WarpExchange> warp_x;
  std::map<uint64_t*, MBarrier> mbarriers;
  unsigned char* smem = nullptr;
  size_t smem_bytes = 0;
  std::function<void()> body;
  Context scheduler;
  const void* scheduler_stack = nullptr;  // AddressSanitizer's view of the scheduler's stack
  size_t scheduler_stack_size = 0;
  size_t stack0 = 0;  // thread t runs on fiber_stack(stack0 + t)
  // A cluster launch's: the blocks of this block's cluster (run at once), its rank among them, and the
  // cluster barrier every thread of them meets at (gemma4_mtp/cluster.cuh's emulation)
  std::vector<Block>* cluster = nullptr;
  unsigned cluster_rank = 0;
  Barrier* cluster_barrier = nullptr;
};

inline Block*& block() {
  static Block* b = nullptr;
  return b;
}
inline Fiber& self() { return block()->fibers[block()->current]; }
inline int lane() { return self().tid.x & 31; }
inline int warp() { return self().tid.x >> 5; }

#if defined(__SANITIZE_ADDRESS__)
extern "C" void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, size_t size);
extern "C" void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old, size_t* size_old);
inline void asan_leave(const void* bottom, size_t size, bool dying) {
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(dying ? nullptr : &fake, bottom, size);
}
inline void asan_enter(const void** bottom_old, size_t* size_old) { __sanitizer_finish_switch_fiber(nullptr, bottom_old, size_old); }
#else
inline void asan_leave(const void*, size_t, bool) {}
inline void asan_enter(const void**, size_t*) {}
#endif

// Back to the scheduler; returns when the scheduler resumes this fiber.
inline void yield() {
  Fiber& f = self();
  Block* b = block();
  asan_leave(b->scheduler_stack, b->scheduler_stack_size, false);
  switch_to(f.ctx, b->scheduler);
  asan_enter(nullptr, nullptr);
}

// park_last (block and cluster barriers): under kWarpAhead the thread whose arrival releases the barrier
// waits for the next scheduling round, so that the lowest warps run ahead of it from the barrier on (a warp
// that rewrites shared memory before the last one has read it shows).
inline void wait(Barrier& b, bool park_last = false) {
  const unsigned g = b.generation;
  ++progress();
  if (++b.count == b.expected) {
    b.count = 0;
    ++b.generation;
    if (park_last && schedule() == Schedule::kWarpAhead) {
      self().parked = true;
      yield();
    }
    return;
  }
  while (b.generation == g) yield();
}

// Lane publishes `n` words, waits for its warp, and returns the warp's exchange buffer of this step.
inline uint64_t (*exchange(const uint64_t* mine, int n))[16] {
  Fiber& f = self();
  WarpExchange& x = block()->warp_x[warp()];
  uint64_t(*buf)[16] = x.slot[f.collective & 1];
  std::memcpy(buf[lane()], mine, n * sizeof(uint64_t));
  ++f.collective;
  wait(block()->warp_bar[warp()]);
  return buf;
}

inline void fiber_main() {
  Block* b = block();
  asan_enter(&b->scheduler_stack, &b->scheduler_stack_size);
  b->body();
  self().done = true;
  ++progress();
  asan_leave(b->scheduler_stack, b->scheduler_stack_size, true);
  switch_to(self().ctx, b->scheduler);
  __builtin_unreachable();  // a finished fiber is never resumed
}

constexpr size_t kStack = 512 * 1024;

// A fiber stack: mapped, not touched (pages are committed only as a thread uses them). Not from the heap:
// AddressSanitizer's allocator clears the shadow of every allocation, 64 KiB a stack, which a cooperative
// launch of thousands of threads paid in page faults and memset for memory it never uses.
inline char* fiber_stack(size_t i) {
  static std::vector<char*> stacks;
  while (stacks.size() <= i) {
    void* p = mmap(nullptr, kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) fail("cannot map a fiber stack");
    stacks.push_back(static_cast<char*>(p));
  }
  return stacks[i];
}

// Makes `b` a block of `threads` fibers, whose thread t runs on fiber_stack(stack0 + t).
inline void init_block(Block& b, dim3 idx, int threads, unsigned char* smem, size_t smem_bytes,
                       const std::function<void()>& body, size_t stack0) {
  b.idx = idx;
  b.fibers.resize(threads);
  b.cta.expected = threads;
  const int nwarps = (threads + 31) / 32;
  b.warp_bar.resize(nwarps);
  for (int w = 0; w < nwarps; ++w) b.warp_bar[w].expected = std::min(32, threads - 32 * w);
  b.warp_x.resize(nwarps);
  b.smem = smem;
  b.smem_bytes = smem_bytes;
  b.body = body;
  b.stack0 = stack0;
  for (int t = 0; t < threads; ++t) {
    Fiber& f = b.fibers[t];
    f.tid = dim3(t);
    make_context(f.ctx, fiber_stack(stack0 + t), kStack, fiber_main);
  }
}

// Repeats `pass` (a scheduling pass; returns whether a thread is not finished) until no thread is left
// or a pass makes no progress: a warp or a block alone, as far as it can go. Returns whether a thread
// was not finished.
template <class Pass>
bool as_far_as_it_goes(Pass&& pass) {
  for (bool any = false;;) {
    const uint64_t mark = progress();
    const bool alive = pass();
    any |= alive;
    if (!alive || progress() == mark) return any;
  }
}

// One scheduling round of block b (see Schedule); returns whether a thread is not finished.
inline bool run_round(Block& b) {
  block() = &b;
  const int threads = static_cast<int>(b.fibers.size()), nwarps = (threads + 31) / 32;
  // Resumes threads [lo, hi) once each; returns whether any is not finished.
  for (Fiber& f : b.fibers) f.parked = false;  // a new round
  auto pass = [&](int lo, int hi) {
    bool any = false;
    for (int t = lo; t < hi; ++t) {
      Fiber& f = b.fibers[t];
      if (f.done) continue;
      any = true;
      if (f.parked) continue;
      b.current = t;
      asan_leave(fiber_stack(b.stack0 + t), kStack, false);
      switch_to(b.scheduler, f.ctx);
      asan_enter(&b.scheduler_stack, &b.scheduler_stack_size);
    }
    return any;
  };
  if (schedule() == Schedule::kRoundRobin) return pass(0, threads);
  bool any = false;
  for (int i = 0; i < nwarps; ++i) {
    const int w = schedule() == Schedule::kWarpAhead ? i : nwarps - 1 - i;
    const int lo = 32 * w, hi = std::min(threads, lo + 32);
    any |= as_far_as_it_goes([&] { return pass(lo, hi); });  // until it waits for something outside it
  }
  return any;
}

// What a finished block must not leave behind.
inline void finish_block(const Block& b) {
  for (const Fiber& f : b.fibers) {
    for (const auto& g : f.groups)
      if (!g.empty()) fail("a thread exited with cp.async copies it never waited for");
    if (!f.open.empty()) fail("a thread exited with uncommitted cp.async copies");
  }
  for (const auto& [addr, m] : b.mbarriers)
    if (!m.copies.empty() || m.tx != 0) fail("a block exited with bulk copies nobody waited for");
}

// Runs blocks to completion until none has a thread left: one block after another (a plain launch:
// blocks.size() == 1 at a time), or every block of a cooperative launch at once (see Schedule).
inline void run_blocks(std::vector<Block>& blocks) {
  const bool ahead = schedule() != Schedule::kRoundRobin;
  for (bool any = true; any;) {
    const uint64_t before = progress();
    any = false;
    for (Block& b : blocks) any |= ahead ? as_far_as_it_goes([&] { return run_round(b); }) : run_round(b);
    if (any && progress() == before) fail("deadlock: every thread waits and none can proceed");
  }
  for (const Block& b : blocks) finish_block(b);
  block() = nullptr;
}

}  // namespace emu

#define threadIdx (::emu::self().tid)
#define blockIdx (::emu::block()->idx)

inline void __syncthreads() { emu::wait(emu::block()->cta, true); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::wait(emu::block()->warp_bar[emu::warp()]); }

// A warp shuffle: lane l reads the value of lane source(l, first lane of its width-lane segment); the
// lanes exchange their values in one collective.
template <class V, class F>
V shfl_impl(V v, int width, F source) {
  static_assert(sizeof(V) <= 8, "shuffled values are words");
  uint64_t mine = 0;
  std::memcpy(&mine, &v, sizeof(V));
  const auto buf = emu::exchange(&mine, 1);
  const int lane = emu::lane();
  V out;
  std::memcpy(&out, &buf[source(lane, lane / width * width)][0], sizeof(V));
  return out;
}
template <class V>
V shfl_xor_impl(V v, int lane_mask, int width) {
  return shfl_impl(v, width, [&](int lane, int seg) {
    const int src = lane ^ lane_mask;
    return src >= seg && src < seg + width ? src : lane;
  });
}
// lane l reads lane l - delta of its segment, or keeps its own value below the segment's first lane
template <class V>
V shfl_up_impl(V v, unsigned delta, int width) {
  return shfl_impl(v, width, [&](int lane, int seg) {
    const int src = lane - static_cast<int>(delta);
    return src >= seg ? src : lane;
  });
}
template <class V>
V __shfl_xor_sync(unsigned, V v, int lane_mask, int width = 32) {
  return shfl_xor_impl(v, lane_mask, width);
}
template <class V>
V __shfl_up_sync(unsigned, V v, unsigned delta, int width = 32) {
  return shfl_up_impl(v, delta, width);
}
template <class V>
V __shfl_sync(unsigned, V v, int src_lane, int width = 32) {
  return shfl_impl(v, width, [&](int, int seg) { return seg + (src_lane % width); });
}
// The lanes holding the same value as this one (every lane takes part).
inline unsigned __match_any_sync(unsigned, unsigned v) {
  uint64_t mine = v;
  const auto buf = emu::exchange(&mine, 1);
  unsigned peers = 0;
  for (int l = 0; l < 32; ++l)
    if (buf[l][0] == mine) peers |= 1u << l;
  return peers;
}
// Bit l set where lane l's predicate holds (every lane takes part).
inline unsigned __ballot_sync(unsigned, int pred) {
  uint64_t mine = pred != 0;
  const auto buf = emu::exchange(&mine, 1);
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l)
    if (buf[l][0]) bits |= 1u << l;
  return bits;
}
inline unsigned __reduce_add_sync(unsigned, unsigned v) {
  uint64_t mine = v;
  const auto buf = emu::exchange(&mine, 1);
  unsigned sum = 0;
  for (int l = 0; l < 32; ++l) sum += static_cast<unsigned>(buf[l][0]);
  return sum;
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(unsigned v) { return __builtin_ffs(static_cast<int>(v)); }
inline float __uint_as_float(unsigned v) {
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}

inline int atomicOr(int* p, int v) {
  const int old = *p;
  *p |= v;
  return old;
}
// Threads switch only in barriers, collectives and spins (where a cooperative launch's blocks also
// interleave), so atomics are plain read-modify-writes and fences have nothing to order.
template <class I>
I atomicAdd(I* p, I v) {
  const I old = *p;
  *p += v;
  return old;
}
inline void __threadfence() {}
[[noreturn]] inline void __trap() { emu::fail("a thread executed __trap()"); }
inline unsigned atomicInc(unsigned* p, unsigned limit) {
  const unsigned old = *p;
  *p = old >= limit ? 0u : old + 1u;
  return old;
}
// A spin (a sleep in a wait loop, or an acquire load polled by one): the other threads, and the other
// blocks of a cooperative launch, run. A spin that can never end (a wait for a block that runs after
// this one, or a deadlock) makes a scheduling round without progress, which fails the run.
inline void __nanosleep(unsigned) { emu::yield(); }
namespace emu {
// The load of `bytes` bytes at p that returned `value`, for check_published_reads.
inline void note_published_read(const void* p, const void* value, unsigned bytes) {
  if (bytes > sizeof(PublishedRead::value)) fail("a published read wider than 16 bytes");
  PublishedRead r{p, bytes, {}, {blockIdx.x, blockIdx.y, blockIdx.z}};
  std::memcpy(r.value, value, bytes);
  published_reads().push_back(r);
}
}  // namespace emu

// ---- kernel launch ----
inline cudaError_t cudaGetDevice(int* d) {
  *d = emu::current_device();
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int dev) {
  const emu::Device& d = emu::devices().at(dev);
  *v = a == cudaDevAttrMaxSharedMemoryPerBlockOptin ? d.smem_optin
      : a == cudaDevAttrComputeCapabilityMajor        ? d.major
                                                      : d.sms;
  return cudaSuccess;
}
namespace emu {
inline std::map<std::pair<const void*, int>, int>& smem_opt_ins() {
  static std::map<std::pair<const void*, int>, int> m;
  return m;
}
// Kernels allowed clusters of more than 8 blocks, per device.
inline std::map<std::pair<const void*, int>, bool>& non_portable_clusters() {
  static std::map<std::pair<const void*, int>, bool> m;
  return m;
}
}  // namespace emu
template <class F>
cudaError_t cudaFuncSetAttribute(F* kernel, cudaFuncAttribute attr, int value) {
  const std::pair<const void*, int> key{reinterpret_cast<const void*>(kernel), emu::current_device()};
  if (attr == cudaFuncAttributeNonPortableClusterSizeAllowed) {
    emu::non_portable_clusters()[key] = value != 0;
    return cudaSuccess;
  }
  if (value > emu::devices().at(emu::current_device()).smem_optin) return cudaErrorInvalidValue;
  emu::smem_opt_ins()[key] = value;
  return cudaSuccess;
}

template <class... P, class... A>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* cfg, void (*kernel)(P...), A&&... args) {
  const emu::Device& dev = emu::devices().at(emu::current_device());
  const int threads = static_cast<int>(cfg->blockDim.x * cfg->blockDim.y * cfg->blockDim.z);
  if (threads < 1 || threads > 1024 || cfg->gridDim.y > 65535 || cfg->gridDim.z > 65535) return cudaErrorInvalidConfiguration;
  if (cfg->dynamicSmemBytes > 48 * 1024) {
    const auto it = emu::smem_opt_ins().find({reinterpret_cast<const void*>(kernel), emu::current_device()});
    if (it == emu::smem_opt_ins().end() || static_cast<size_t>(it->second) < cfg->dynamicSmemBytes)
      return cudaErrorInvalidValue;  // a real launch fails the same way
  }
  bool pdl = false, cooperative = false;
  unsigned cluster = 0;  // blocks per cluster along x (0: no cluster attribute)
  for (unsigned i = 0; i < cfg->numAttrs; ++i) {
    pdl |= cfg->attrs[i].id == cudaLaunchAttributeProgrammaticStreamSerialization &&
           cfg->attrs[i].val.programmaticStreamSerializationAllowed;
    cooperative |= cfg->attrs[i].id == cudaLaunchAttributeCooperative && cfg->attrs[i].val.cooperative;
    if (cfg->attrs[i].id == cudaLaunchAttributeClusterDimension) {
      const auto& d = cfg->attrs[i].val.clusterDim;
      if (d.y != 1 || d.z != 1) return cudaErrorInvalidValue;  // clusters along x only here
      cluster = d.x;
    }
  }
  if (pdl && dev.major < 9) return cudaErrorInvalidValue;
  if (cluster != 0) {  // as the driver: sm_90, a divisor of the grid, at most 8 (16 once allowed) blocks
    const auto allowed = emu::non_portable_clusters().find({reinterpret_cast<const void*>(kernel),
                                                             emu::current_device()});
    const unsigned most = allowed != emu::non_portable_clusters().end() && allowed->second ? 16u : 8u;
    if (dev.major < 9 || cooperative || cluster > most || cfg->gridDim.x % cluster != 0)
      return cudaErrorInvalidValue;
  }
  emu::launch_log().push_back({cfg->gridDim, cfg->blockDim, cfg->dynamicSmemBytes, pdl});
  const std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
  const std::function<void()> body = [&] { std::apply(kernel, params); };
  ::gridDim = cfg->gridDim;
  ::blockDim = dim3(static_cast<unsigned>(threads));
  const size_t n = static_cast<size_t>(cfg->gridDim.x) * cfg->gridDim.y * cfg->gridDim.z;
  auto index = [&](size_t i) {
    return dim3(static_cast<unsigned>(i % cfg->gridDim.x), static_cast<unsigned>(i / cfg->gridDim.x % cfg->gridDim.y),
                static_cast<unsigned>(i / (static_cast<size_t>(cfg->gridDim.x) * cfg->gridDim.y)));
  };
  // fresh shared memory of exactly the launch's size per block (AddressSanitizer sees an overrun), NaN bits
  auto shared_memory = [&] {
    std::unique_ptr<unsigned char[]> smem(new unsigned char[cfg->dynamicSmemBytes]);
    std::memset(smem.get(), 0xFF, cfg->dynamicSmemBytes);
    return smem;
  };
  // kWarpBehind: blocks from the highest index down (emu::Schedule)
  auto order = [&](size_t i) { return emu::schedule() == emu::Schedule::kWarpBehind ? n - 1 - i : i; };
  if (cluster > 1) {  // each cluster's blocks resident at once, clusters one after another
    const size_t clusters = n / cluster;
    for (size_t k = 0; k < clusters; ++k) {
      const size_t half = (clusters + 1) / 2;
      const size_t c = emu::clusters_evens_first() ? (k < half ? 2 * k : 2 * (k - half) + 1) : k;
      const size_t first = (emu::schedule() == emu::Schedule::kWarpBehind ? clusters - 1 - c : c) * cluster;
      std::vector<std::unique_ptr<unsigned char[]>> smem(cluster);
      std::vector<emu::Block> blocks(cluster);
      emu::Barrier barrier;
      barrier.expected = static_cast<int>(cluster) * threads;
      for (unsigned r = 0; r < cluster; ++r) {
        // kWarpBehind: the cluster's highest rank first (emu::run_blocks runs them in vector order)
        const unsigned slot = emu::schedule() == emu::Schedule::kWarpBehind ? cluster - 1 - r : r;
        smem[slot] = shared_memory();
        emu::init_block(blocks[slot], index(first + r), threads, smem[slot].get(), cfg->dynamicSmemBytes, body,
                        static_cast<size_t>(slot) * threads);
        blocks[slot].cluster = &blocks;
        blocks[slot].cluster_rank = r;
        blocks[slot].cluster_barrier = &barrier;
      }
      emu::run_blocks(blocks);
    }
    emu::check_published_reads();
    return cudaSuccess;
  }
  if (cooperative) {  // every block resident at once (a spinning thread lets the others run)
    if (n > static_cast<size_t>(dev.sms)) return cudaErrorCooperativeLaunchTooLarge;  // one block per SM here
    std::vector<std::unique_ptr<unsigned char[]>> smem(n);
    std::vector<emu::Block> blocks(n);
    for (size_t i = 0; i < n; ++i) {
      smem[i] = shared_memory();
      emu::init_block(blocks[i], index(order(i)), threads, smem[i].get(), cfg->dynamicSmemBytes, body, i * threads);
    }
    emu::run_blocks(blocks);
    emu::check_published_reads();
    return cudaSuccess;
  }
  for (size_t j = 0; j < n; ++j) {
    const size_t i = order(j);
    const auto smem = shared_memory();
    std::vector<emu::Block> one(1);
    emu::init_block(one[0], index(i), threads, smem.get(), cfg->dynamicSmemBytes, body, 0);
    emu::run_blocks(one);
  }
  emu::check_published_reads();
  return cudaSuccess;
}
