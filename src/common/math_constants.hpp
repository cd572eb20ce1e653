// Constants shared by the CPU backend, the kernels and the host-side checks.
#pragma once

namespace fa4 {

constexpr float kLog2e = 1.44269504088896340736f;  // log2(e): exp(x) = exp2(x · kLog2e)

}  // namespace fa4
