/* The K-quant kinds' scales and the integers of kinds 15 and 26 for the 256-bit x86 kernels
 * (gguf_gemv_avx2.c, gguf_gemv_avxvnni.c), which take a group's 16 rows as two halves of 8, and
 * the 4-bit chunks and block scales both unpack.
 * Include after immintrin.h. */
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

/* Kind 26: rows 8h..8h+7's bytes u of kind 18's chunk c (gguf_k6_byte), from the block's low-bit
 * chunks (q4: the block's integers) and its top-bit chunks. */
static inline __attribute__((always_inline)) __m256i k6_chunk(const uint8_t *q4, const int c, const int h) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(q4 + 64 * (c & 3) + 32 * h));
    const __m256i t = _mm256_loadu_si256((const __m256i *)(q4 + 256 + 64 * (c >> 2) + 32 * h));
    const __m256i lo = _mm256_and_si256(c < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));
    const __m256i hi = (c & 3) == 0 ? _mm256_slli_epi16(t, 4) : (c & 3) == 1 ? _mm256_slli_epi16(t, 2)
                     : (c & 3) == 2 ? t : _mm256_srli_epi16(t, 2);
    return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
}

/* Kind 13: rows 8h..8h+7's bytes u = q + 4 of kind 18's chunk c (gguf_k3_byte), from the block's
 * low-bit chunks (q4: the block's integers) and its high-bit chunk: bits 2(c & 3), 2(c & 3) + 1
 * of low-bit chunk c / 4, and bit c of the high-bit chunk moved to bit 2. */
static inline __attribute__((always_inline)) __m256i k3_chunk(const uint8_t *q4, const int c, const int h) {
    const __m256i l = _mm256_loadu_si256((const __m256i *)(q4 + 64 * (c >> 2) + 32 * h));
    const __m256i t = _mm256_loadu_si256((const __m256i *)(q4 + 128 + 32 * h));
    const int sh = 2 * (c & 3);
    const __m256i lo = _mm256_and_si256(sh == 0 ? l : sh == 2 ? _mm256_srli_epi16(l, 2) : sh == 4 ? _mm256_srli_epi16(l, 4)
                                                                                               : _mm256_srli_epi16(l, 6),
                                        _mm256_set1_epi8(0x03));
    const __m256i hi = c == 0 ? _mm256_slli_epi16(t, 2) : c == 1 ? _mm256_slli_epi16(t, 1)
                     : c == 2 ? t : _mm256_srli_epi16(t, c - 2);
    return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x04)));
}

/* Kind 24: rows 8h..8h+7's bytes value + 128 of kind 8's chunk c (gguf_x4_byte): the nibbles of
 * chunk c & 3 (low: c < 4, high: c >= 4) looked up by vpshufb in the table of value + 128. */
static inline __attribute__((always_inline)) __m256i x4_chunk(const uint8_t *q4, const int c, const int h) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(q4 + 64 * (c & 3) + 32 * h));
    const __m256i idx = _mm256_and_si256(c < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));
    const __m256i table = _mm256_xor_si256(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)gguf_iq4_values)),
                                           _mm256_set1_epi8((char)0x80));
    return _mm256_shuffle_epi8(table, idx);
}

/* Kind 15: rows 8h..8h+7's top bits (bit 4 of q) of kind 18's chunk c, in place for an OR with
 * the chunk's 4 low bits: bit c of the block's top-bit chunk (q4: the block's integers) moved to
 * bit 4. */
static inline __attribute__((always_inline)) __m256i k5_top(const uint8_t *q4, const int c, const int h) {
    const __m256i t = _mm256_loadu_si256((const __m256i *)(q4 + 256 + 32 * h));
    return _mm256_and_si256(c < 4 ? _mm256_slli_epi16(t, 4 - c) : _mm256_srli_epi16(t, c - 4),
                            _mm256_set1_epi8(0x10));
}

/* -v, the sign bit flipped (as C's unary minus: -0.0 for 0). */
static inline __attribute__((always_inline)) __m256 neg(__m256 v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.f)); }

/* Chunk c of a 4-bit block (kinds 4, 14, 15; wg: the block) as bytes: its 64 bytes hold the low
 * nibbles q[4c .. 4c+3] and the high nibbles q[4c+16 .. 4c+19] of rows 0..7 (first 32 bytes) and
 * 8..15. w[0], w[1]: the low nibbles of rows 0..7 and 8..15; w[2], w[3]: the high ones (kind 15:
 * each with its top bit). */
static inline __attribute__((always_inline)) void nibble_chunk(const uint8_t *wg, const int kind, const int c,
                                                               __m256i w[4]) {
    const int64_t qo = gguf_ints_offset(kind);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i v0 = _mm256_loadu_si256((const __m256i *)(wg + qo + 64 * c));
    const __m256i v1 = _mm256_loadu_si256((const __m256i *)(wg + qo + 64 * c + 32));
    w[0] = _mm256_and_si256(v0, low4);
    w[1] = _mm256_and_si256(v1, low4);
    w[2] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
    w[3] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
    if (kind == GGUF_K5) {
        w[0] = _mm256_or_si256(w[0], k5_top(wg + qo, c, 0));
        w[1] = _mm256_or_si256(w[1], k5_top(wg + qo, c, 1));
        w[2] = _mm256_or_si256(w[2], k5_top(wg + qo, c + 4, 0));
        w[3] = _mm256_or_si256(w[3], k5_top(wg + qo, c + 4, 1));
    }
}

/* A block's float scale of sum k (kinds 18, 19, 26: the halves of its weights, k = 0, 1; other
 * kinds: k = 0) for rows half h. */
static inline __attribute__((always_inline)) __m256 block_scale(const uint8_t *wg, const int kind, int64_t nb,
                                                                int64_t b, const int k, const int h) {
    return kind == GGUF_Q4 || kind == GGUF_Q8 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wg + 16 * h)))
         : kind == GGUF_F8 ? _mm256_loadu_ps((const float *)(wg + 64 * k + 32 * h))
                           : k_scale(gguf_super_scales(wg, kind, nb, b), wg + 16 * k, h, !gguf_nibble_kind(kind));
}

/* A block's m for rows half h (the kinds that have one: not 8, 26, 13, 24). */
static inline __attribute__((always_inline)) __m256 block_min(const uint8_t *wg, const int kind, int64_t nb, int64_t b,
                                                              const int h) {
    return kind == GGUF_Q4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wg + 32 + 16 * h)))
         : kind == GGUF_F8 ? _mm256_loadu_ps((const float *)(wg + 128 + 32 * h))
                           : neg(k_scale(gguf_super_scales(wg, kind, nb, b) + 32, wg + (gguf_nibble_kind(kind) ? 16 : 32),
                                         h, 0));
}

#endif
