// Minimal assertion helpers for the host tests (no test framework dependency).
#pragma once

#include <cstdio>
#include <cstdlib>

inline int g_failures = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                            \
    }                                                                          \
  } while (0)

#define CHECK_EQ(a, b)                                                                             \
  do {                                                                                             \
    const auto va_ = (a);                                                                          \
    const auto vb_ = (b);                                                                          \
    if (!(va_ == vb_)) {                                                                           \
      std::fprintf(stderr, "%s:%d: CHECK_EQ failed: %s == %s (%lld vs %lld)\n", __FILE__, __LINE__, #a, #b, \
                   static_cast<long long>(va_), static_cast<long long>(vb_));                     \
      ++g_failures;                                                                                \
    }                                                                                              \
  } while (0)

inline int finish(const char* name) {
  if (g_failures) {
    std::fprintf(stderr, "%s: %d check(s) failed\n", name, g_failures);
    return 1;
  }
  std::printf("%s: ok\n", name);
  return 0;
}
