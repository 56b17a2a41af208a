/* The K-quant kinds' scales for the 256-bit x86 kernels (gguf_gemv_avx2.c, gguf_gemv_avxvnni.c),
 * which take a group's 16 rows as two halves of 8. Include after immintrin.h. */
#ifndef KVSERVE_K_SCALES_AVX_H
#define KVSERVE_K_SCALES_AVX_H

/* The K-quant kinds' float scales of half h of a block (gguf_gemv.h): the super-block's fp16
 * scale times the 8 rows' integer scales at p + 8 h (signed or not), exact in float32. */
static inline __attribute__((always_inline)) __m256 k_scale(const uint8_t *sup, const uint8_t *p, const int h,
                                                            const int sgn) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)(p + 8 * h));
    const __m256 n = _mm256_cvtepi32_ps(sgn ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sup + 16 * h))), n);
}

/* -v, the sign bit flipped (as C's unary minus: -0.0 for 0). */
static inline __attribute__((always_inline)) __m256 neg(__m256 v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.f)); }

#endif
