/* gguf_group_dot (gguf_gemv.h) for AVX-VNNI: Intel Alder Lake and later client chips (Core 12th
 * generation on, which have no AVX-512), Sierra Forest and Arrow Lake alike. vpdpbusd on 256-bit
 * registers multiplies 4 u8 weights of each of 8 rows by 4 s8 activation bytes and adds the
 * products into that row's int32 lane, exactly: one instruction where AVX2 needs vpmaddubsw,
 * vpmaddwd and an add, and no int16 stage to saturate. A group of 16 rows is two halves, run in
 * turn as in the AVX2 kernel (8 weight registers and 4 rows' accumulators fill the 16 registers).
 *   4-bit kinds (q in 0..15): the nibbles are the u8 operand as they are.
 *   8-bit kinds: the stored u8 is q + 128, so the sums carry 128 sum(x); the precomputed sq takes
 *       it off (kind 18: sq0 and sq - sq0, one per half), as in the AVX-512 VNNI kernel.
 * The integer sums are exact and the float steps are the AVX2 kernel's, in its order: the
 * results are the portable kernel's, bit for bit. The float32 tile is the AVX2 one
 * (f32_tile_avx2.h).
 * Build: -mavx2 -mfma -mf16c -mavxvnni. On a CPU with AVX-512 VNNI and AVX-512VL the same code
 * runs with the EVEX encoding of the instruction (-mavx512vnni -mavx512vl, no -mavxvnni): that is
 * how the tests execute it on hosts without AVX-VNNI (tests/unit/test_avxvnni_kernel.py). */
#include <immintrin.h>

#include "gguf_gemv.h"

#if defined(__AVXVNNI__)
#define DPBUSD(acc, u8s, s8s) _mm256_dpbusd_avx_epi32(acc, u8s, s8s)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u8s, s8s) _mm256_dpbusd_epi32(acc, u8s, s8s)
#else
#error "gguf_gemv_avxvnni.c needs -mavxvnni (or -mavx512vnni -mavx512vl to test it on AVX-512 hosts)"
#endif

const char *gguf_kernel_isa(void) { return "avxvnni"; }

#define R_MAX 4     /* activation rows per pass: R_MAX accumulators + 8 weight registers */

/* 256 sum_j u_j xa_j + sum_j u_j xb_j for one half's 8 rows over chunks c0 .. c1 - 1: u[c] holds
 * weights 4c..4c+3 of each row (as u8), x the block's 32 xa then 32 xb. */
static inline __attribute__((always_inline)) __m256i
dot_two_parts(const __m256i u[8], const int8_t *x, const int c0, const int c1) {
    const int32_t *xa = (const int32_t *)x, *xb = xa + 8;
    __m256i sa = _mm256_setzero_si256(), sb = _mm256_setzero_si256();
    for (int c = c0; c < c1; c++) {
        sa = DPBUSD(sa, u[c], _mm256_set1_epi32(xa[c]));
        sb = DPBUSD(sb, u[c], _mm256_set1_epi32(xb[c]));
    }
    return _mm256_add_epi32(_mm256_slli_epi32(sa, 8), sb);
}

static inline __attribute__((always_inline)) void
half_dot(const uint8_t *wg, const int kind, int64_t nb, const gguf_acts_t *a, const int R, const int h, float *out) {
    __m256 acc[R_MAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const int64_t pb = gguf_packed_block_bytes(kind), qo = gguf_ints_offset(kind);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; b++, wg += pb) {
        if (h == 0) gguf_prefetch_block(wg, pb);
        __m256i u[8];
        if (kind == GGUF_Q4 || kind == GGUF_K4) {
            const __m256 d = kind == GGUF_Q4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wg + 16 * h)))
                                             : _mm256_loadu_ps((const float *)(wg + 32 * h));
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wg + qo + 64 * c + 32 * h));
                u[c] = _mm256_and_si256(v, low4);
                u[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            }
            const __m256 m = kind == GGUF_Q4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wg + 32 + 16 * h)))
                                             : _mm256_loadu_ps((const float *)(wg + 64 + 32 * h));
            for (int r = 0; r < R; r++) {
                const int64_t rb = r * nb + b;
                const __m256 s = _mm256_cvtepi32_ps(dot_two_parts(u, a->xq + rb * 64, 0, 8));
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(s, _mm256_mul_ps(d, _mm256_set1_ps(a->dx[rb]))));
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(m, _mm256_set1_ps(a->sx[rb])));
            }
        } else if (kind == GGUF_Q8) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wg + 16 * h)));
            for (int c = 0; c < 8; c++) u[c] = _mm256_loadu_si256((const __m256i *)(wg + qo + 64 * c + 32 * h));
            for (int r = 0; r < R; r++) {
                const int64_t rb = r * nb + b;
                const __m256i si = _mm256_sub_epi32(dot_two_parts(u, a->xq + rb * 64, 0, 8),
                                                    _mm256_set1_epi32(128 * a->sq[rb]));
                const __m256 s = _mm256_cvtepi32_ps(si);
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(s, _mm256_mul_ps(d, _mm256_set1_ps(a->dx[rb]))));
            }
        } else {                               /* GGUF_K8: a scale per half of the block, then m */
            const __m256 d0 = _mm256_loadu_ps((const float *)(wg + 32 * h));
            const __m256 d1 = _mm256_loadu_ps((const float *)(wg + 64 + 32 * h));
            const __m256 m = _mm256_loadu_ps((const float *)(wg + 128 + 32 * h));
            for (int c = 0; c < 8; c++) u[c] = _mm256_loadu_si256((const __m256i *)(wg + qo + 64 * c + 32 * h));
            for (int r = 0; r < R; r++) {
                const int64_t rb = r * nb + b;
                const int8_t *x = a->xq + rb * 64;
                const __m256 dx = _mm256_set1_ps(a->dx[rb]);
                const __m256 s0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(dot_two_parts(u, x, 0, 4),
                                                                       _mm256_set1_epi32(128 * a->sq0[rb])));
                const __m256 s1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(dot_two_parts(u, x, 4, 8),
                                                                       _mm256_set1_epi32(128 * (a->sq[rb] - a->sq0[rb]))));
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(s0, _mm256_mul_ps(d0, dx)));
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(s1, _mm256_mul_ps(d1, dx)));
                acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(m, _mm256_set1_ps(a->sx[rb])));
            }
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * GGUF_ROWS + 8 * h, acc[r]);
}

#define ROWS(K) switch (R) {   /* R as a constant: the accumulators stay in registers */               \
        case 1: half_dot(wg, K, nb, a, 1, 0, out); half_dot(wg, K, nb, a, 1, 1, out); break;          \
        case 2: half_dot(wg, K, nb, a, 2, 0, out); half_dot(wg, K, nb, a, 2, 1, out); break;          \
        case 3: half_dot(wg, K, nb, a, 3, 0, out); half_dot(wg, K, nb, a, 3, 1, out); break;          \
        default: half_dot(wg, K, nb, a, R_MAX, 0, out); half_dot(wg, K, nb, a, R_MAX, 1, out); break; \
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
