// The native tests' check: CHECK(cond) prints the condition that failed, with its file
// and line, and counts it in `failures`; a test's main ends with `return Finish(name)`,
// which says how it went and returns 1 when any failed.

#ifndef TFPSX_TESTS_CHECK_H_
#define TFPSX_TESTS_CHECK_H_

#include <cstdio>

namespace tfpsx_test {
inline int failures = 0;

// The test's verdict on stdout (or its failures' count on stderr); main's return value.
inline int Finish(const char* name) {
  if (failures) {
    std::fprintf(stderr, "%s: %d check(s) failed\n", name, failures);
    return 1;
  }
  std::printf("%s: all checks passed\n", name);
  return 0;
}
}  // namespace tfpsx_test

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++tfpsx_test::failures;                                                       \
    }                                                                               \
  } while (0)

#endif  // TFPSX_TESTS_CHECK_H_
