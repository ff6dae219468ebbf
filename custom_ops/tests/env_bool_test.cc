// Native tests of the core's boolean settings: the spellings tfpsx/settings.py accepts.

#include <cstdio>
#include <cstdlib>
#include <initializer_list>

#include "custom_ops/cc/core/env_bool.h"
#include "custom_ops/tests/check.h"

namespace {

using tfpsx_test::failures;

bool Parsed(const char* text, bool expected) {
  bool value = !expected;
  return tfpsx::ParseBool(text, &value) && value == expected;
}

}  // namespace

int main() {
  for (const char* t : {"1", "true", "TRUE", "Yes", "on", " on\n"}) CHECK(Parsed(t, true));
  for (const char* t : {"0", "false", "False", "NO", "off", "\toff "}) CHECK(Parsed(t, false));
  for (const char* t : {"", "2", "enable", "onn", "t"}) {
    bool value = true;
    CHECK(!tfpsx::ParseBool(t, &value) && value);  // unchanged
  }
  bool value = false;
  CHECK(!tfpsx::ParseBool(nullptr, &value) && !value);

  setenv("TFPSX_ENV_BOOL_TEST", "yes", 1);
  CHECK(tfpsx::EnvBool("TFPSX_ENV_BOOL_TEST", false));
  setenv("TFPSX_ENV_BOOL_TEST", "off", 1);
  CHECK(!tfpsx::EnvBool("TFPSX_ENV_BOOL_TEST", true));
  setenv("TFPSX_ENV_BOOL_TEST", "maybe", 1);  // reported on stderr, the fallback taken
  CHECK(tfpsx::EnvBool("TFPSX_ENV_BOOL_TEST", true) && !tfpsx::EnvBool("TFPSX_ENV_BOOL_TEST", false));
  unsetenv("TFPSX_ENV_BOOL_TEST");
  CHECK(tfpsx::EnvBool("TFPSX_ENV_BOOL_TEST", true) && !tfpsx::EnvBool("TFPSX_ENV_BOOL_TEST", false));
  return tfpsx_test::Finish("env_bool_test");
}
