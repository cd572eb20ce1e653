#include "delegate.hpp"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <atomic>

namespace fa4cpp_torch {
namespace {

std::atomic<bool> python_path{false};

}  // namespace

bool python_path_on() { return python_path.load(std::memory_order_relaxed); }

std::vector<c10::IValue> call_python_path(const char* name, std::vector<c10::IValue> args,
                                          const std::string& why) {
  const std::string op = std::string("fa4cpp::") + name + "_py";
  const auto handle = c10::Dispatcher::singleton().findSchema({op, ""});
  TORCH_CHECK(handle.has_value(), why.empty() ? std::string("fa4cpp cannot run this call") : why,
              " (", op, ", the fa4cpp Python package's implementation, is not registered in "
              "this process: import fa4cpp for its error reporting and fallback mode)");
  handle->callBoxed(args);
  return args;
}

}  // namespace fa4cpp_torch

// The package's switch: on while fallback or verify mode is, or when asked for.
extern "C" __attribute__((visibility("default"))) void fa4cpp_torch_set_python_path(int on) {
  fa4cpp_torch::python_path.store(on != 0, std::memory_order_relaxed);
}
