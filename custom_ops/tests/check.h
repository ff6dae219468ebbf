// The native tests' check: CHECK(cond) prints the condition that failed, with its file
// and line, and counts it in `failures`; a test's main returns 1 when any failed.

#ifndef TFPSX_TESTS_CHECK_H_
#define TFPSX_TESTS_CHECK_H_

#include <cstdio>

namespace tfpsx_test {
inline int failures = 0;
}  // namespace tfpsx_test

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++tfpsx_test::failures;                                                       \
    }                                                                               \
  } while (0)

#endif  // TFPSX_TESTS_CHECK_H_
