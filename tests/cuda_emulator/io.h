// File and argument helpers of the emulator drivers (glue_main.cpp, down_proj_main.cpp): key=value
// arguments, and tensors exchanged with the Python tests as packed rows, held here at a row stride and
// element offset in allocations of exactly their extent (a read past a row's end or the last row is an
// AddressSanitizer error), poisoned with NaN bits until written.
#pragma once

#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "emu.h"

namespace emu_io {

inline std::map<std::string, std::string> parse(int argc, char** argv) {
  std::map<std::string, std::string> a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    const auto eq = s.find('=');
    if (eq == std::string::npos) emu::fail(("bad argument " + s).c_str());
    a[s.substr(0, eq)] = s.substr(eq + 1);
  }
  return a;
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

}  // namespace emu_io
