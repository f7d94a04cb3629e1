// What the emulator drivers (*_main.cpp) share: key=value arguments; tensors exchanged with the Python
// tests as packed rows, held here at a row stride and element offset in allocations of exactly their
// extent (a read past a row's end or the last row is an AddressSanitizer error), poisoned with NaN bits
// until written; the emulated device; the checks of a launcher's launches; the dtype dispatch.
#pragma once

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "emu.h"

namespace emu_io {

// key=value arguments, read by num / real / str (str without a default: a required key). Every key
// given must be read: finish() fails a run that left one unread, since a misspelt key would otherwise
// run the case with the default and pass without testing what its test says.
class Args {
 public:
  int64_t num(const char* key, int64_t dflt) const {
    const std::string* v = get(key);
    return v == nullptr ? dflt : std::stoll(*v);
  }
  double real(const char* key, double dflt) const {
    const std::string* v = get(key);
    return v == nullptr ? dflt : std::stod(*v);
  }
  std::string str(const char* key, const std::string& dflt) const {
    const std::string* v = get(key);
    return v == nullptr ? dflt : *v;
  }
  std::string str(const char* key) const {
    const std::string* v = get(key);
    if (v == nullptr) emu::fail((std::string("missing argument ") + key).c_str());
    return *v;
  }
  bool has(const char* key) const { return get(key) != nullptr; }
  std::string unread() const {
    std::string out;
    for (const auto& [k, v] : kv_)
      if (!read_.count(k)) out += (out.empty() ? "" : " ") + k;
    return out;
  }
  void set(const std::string& key, const std::string& value) { kv_[key] = value; }

 private:
  const std::string* get(const char* key) const {
    read_.insert(key);
    const auto it = kv_.find(key);
    return it == kv_.end() ? nullptr : &it->second;
  }
  std::map<std::string, std::string> kv_;
  mutable std::set<std::string> read_;
};

inline Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    const auto eq = s.find('=');
    if (eq == std::string::npos) emu::fail(("bad argument " + s).c_str());
    a.set(s.substr(0, eq), s.substr(eq + 1));
  }
  return a;
}

// The driver's exit status: rc, or a failure (printed last, after the run's OK line) if an argument
// was never read.
inline int finish(const Args& a, int rc) {
  const std::string unread = a.unread();
  if (rc == 0 && !unread.empty()) {
    std::printf("FAIL arguments never read (misspelt?): %s\n", unread.c_str());
    return 1;
  }
  return rc;
}

inline std::vector<char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) emu::fail(("cannot read " + path).c_str());
  return std::vector<char>(std::istreambuf_iterator<char>(f), {});
}

inline void write_file(const std::string& path, const void* data, size_t bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
}

// A [rows, cols] tensor at row stride `stride`, `offset` elements into an allocation of exactly its
// extent.
struct Buffer {
  std::vector<unsigned char> bytes;
  int64_t rows = 0, cols = 0, stride = 0, elem = 0, offset = 0;
  unsigned char* base() { return bytes.data() + offset * elem; }
  const unsigned char* base() const { return bytes.data() + offset * elem; }
  void* data() { return bytes.empty() ? nullptr : base(); }
};

inline Buffer strided(int64_t rows, int64_t cols, int64_t stride, int64_t elem, int64_t offset = 0) {
  Buffer b;
  b.rows = rows;
  b.cols = cols;
  b.stride = stride;
  b.elem = elem;
  b.offset = offset;
  const int64_t extent = rows > 0 ? offset + (rows - 1) * stride + cols : 0;
  b.bytes.assign(static_cast<size_t>(extent * elem), 0xFF);  // NaN in every float type
  return b;
}

inline Buffer load(const std::string& dir, const std::string& name, int64_t rows, int64_t cols, int64_t stride, int64_t elem,
            int64_t offset = 0) {
  Buffer b = strided(rows, cols, stride, elem, offset);
  const std::vector<char> packed = read_file(dir + "/" + name + ".bin");
  if (static_cast<int64_t>(packed.size()) != rows * cols * elem) emu::fail(("wrong size of " + name).c_str());
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(b.base() + r * stride * elem, packed.data() + r * cols * elem, static_cast<size_t>(cols * elem));
  return b;
}

inline void store(const std::string& dir, const std::string& name, const Buffer& b) {
  std::vector<char> packed(static_cast<size_t>(b.rows * b.cols * b.elem));
  for (int64_t r = 0; r < b.rows; ++r)
    std::memcpy(packed.data() + r * b.cols * b.elem, b.base() + r * b.stride * b.elem,
                static_cast<size_t>(b.cols * b.elem));
  write_file(dir + "/" + name + ".bin", packed.data(), packed.size());
}

constexpr int kH100SmemOptin = 232448;  // opt-in shared memory per block of an H100 / H200

// The device the call runs on (smem_optin bytes of opt-in shared memory, compute capability major, sms
// SMs) and the warps' schedule: "rr" (round robin), "ahead" or "behind" (one warp as far as it goes).
inline void use_device(int smem_optin, int major, int sms, const std::string& schedule) {
  emu::devices().push_back({smem_optin, major, sms});
  emu::current_device() = 0;
  emu::schedule() = schedule == "ahead"    ? emu::Schedule::kWarpAhead
                    : schedule == "behind" ? emu::Schedule::kWarpBehind
                                           : emu::Schedule::kRoundRobin;
}

// Whether the launcher returned success after exactly `expected` launches, each with programmatic
// dependent launch exactly when `pdl`, and left every counter zero; prints "FAIL ..." when not.
// not_pdl_from_end: the launch, counted from the end (1: the last), that is never a programmatic dependent
// one (a cooperative launch); 0: none.
inline bool launched_as_expected(cudaError_t err, size_t expected, bool pdl, const std::vector<int32_t>& counters,
                                 size_t not_pdl_from_end = 0) {
  const auto& log = emu::launch_log();
  if (err != cudaSuccess) {
    std::printf("FAIL launcher returned %d\n", err);
    return false;
  }
  if (log.size() != expected) {
    std::printf("FAIL %zu launches, expected %zu\n", log.size(), expected);
    return false;
  }
  for (size_t i = 0; i < log.size(); ++i) {
    const bool want = pdl && i + not_pdl_from_end != log.size();
    if (log[i].pdl != want) {
      std::printf("FAIL launch %zu: programmatic dependent launch %d, expected %d\n", i, log[i].pdl, want);
      return false;
    }
  }
  for (int32_t c : counters)
    if (c != 0) {
      std::printf("FAIL a counter was left at %d\n", c);
      return false;
    }
  return true;
}

// run(tag) with a value of the element type named by dtype (bf16, f16, f32).
template <class F>
int with_dtype(const std::string& dtype, F&& run) {
  if (dtype == "bf16") return run(__nv_bfloat16{});
  if (dtype == "f16") return run(__half{});
  if (dtype == "f32") return run(float{});
  emu::fail("dtype must be bf16, f16 or f32");
}

}  // namespace emu_io
