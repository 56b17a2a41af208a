/* The float32 tile of gguf_gemv.h in 256-bit registers (AVX2 + FMA), shared by the AVX2 and the
 * AVX-VNNI builds (their integer kernels differ, their float32 FMA work does not). Include once,
 * from one kernel file, with -mavx2 -mfma. */
#ifndef KVSERVE_F32_TILE_AVX2_H
#define KVSERVE_F32_TILE_AVX2_H

#include <immintrin.h>

#include "gguf_gemv.h"

/* The float32 tile (gguf_gemv.h): the 32 rows of two groups are four 256-bit vectors; each k is
 * four weight loads, F32_T broadcasts and 4 F32_T fused multiply-adds (4 F32_T = 12 accumulators
 * of the 16 registers). The accumulators are named variables: kept in an array, GCC 12 stores
 * eight of them to the stack on every k (dead stores that the store port then paces). */
#define F32_T 3

int gguf_f32_tile_rows(void) { return F32_T; }

void gguf_tile_f32(const float *wt, const float *xp, int64_t kc, int cont, float *acc) {
#define LD(r, v) (cont ? _mm256_loadu_ps(acc + (r) * GGUF_F32_N + 8 * (v)) : _mm256_setzero_ps())
    __m256 a00 = LD(0, 0), a01 = LD(0, 1), a02 = LD(0, 2), a03 = LD(0, 3);
    __m256 a10 = LD(1, 0), a11 = LD(1, 1), a12 = LD(1, 2), a13 = LD(1, 3);
    __m256 a20 = LD(2, 0), a21 = LD(2, 1), a22 = LD(2, 2), a23 = LD(2, 3);
#undef LD
    for (int64_t k = 0; k < kc; k++, wt += GGUF_F32_N, xp += F32_T) {
        const __m256 w0 = _mm256_load_ps(wt), w1 = _mm256_load_ps(wt + 8), w2 = _mm256_load_ps(wt + 16),
                     w3 = _mm256_load_ps(wt + 24);
        __m256 xv = _mm256_broadcast_ss(xp);
        a00 = _mm256_fmadd_ps(w0, xv, a00); a01 = _mm256_fmadd_ps(w1, xv, a01);
        a02 = _mm256_fmadd_ps(w2, xv, a02); a03 = _mm256_fmadd_ps(w3, xv, a03);
        xv = _mm256_broadcast_ss(xp + 1);
        a10 = _mm256_fmadd_ps(w0, xv, a10); a11 = _mm256_fmadd_ps(w1, xv, a11);
        a12 = _mm256_fmadd_ps(w2, xv, a12); a13 = _mm256_fmadd_ps(w3, xv, a13);
        xv = _mm256_broadcast_ss(xp + 2);
        a20 = _mm256_fmadd_ps(w0, xv, a20); a21 = _mm256_fmadd_ps(w1, xv, a21);
        a22 = _mm256_fmadd_ps(w2, xv, a22); a23 = _mm256_fmadd_ps(w3, xv, a23);
    }
#define ST(r, v, x) _mm256_storeu_ps(acc + (r) * GGUF_F32_N + 8 * (v), x)
    ST(0, 0, a00); ST(0, 1, a01); ST(0, 2, a02); ST(0, 3, a03);
    ST(1, 0, a10); ST(1, 1, a11); ST(1, 2, a12); ST(1, 3, a13);
    ST(2, 0, a20); ST(2, 1, a21); ST(2, 2, a22); ST(2, 3, a23);
#undef ST
}

#endif
