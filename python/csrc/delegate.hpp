// The native ops hand a call to the package's Python implementation (the ops fa4cpp::<name>_py
// that fa4cpp/ops.py registers) when they do not run it themselves: when the inputs are ones the
// Python path rejects or the library refuses (the Python path raises the package's error, or runs
// the fallback), and whenever a mode of the package (fallback, verify) is on.
#pragma once

#include <ATen/core/ivalue.h>

#include <string>
#include <vector>

namespace fa4cpp_torch {

// Whether every call goes to the Python implementation (the package sets it).
bool python_path_on();

// Calls fa4cpp::<name>_py with `args` and returns its outputs. `why` is the native path's reason,
// reported when the Python implementation is not registered (a process without the package).
std::vector<c10::IValue> call_python_path(const char* name, std::vector<c10::IValue> args,
                                          const std::string& why);

}  // namespace fa4cpp_torch
