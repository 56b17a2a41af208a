/* gguf_group_dot (gguf_gemv.h) for AVX2 (Haswell and later, AMD Zen): a 256-bit register holds
 * 4 weights of 8 rows, so a group of 16 rows is two halves. AVX2 has no vpdpbusd: vpmaddubsw
 * multiplies u8 weights by s8 activations into pairs summed in int16, vpmaddwd widens to int32.
 *   4-bit kinds (q in 0..15): a pair is at most 2 * 15 * 127 = 3810, so the 8 chunks of a block
 *       add up in int16 (<= 30480) before one widening per part.
 *   8-bit kinds: the stored u8 (q + 128) times an s8 part would saturate vpmaddubsw's int16
 *       (255 * 127 * 2). They take both parts at once instead: the weights widened to 16 bits
 *       times x16 = 256 xa + xb (an int16) by vpmaddwd, then 128 sum x16 (sq) taken off: half the
 *       operations of two signed-byte passes, which needed vpabsb/vpsignb per chunk and part.
 * Both give the exact integer s, so the results are the portable kernel's, bit for bit.
 * Build: -mavx2 -mfma -mf16c (x86-64-v3). */
#include <immintrin.h>
#include <string.h>

#include "gguf_gemv.h"

const char *gguf_kernel_isa(void) { return "avx2"; }

#define R_MAX 4     /* activation rows per pass here: 2 * R_MAX accumulators + 8 weight registers */

/* int32 [8 rows] of sum_j q_j x_j over one part (xa or xb) of a Q4 block: q[c] = weights
 * 4c..4c+3 of 8 rows (u8 0..15), x = the part's 32 s8 values. */
static inline __attribute__((always_inline)) __m256i dot_q4(const __m256i q[8], const int8_t *x) {
    const int32_t *x4 = (const int32_t *)x;
    __m256i s16 = _mm256_maddubs_epi16(q[0], _mm256_set1_epi32(x4[0]));
    for (int c = 1; c < 8; c++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(q[c], _mm256_set1_epi32(x4[c])));
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
}

/* The 8 rows' int32 sums of u_j x16_j over chunks c0 .. c1 - 1 of one half of an 8-bit block,
 * u = q + 128 as stored (w: the half's chunks, 64 bytes apart), x16 = the block's 32 values of
 * 256 xa + xb: vpmaddwd multiplies the zero-extended weights by x16 in 16-bit lanes, 2 weights
 * a lane pair (<= 2 * 255 * 32639, and <= 32 of those a block: int32). lo holds rows 0..3 and hi
 * rows 4..7, two partial sums a row, joined at the end. */
static inline __attribute__((always_inline)) __m256i
dot_q8(const uint8_t *w, const int16_t *x16, const int c0, const int c1) {
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int c = c0; c < c1; c++) {
        int64_t x4;
        memcpy(&x4, x16 + 4 * c, 8);
        const __m256i x = _mm256_set1_epi64x(x4);
        lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + 64 * c))), x));
        hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + 64 * c + 16))), x));
    }
    /* hadd: rows 0 1 4 5 | 2 3 6 7 (64-bit pairs), put in order */
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(lo, hi), 0xD8);
}

/* s = sum_j q_j x16_j from the stored u = q + 128: minus 128 sum_j x16_j (sq). */
static inline __attribute__((always_inline)) __m256 unbias(__m256i su, int32_t sq) {
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(su, _mm256_set1_epi32(128 * sq)));
}

static inline __attribute__((always_inline)) __m256 two_parts(__m256i sa, __m256i sb) {
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(sa, 8), sb));
}

/* One half (8 rows, h) of a group against R activation rows. The halves run one after the other
 * over the group's blocks (the second re-reads them from L1): with both at once the 2 R
 * accumulators, 8 weight registers and temporaries exceed the 16 registers and spill. */
