// G4_CHECK(cond, parts...): a torch check with a message concatenated here, never written to a
// std::ostream. On the GPU image (its g++ links its own libstdc++ into the extension) writing a
// number to a c10::str stream crashed the process (SIGSEGV in the num_put facet, 2026-12-04), so a
// refused argument killed the engine instead of raising; with -static-libstdc++ on gcc 12 the number
// is silently dropped. std::to_string formats with snprintf (no locale), and c10::str passes a lone
// std::string through without a stream. Only the message's arguments are evaluated, and only on failure.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

namespace gemma4_mtp::message {

inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, std::string_view v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, const c10::Device& v) { s += v.str(); }
inline void append(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  s += ']';
}
template <typename T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool> &&
                                           !std::is_same_v<T, char>, int> = 0>
inline void append(std::string& s, T v) { s += std::to_string(v); }

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::string s;
  (append(s, parts), ...);
  return s;
}

}  // namespace gemma4_mtp::message

// The ops' argument checks raise what the Python ops raise for the same mistake (gemma4_mtp_kernels/
// _checks.py): G4_CHECK a ValueError, G4_CHECK_TYPE (a wrong dtype) a TypeError. What is not an
// argument's fault (a failed launch) is a RuntimeError: G4_CHECK_RUNTIME.
#define G4_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, ::gemma4_mtp::message::concat(__VA_ARGS__))
#define G4_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, ::gemma4_mtp::message::concat(__VA_ARGS__))
#define G4_CHECK_RUNTIME(cond, ...) TORCH_CHECK(cond, ::gemma4_mtp::message::concat(__VA_ARGS__))
