// The CPU backend's vectorised row operations (Highway): exponentials, maxima, scaling, softcap,
// the gradient of the scores and fp32 conversion of bf16 / fp16 / e4m3 rows. Each is compiled for
// AVX-512, AVX2 and the baseline instruction set; the first call picks the best the processor has.
// NaN inputs stay NaN through every operation.
#pragma once

#include <cstdint>

#include "common/numeric.hpp"

namespace fa4::cpu::vec {

// x[j] = exp(scale · x[j] − sub) (0 for x[j] = −inf; sub finite or +inf).
void exp(float* x, int64_t n, float scale, float sub);
// x[j] *= a.
void scale(float* x, int64_t n, float a);
// x[j] = cap · tanh(x[j] · scale / cap); with dcap, also dcap[j] = 1 − tanh², the factor dS picks
// up in the backward.
void softcap(float* x, int64_t n, float scale, float cap, float* dcap);
// ds[j] = p[j] · (dp[j] − d) [· dcap[j] when dcap is given]; ds may be p or dp.
void score_grad(const float* p, const float* dp, float d, const float* dcap, float* ds, int64_t n);
// Column operations over the first `cols` columns of a tile of `rows` rows `ld` floats apart: a
// transposed score tile, keys along its rows and query rows along its columns, each column with
// its own max, sum, LSE or D.
// m[c] = max(m[c], x[r][c] for every r).
void col_max(const float* x, int64_t rows, int64_t cols, int64_t ld, float* m);
// x[r][c] = exp(scale · x[r][c] − sub[c]) (sub finite); with sum, sum[c] += Σ_r of the new
// x[r][c].
void col_exp(float* x, int64_t rows, int64_t cols, int64_t ld, float scale, const float* sub,
             float* sum);
// ds[r][c] = p[r][c] · (dp[r][c] − d[c]) [· dcap[r][c] when dcap is given]; one layout for all,
// ds may be p or dp.
void col_score_grad(const float* p, const float* dp, int64_t rows, int64_t cols, int64_t ld,
                    const float* d, const float* dcap, float* ds);
// Σ a[j] · b[j].
float dot(const float* a, const float* b, int64_t n);
// dst[j] = src[j] in fp32.
void to_float(const bf16_t* src, float* dst, int64_t n);
void to_float(const fp16_t* src, float* dst, int64_t n);
void to_float(const e4m3_t* src, float* dst, int64_t n);

// The instruction set the functions above run on: "AVX-512", "AVX2" or "baseline".
const char* isa();

}  // namespace fa4::cpu::vec
