/* What libfa4 exports. The library is built with hidden visibility (cmake/fa4_library.cmake): its
 * kernels, CUTLASS / CuTe instantiations and internal statics stay private to it, so that several
 * libraries built from CUTLASS can share a process, and two copies of fa4cpp loaded side by side
 * (bench/sweep.py's A/B runs) keep their own state. Only the C ABI (fa4.h) and the C++ API
 * (attention.hpp) carry this mark. */
#ifndef FA4_EXPORT_H_
#define FA4_EXPORT_H_

#if defined(_WIN32)
#define FA4_API __declspec(dllexport)
#else
#define FA4_API __attribute__((visibility("default")))
#endif

#endif /* FA4_EXPORT_H_ */
