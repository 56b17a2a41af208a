/* Whether a block has one activation part in every row of a pass, for the x86 kernels
 * (gguf_gemv_avx2.c, gguf_gemv_avxvnni.c, gguf_gemv_avx512vnni.c): their ONE_PART test for
 * GGUF_BLOCK_RUNS (gguf_gemv.h). Include after immintrin.h and gguf_gemv.h. */
#ifndef KVSERVE_ONE_PART_AVX_H
#define KVSERVE_ONE_PART_AVX_H

/* Whether rows 0 .. R-1 all have one part in block b (mixed activations: their xb all zero):
 * gguf_xb_zero of each row, by vector. */
static inline __attribute__((always_inline)) int one_part_block(const gguf_acts_t *a, const int R, int64_t nb,
                                                                int64_t b) {
    __m256i xb = _mm256_loadu_si256((const __m256i *)(a->xq + b * 64 + 32));
    for (int r = 1; r < R; r++)
        xb = _mm256_or_si256(xb, _mm256_loadu_si256((const __m256i *)(a->xq + (r * nb + b) * 64 + 32)));
    return _mm256_testz_si256(xb, xb);
}

#endif
