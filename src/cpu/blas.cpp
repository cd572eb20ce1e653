#include "cpu/blas.hpp"

#include <cblas.h>

#include <mutex>

namespace fa4::cpu {

void gemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  // The library's own copy of OpenBLAS runs each product on the calling worker alone.
  static std::once_flag one_thread;
  std::call_once(one_thread, [] { openblas_set_num_threads(1); });
  cblas_sgemm(CblasRowMajor, transpose_a ? CblasTrans : CblasNoTrans,
              transpose_b ? CblasTrans : CblasNoTrans, blasint(m), blasint(n), blasint(k), 1.0f,
              a, blasint(lda), b, blasint(ldb), beta, c, blasint(ldc));
}

void transpose(int64_t rows, int64_t cols, const float* src, int64_t ld_src, float* dst,
               int64_t ld_dst) {
  if (rows == 0 || cols == 0) return;
  cblas_somatcopy(CblasRowMajor, CblasTrans, blasint(rows), blasint(cols), 1.0f, src,
                  blasint(ld_src), dst, blasint(ld_dst));
}

}  // namespace fa4::cpu
