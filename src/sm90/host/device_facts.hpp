// What the launch plans need to know of the device they launch on. The backend asks the CUDA
// runtime (host/backend.cpp) and fails the call when it cannot; tests pass facts of their own.
#pragma once

namespace fa4::sm90 {

struct DeviceFacts {
  int sm_count = 0;  // streaming multiprocessors
  int l2_bytes = 0;  // L2 cache size
};

}  // namespace fa4::sm90
