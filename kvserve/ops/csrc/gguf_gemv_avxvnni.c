/* gguf_group_dot (gguf_gemv.h) for AVX-VNNI: Intel Alder Lake and later client chips (Core 12th
 * generation on, which have no AVX-512), Sierra Forest and Arrow Lake alike. vpdpbusd on 256-bit
 * registers multiplies 4 u8 weights of each of 8 rows by 4 s8 activation bytes and adds the
 * products into that row's int32 lane, exactly: one instruction where AVX2 needs vpmaddubsw,
 * vpmaddwd and an add, and no int16 stage to saturate. A group of 16 rows is two halves, run in
 * turn as in the AVX2 kernel (8 weight registers and 4 rows' accumulators fill the 16 registers).
 *   4-bit kinds (q in 0..15): the nibbles are the u8 operand as they are.
 *   8-bit kinds: the stored u8 is q + 128, so the sums carry 128 sum(x); the precomputed sq takes
 *       it off (kind 18: sq0 and sq - sq0, one per half), as in the AVX-512 VNNI kernel.
 * Both parts are multiplied apart for every kind, so with mixed parts the blocks whose xb are all
 * zero skip the xb products (rows_dot: the AVX2 kernel's runs of one-part blocks).
 * The integer sums are exact and the float steps are the AVX2 kernel's, in its order: the
 * results are the portable kernel's, bit for bit. The float32 tile is the AVX2 one
 * (f32_tile_avx2.h).
 * Build: -mavx2 -mfma -mf16c -mavxvnni. On a CPU with AVX-512 VNNI and AVX-512VL the same code
 * runs with the EVEX encoding of the instruction (-mavx512vnni -mavx512vl, no -mavxvnni): that is
 * how the tests execute it on hosts without AVX-VNNI (tests/unit/test_avxvnni_kernel.py). */
#include <immintrin.h>

#include "gguf_gemv.h"
#include "k_scales_avx.h"
#include "one_part_avx.h"

#if defined(__AVXVNNI__)
#define DPBUSD(acc, u8s, s8s) _mm256_dpbusd_avx_epi32(acc, u8s, s8s)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u8s, s8s) _mm256_dpbusd_epi32(acc, u8s, s8s)
#else
#error "gguf_gemv_avxvnni.c needs -mavxvnni (or -mavx512vnni -mavx512vl to test it on AVX-512 hosts)"
#endif

const char *gguf_kernel_isa(void) { return "avxvnni"; }

#define R_MAX 2     /* activation rows per pass (above; group_dot_pairs.h runs them) */

/* Keep the sums in registers in the order written (gguf_gemv_avx2.c). */
#define KEEP_ORDER(v) __asm__("" : "+x"(v))

/* 256 sum_j u_j xa_j + sum_j u_j xb_j, less 128 sq for 8-bit kinds (their u = q + 128). */
static inline __attribute__((always_inline)) __m256 two_parts(__m256i sa, __m256i sb, int32_t unbias) {
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_add_epi32(_mm256_slli_epi32(sa, 8), sb), _mm256_set1_epi32(unbias)));
}

/* two_parts with sb = 0 (a one-part block): the same integer, the same float. */
static inline __attribute__((always_inline)) __m256 one_part(__m256i sa, int32_t unbias) {
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_slli_epi32(sa, 8), _mm256_set1_epi32(unbias)));
}


/* Block b of a group (16 rows; wg: the block) of any kind against R <= 2 activation rows, added
 * to acc. Per chunk c: 4-bit kinds hold the low nibbles q[4c .. 4c+3] and the high ones
 * q[4c+16 .. 4c+19] of rows 0..7, then 8..15 (four u8 registers once unpacked), multiplied by xa
 * and xb at 4c and 4c + 16; 8-bit kinds hold u = q[4c .. 4c+3] + 128 of rows 0..7, then 8..15
 * (two registers), times xa and xb at 4c. Kind 18 closes its first sums after chunk 3 (weights
 * 0..15, scale d0), then sums chunks 4..7 (d1). P = 1 (every xb of the block zero): the xa
 * products only, half the vpdpbusd of every kind (8-bit kinds too: they multiply the parts
 * apart, not x16), and one_part gives what two_parts gives with sb = 0. */
