// The FA4_SM90_* switches that force a launcher choice for tests and measurements.
#pragma once

#include <cstdlib>
#include <cstring>

namespace fa4::sm90 {

// 1 when environment variable `name` is `on`, 0 when it is `off`, −1 (the launcher's choice)
// when it is unset or anything else. Callers read it once, into a static.
inline int env_switch(const char* name, const char* on, const char* off) {
  const char* v = std::getenv(name);
  if (v == nullptr) return -1;
  if (std::strcmp(v, on) == 0) return 1;
  if (std::strcmp(v, off) == 0) return 0;
  return -1;
}

// The integer in environment variable `name` (as atoi reads it: 0 when it is not a number), 0
// when it is unset. Callers read it once, into a static.
inline int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? 0 : std::atoi(v);
}

}  // namespace fa4::sm90
