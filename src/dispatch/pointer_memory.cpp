#include "dispatch/pointer_memory.hpp"

#include "dispatch/backend.hpp"

#if defined(FA4_WITH_CUDA)
#include <cuda.h>
#include <dlfcn.h>

#include <atomic>
#endif

namespace fa4::detail {

#if defined(FA4_WITH_CUDA)
namespace {

using PointerAttributesFn = CUresult (*)(unsigned int, CUpointer_attribute*, void**, CUdeviceptr);

// The driver's cuPointerGetAttributes, or null while this process has not loaded the driver. The
// runtime's cudaPointerGetAttributes would create the primary context of device 0 (hundreds of
// milliseconds and device memory) in a process that only ever asks about host memory. The driver
// call never creates a context; and with the driver not yet loaded, or loaded but not initialised,
// no CUDA allocation can exist. The library is not linked to the driver: it is looked up among the
// loaded libraries (RTLD_NOLOAD), and once found it stays loaded, so the lookup is kept.
PointerAttributesFn pointer_attributes() {
  static std::atomic<PointerAttributesFn> cached{nullptr};
  PointerAttributesFn fn = cached.load(std::memory_order_acquire);
  if (fn != nullptr) return fn;
  void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (driver == nullptr) return nullptr;
  fn = reinterpret_cast<PointerAttributesFn>(dlsym(driver, "cuPointerGetAttributes"));
  dlclose(driver);  // drops only the reference NOLOAD took; the runtime's keeps it loaded
  cached.store(fn, std::memory_order_release);
  return fn;
}

}  // namespace

Memory memory_of(const void* ptr, int* device) {
  const PointerAttributesFn get = pointer_attributes();
  if (get == nullptr) return Memory::kHost;
  unsigned int type = 0, managed = 0;
  int ordinal = -1;
  CUpointer_attribute attributes[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                      CU_POINTER_ATTRIBUTE_IS_MANAGED,
                                      CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
  void* values[] = {&type, &managed, &ordinal};
  // Unknown (plain host) pointers come back with the attributes zeroed and CUDA_SUCCESS; an
  // uninitialised driver answers CUDA_ERROR_NOT_INITIALIZED: no CUDA memory exists then either.
  if (get(3, attributes, values, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS)
    return Memory::kHost;
  if (managed != 0) return Memory::kManaged;
  if (type != CU_MEMORYTYPE_DEVICE) return Memory::kHost;
  if (device != nullptr) *device = ordinal;
  return Memory::kDevice;
}
#else
Memory memory_of(const void*, int*) { return Memory::kHost; }
#endif

bool is_device_pointer(const void* ptr) { return memory_of(ptr) != Memory::kHost; }

bool is_device_only_pointer(const void* ptr) { return memory_of(ptr) == Memory::kDevice; }

}  // namespace fa4::detail
