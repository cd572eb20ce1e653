// Status helpers for every layer below the API: a formatted message with its code, one sentence
// that names the offending field or limit.
#pragma once

#include "fa4/attention.hpp"

namespace fa4::detail {

Status make_status(StatusCode code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
// kInvalidArgument: the caller's input is wrong.
Status invalid(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
// kNotSupported: a valid input this backend does not implement.
Status not_supported(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

}  // namespace fa4::detail
