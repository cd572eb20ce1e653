#include "common/status.hpp"

#include <cstdarg>
#include <cstdio>

namespace fa4::detail {

namespace {

Status vmake(StatusCode code, const char* fmt, va_list args) {
  char buf[512];
  std::vsnprintf(buf, sizeof buf, fmt, args);
  return Status{code, buf};
}

}  // namespace

Status make_status(StatusCode code, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  Status s = vmake(code, fmt, args);
  va_end(args);
  return s;
}

Status invalid(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  Status s = vmake(StatusCode::kInvalidArgument, fmt, args);
  va_end(args);
  return s;
}

Status not_supported(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  Status s = vmake(StatusCode::kNotSupported, fmt, args);
  va_end(args);
  return s;
}

}  // namespace fa4::detail
