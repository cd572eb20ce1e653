// The CPU backend's tile products: fp32 GEMM on OpenBLAS (linked into the library, its copy set to
// one thread: each worker thread runs its own products, and no BLAS thread pool is involved).
#pragma once

#include <cstdint>

namespace fa4::cpu {

// C[m×n] = op(A) · op(B) + beta · C, row-major with leading dimensions lda / ldb / ldc; op
// transposes when its flag is set (A then k×m, B n×k as stored).
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

}  // namespace fa4::cpu
