// Boolean settings read by the C++ core, parsed as tfpsx/settings.py parses them:
// 1/true/yes/on and 0/false/no/off, any case, surrounding spaces ignored. The Python
// side validates every TFPSX_* variable it loads the library with, so a bad value is
// named there first; the core never guesses at one.

#ifndef TFPSX_CORE_ENV_BOOL_H_
#define TFPSX_CORE_ENV_BOOL_H_

namespace tfpsx {

// Parses `text` into *value; false (and *value unchanged) when it is no boolean spelling.
bool ParseBool(const char* text, bool* value);

// The environment variable `name` as a boolean: `fallback` when unset or empty; a value
// that is no boolean spelling is reported once on stderr and taken as `fallback`.
bool EnvBool(const char* name, bool fallback);

}  // namespace tfpsx

#endif  // TFPSX_CORE_ENV_BOOL_H_
