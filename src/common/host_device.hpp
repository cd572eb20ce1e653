// Lets the small math pieces shared by the CPU backend and the CUDA kernels compile in both.
#pragma once

#if defined(__CUDACC__)
#define FA4_HD __host__ __device__ __forceinline__
#else
#define FA4_HD inline
#endif