static inline __attribute__((always_inline)) void
half_dot(const uint8_t *wg, const int kind, int64_t nb, const gguf_acts_t *a, const int R, const int h, float *out) {
    __m256 acc[R_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const int64_t pb = gguf_packed_block_bytes(kind), qo = gguf_ints_offset(kind);
    if (kind == GGUF_Q4 || kind == GGUF_K4) {
        const __m256i low4 = _mm256_set1_epi8(0x0f);
        for (int64_t b = 0; b < nb; b++, wg += pb) {
            if (h == 0) gguf_prefetch_block(wg, pb);
            const __m256 d = kind == GGUF_Q4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wg + 16 * h)))
                                             : _mm256_loadu_ps((const float *)(wg + 32 * h));
            const __m256 m = kind == GGUF_Q4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wg + 32 + 16 * h)))
                                             : _mm256_loadu_ps((const float *)(wg + 64 + 32 * h));
            __m256i q[8];
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wg + qo + 64 * c + 32 * h));
                q[c] = _mm256_and_si256(v, low4);
                q[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            }
            for (int r = 0; r < R; r++) {
                const int64_t rb = r * nb + b;
                const int8_t *x = a->xq + rb * 64;
                const __m256 s = two_parts(dot_q4(q, x), dot_q4(q, x + 32));
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(s, _mm256_mul_ps(d, _mm256_set1_ps(a->dx[rb]))));
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(m, _mm256_set1_ps(a->sx[rb])));
            }
        }
    } else if (kind == GGUF_Q8) {
        for (int64_t b = 0; b < nb; b++, wg += pb) {
            if (h == 0) gguf_prefetch_block(wg, pb);
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wg + 16 * h)));
            for (int r = 0; r < R; r++) {
                const int64_t rb = r * nb + b;
                const __m256 s = unbias(dot_q8(wg + qo + 32 * h, a->x16 + rb * 32, 0, 8), a->sq[rb]);
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(s, _mm256_mul_ps(d, _mm256_set1_ps(a->dx[rb]))));
            }
        }
    } else {                                   /* GGUF_K8: a scale per half of the block, then m */
        for (int64_t b = 0; b < nb; b++, wg += pb) {
            if (h == 0) gguf_prefetch_block(wg, pb);
            const __m256 d0 = _mm256_loadu_ps((const float *)(wg + 32 * h));
            const __m256 d1 = _mm256_loadu_ps((const float *)(wg + 64 + 32 * h));
            const __m256 m = _mm256_loadu_ps((const float *)(wg + 128 + 32 * h));
            for (int r = 0; r < R; r++) {
                const int64_t rb = r * nb + b;
                const __m256 dx = _mm256_set1_ps(a->dx[rb]);
                const int16_t *x16 = a->x16 + rb * 32;
                const __m256 s0 = unbias(dot_q8(wg + qo + 32 * h, x16, 0, 4), a->sq0[rb]);
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(s0, _mm256_mul_ps(d0, dx)));
                const __m256 s1 = unbias(dot_q8(wg + qo + 32 * h, x16, 4, 8), a->sq[rb] - a->sq0[rb]);
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(s1, _mm256_mul_ps(d1, dx)));
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(m, _mm256_set1_ps(a->sx[rb])));
            }
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * GGUF_ROWS + 8 * h, acc[r]);
}

static inline __attribute__((always_inline)) void
group_dot(const uint8_t *wg, const int kind, int64_t nb, const gguf_acts_t *a, const int R, float *out) {
    half_dot(wg, kind, nb, a, R, 0, out);
    half_dot(wg, kind, nb, a, R, 1, out);
}

#define ROWS(K) switch (R) {   /* R as a constant: the accumulators stay in registers */ \
        case 1: group_dot(wg, K, nb, a, 1, out); break;                                \
        case 2: group_dot(wg, K, nb, a, 2, out); break;                                \
        case 3: group_dot(wg, K, nb, a, 3, out); break;                                \
        default: group_dot(wg, K, nb, a, R_MAX, out); break;                           \
    }

static void group_dot_upto4(const uint8_t *wg, int64_t kind, int64_t nb, const gguf_acts_t *a, int R, float *out) {
    switch (kind) {   /* and the kind: one specialized loop each */
        case GGUF_Q4: ROWS(GGUF_Q4); break;
        case GGUF_Q8: ROWS(GGUF_Q8); break;
        case GGUF_K4: ROWS(GGUF_K4); break;
        default: ROWS(GGUF_K8); break;
    }
}

void gguf_group_dot(const uint8_t *wg, int64_t kind, int64_t nb, const gguf_acts_t *a, int R, float *out) {
    /* Rows past R_MAX re-read the group's weights from L1 (they are a few KB). */
    for (int r0 = 0; r0 < R; r0 += R_MAX) {
        const gguf_acts_t ar = gguf_acts_from_row(a, r0, nb);
        group_dot_upto4(wg, kind, nb, &ar, R - r0 < R_MAX ? R - r0 : R_MAX, out + r0 * GGUF_ROWS);
    }
}

#include "f32_tile_avx2.h"
