#include "custom_ops/cc/core/env_bool.h"

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace tfpsx {

bool ParseBool(const char* text, bool* value) {
  if (text == nullptr) return false;
  std::string s(text);
  const size_t begin = s.find_first_not_of(" \t\r\n");
  const size_t end = s.find_last_not_of(" \t\r\n");
  s = begin == std::string::npos ? "" : s.substr(begin, end - begin + 1);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s == "1" || s == "true" || s == "yes" || s == "on") {
    *value = true;
    return true;
  }
  if (s == "0" || s == "false" || s == "no" || s == "off") {
    *value = false;
    return true;
  }
  return false;
}

bool EnvBool(const char* name, bool fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  bool value = fallback;
  if (!ParseBool(text, &value)) {
    std::fprintf(stderr,
                 "tfpsx: %s: expected one of 1, true, yes, on, 0, false, no, off, got '%s'; "
                 "taking %s\n",
                 name, text, fallback ? "1" : "0");
  }
  return value;
}

}  // namespace tfpsx
