// The CPU backend's tile products: fp32 GEMM on OpenBLAS (linked into the library, its copy set to
// one thread: each worker thread runs its own products, and no BLAS thread pool is involved).
#pragma once

#include <cstdint>

namespace fa4::cpu {

// C[m×n] = op(A) · op(B) + beta · C, row-major with leading dimensions lda / ldb / ldc; op
// transposes when its flag is set (A then k×m, B n×k as stored).
void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// dst[c][r] = src[r][c] for a rows × cols src (rows ld_src apart) into dst (rows ld_dst apart).
void transpose(int64_t rows, int64_t cols, const float* src, int64_t ld_src, float* dst,
               int64_t ld_dst);

}  // namespace fa4::cpu
