// The library's one reader of the environment: the overrides tools and tests ask for by name.
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "api/override_fields.hpp"
#include "common/status.hpp"
#include "fa4/overrides.hpp"

namespace fa4 {

Status overrides_from_env(Overrides* overrides) {
  if (overrides == nullptr) return detail::invalid("overrides (the result pointer) is null");
  Overrides o;
  for (const detail::ChoiceField& f : detail::kChoiceFields) {
    const char* v = std::getenv(f.env);
    if (v == nullptr || *v == '\0') continue;
    if (std::strcmp(v, f.on) == 0)
      o.*f.member = Choice::kOn;
    else if (std::strcmp(v, f.off) == 0)
      o.*f.member = Choice::kOff;
    else
      return detail::invalid("%s=%s: expected %s or %s (or unset: the library's choice)", f.env,
                             v, f.on, f.off);
  }
  for (const detail::CountField& f : detail::kCountFields) {
    const char* v = std::getenv(f.env);
    if (v == nullptr || *v == '\0') continue;
    char* end = nullptr;
    errno = 0;
    const long n = std::strtol(v, &end, 10);
    if (*end != '\0' || errno != 0 || n < 0 || n > INT_MAX)
      return detail::invalid("%s=%s: expected a count >= 0 (0 or unset: the library's choice)",
                             f.env, v);
    o.*f.member = int(n);
  }
  *overrides = o;
  return Status::success();
}

}  // namespace fa4