static inline __attribute__((always_inline)) void
block_dot(const uint8_t *wg, const int kind, int64_t nb, int64_t b, const gguf_acts_t *a, const int R, const int P,
          __m256 acc[R_MAX][2]) {
    const int64_t qo = gguf_ints_offset(kind);
    const int four = gguf_nibble_kind(kind);
    const int sums = gguf_two_halves(kind) ? 2 : 1, cn = four ? 4 : 8 / sums;   /* chunks per sum */
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    #pragma GCC unroll 2
    for (int k = 0; k < sums; k++) {
        __m256i s[R_MAX][2][2];                    /* [row][part xa | xb][half] */
        for (int r = 0; r < R; r++)
            for (int p = 0; p < P; p++) s[r][p][0] = s[r][p][1] = _mm256_setzero_si256();
        #pragma GCC unroll 8   /* c a constant: the compact kinds' unpacking shifts by immediates */
        for (int c = k * cn; c < k * cn + cn; c++) {
            const __m256i v0 = kind == GGUF_K6 ? k6_chunk(wg + qo, c, 0) : kind == GGUF_K3 ? k3_chunk(wg + qo, c, 0)
                             : kind == GGUF_X4 ? x4_chunk(wg + qo, c, 0)
                                               : _mm256_loadu_si256((const __m256i *)(wg + qo + 64 * c));
            const __m256i v1 = kind == GGUF_K6 ? k6_chunk(wg + qo, c, 1) : kind == GGUF_K3 ? k3_chunk(wg + qo, c, 1)
                             : kind == GGUF_X4 ? x4_chunk(wg + qo, c, 1)
                                               : _mm256_loadu_si256((const __m256i *)(wg + qo + 64 * c + 32));
            __m256i lo0 = four ? _mm256_and_si256(v0, low4) : v0;
            __m256i lo1 = four ? _mm256_and_si256(v1, low4) : v1;
            __m256i hi0 = four ? _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4) : v0;
            __m256i hi1 = four ? _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4) : v1;
            if (kind == GGUF_K5) {
                lo0 = _mm256_or_si256(lo0, k5_top(wg + qo, c, 0));
                lo1 = _mm256_or_si256(lo1, k5_top(wg + qo, c, 1));
                hi0 = _mm256_or_si256(hi0, k5_top(wg + qo, c + 4, 0));
                hi1 = _mm256_or_si256(hi1, k5_top(wg + qo, c + 4, 1));
            }
            for (int r = 0; r < R; r++) {
                const int32_t *x4 = (const int32_t *)(a->xq + (r * nb + b) * 64);
                for (int p = 0; p < P; p++) {
                    const __m256i xl = _mm256_set1_epi32(x4[8 * p + c]);
                    s[r][p][0] = DPBUSD(s[r][p][0], lo0, xl);
                    s[r][p][1] = DPBUSD(s[r][p][1], lo1, xl);
                    if (four) {
                        const __m256i xh = _mm256_set1_epi32(x4[8 * p + c + 4]);
                        s[r][p][0] = DPBUSD(s[r][p][0], hi0, xh);
                        s[r][p][1] = DPBUSD(s[r][p][1], hi1, xh);
                    }
                    KEEP_ORDER(s[r][p][0]);
                    KEEP_ORDER(s[r][p][1]);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d = kind == GGUF_Q4 || kind == GGUF_Q8
                                 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wg + 16 * h)))
                             : kind == GGUF_F8 ? _mm256_loadu_ps((const float *)(wg + 64 * k + 32 * h))
                                 : k_scale(gguf_super_scales(wg, kind, nb, b), wg + 16 * k, h, !four);
            for (int r = 0; r < R; r++) {
                const int64_t rb = r * nb + b;
                const int32_t sq = four ? 0 : sums == 1 ? a->sq[rb] : k == 0 ? a->sq0[rb] : a->sq[rb] - a->sq0[rb];
                const int32_t bias = (kind == GGUF_K6 ? 32 : kind == GGUF_K3 ? 4 : 128) * sq;   /* the stored u less q */
                const __m256 sf = P == 2 ? two_parts(s[r][0][h], s[r][1][h], bias) : one_part(s[r][0][h], bias);
                acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(sf, _mm256_mul_ps(d, _mm256_set1_ps(a->dx[rb]))));
            }
        }
    }
    if (kind != GGUF_Q8 && !gguf_no_min_super(kind))
        for (int h = 0; h < 2; h++) {
            const __m256 m = kind == GGUF_Q4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wg + 32 + 16 * h)))
                           : kind == GGUF_F8 ? _mm256_loadu_ps((const float *)(wg + 128 + 32 * h))
                           : neg(k_scale(gguf_super_scales(wg, kind, nb, b) + 32, wg + (four ? 16 : 32), h, 0));
            for (int r = 0; r < R; r++)
                acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(m, _mm256_set1_ps(a->sx[r * nb + b])));
        }
}

/* A group against R <= 2 activation rows, block by block (block_dot), with mixed parts in runs of
 * one-part blocks (GGUF_BLOCK_RUNS). */
static inline __attribute__((always_inline)) void
rows_dot(const uint8_t *wg, const int kind, int64_t nb, const gguf_acts_t *a, const int R, const int P, float *out) {
    __m256 acc[R_MAX][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    GGUF_BLOCK_RUNS(block_dot, one_part_block, wg, kind, nb, a, R, P, acc);
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + r * GGUF_ROWS + 8 * h, acc[r][h]);
}

#include "group_dot_pairs.h"

void gguf_group_dot(const uint8_t *wg, int64_t kind, int64_t nb, const gguf_acts_t *a, int R, float *out) {
    group_dot_in_pairs(wg, kind, nb, a, R, out);
}

#include "f32_tile_avx2.h"
