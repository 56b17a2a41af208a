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
 * zero skip the xb products (rows_dot: the AVX2 kernel's runs of one-part blocks), and tiles of
 * more than 2 rows unpack each block once for all their passes (ready_group_avx.h).
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


/* Chunk c of a block (wg: its bytes) as the u8 operands of vpdpbusd. 4-bit kinds: nibble_chunk's
 * w[0], w[1] multiplied by xa and xb at 4c, w[2], w[3] at 4c + 16. 8-bit kinds: u = q[4c .. 4c+3]
 * + 128 (kinds 26, 13, 24: their u) of rows 0..7 and 8..15 in w[0], w[1]. */
static inline __attribute__((always_inline)) void vnni_chunk(const uint8_t *wg, const int kind, const int c,
                                                             __m256i w[4]) {
    if (gguf_nibble_kind(kind)) {
        nibble_chunk(wg, kind, c, w);
        return;
    }
    const int64_t qo = gguf_ints_offset(kind);
    w[0] = kind == GGUF_K6 ? k6_chunk(wg + qo, c, 0) : kind == GGUF_K3 ? k3_chunk(wg + qo, c, 0)
         : kind == GGUF_X4 ? x4_chunk(wg + qo, c, 0)
                           : _mm256_loadu_si256((const __m256i *)(wg + qo + 64 * c));
    w[1] = kind == GGUF_K6 ? k6_chunk(wg + qo, c, 1) : kind == GGUF_K3 ? k3_chunk(wg + qo, c, 1)
         : kind == GGUF_X4 ? x4_chunk(wg + qo, c, 1)
                           : _mm256_loadu_si256((const __m256i *)(wg + qo + 64 * c + 32));
}

/* Chunk c (w: vnni_chunk's) of block b against R <= 2 activation rows, its products added to
 * s[row][part xa | xb][half]. */
static inline __attribute__((always_inline)) void
vnni_products(const __m256i w[4], const int kind, const int c, const gguf_acts_t *a, int64_t nb, int64_t b,
              const int R, const int P, __m256i s[R_MAX][2][2]) {
    for (int r = 0; r < R; r++) {
        const int32_t *x4 = (const int32_t *)(a->xq + (r * nb + b) * 64);
        for (int p = 0; p < P; p++) {
            const __m256i xl = _mm256_set1_epi32(x4[8 * p + c]);
            s[r][p][0] = DPBUSD(s[r][p][0], w[0], xl);
            s[r][p][1] = DPBUSD(s[r][p][1], w[1], xl);
            if (gguf_nibble_kind(kind)) {
                const __m256i xh = _mm256_set1_epi32(x4[8 * p + c + 4]);
                s[r][p][0] = DPBUSD(s[r][p][0], w[2], xh);
                s[r][p][1] = DPBUSD(s[r][p][1], w[3], xh);
            }
            KEEP_ORDER(s[r][p][0]);
            KEEP_ORDER(s[r][p][1]);
        }
    }
}

static inline __attribute__((always_inline)) int vnni_has_min(const int kind) {
    return kind != GGUF_Q8 && !gguf_no_min_super(kind);
}

/* Sum k's integers s (d: its scale per rows half) into acc: s less the stored bias times the
 * part's sq (8-bit kinds), 256 sa + sb (one_part: sb = 0), times d dx. */
static inline __attribute__((always_inline)) void
vnni_finish(__m256i s[R_MAX][2][2], const __m256 d[2], const int k, const int kind, const gguf_acts_t *a, int64_t nb,
            int64_t b, const int R, const int P, __m256 acc[R_MAX][2]) {
    const int four = gguf_nibble_kind(kind), sums = gguf_two_halves(kind) ? 2 : 1;
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < R; r++) {
            const int64_t rb = r * nb + b;
            const int32_t sq = four ? 0 : sums == 1 ? a->sq[rb] : k == 0 ? a->sq0[rb] : a->sq[rb] - a->sq0[rb];
            const int32_t bias = (kind == GGUF_K6 ? 32 : kind == GGUF_K3 ? 4 : 128) * sq;   /* the stored u less q */
            const __m256 sf = P == 2 ? two_parts(s[r][0][h], s[r][1][h], bias) : one_part(s[r][0][h], bias);
            acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(sf, _mm256_mul_ps(d[h], _mm256_set1_ps(a->dx[rb]))));
        }
}

/* The m term (m: per rows half) into acc. */
static inline __attribute__((always_inline)) void vnni_min_term(const __m256 m[2], const gguf_acts_t *a, int64_t nb,
                                                                int64_t b, const int R, __m256 acc[R_MAX][2]) {
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < R; r++)
            acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(m[h], _mm256_set1_ps(a->sx[r * nb + b])));
}

/* Block b of a group (16 rows; wg: the block) of any kind against R <= 2 activation rows, added
 * to acc: per sum (kind 18's first half of the weights, scale d0, then the second, d1; other
 * kinds one), its chunks unpacked (vnni_chunk) and multiplied (vnni_products), then its float
 * step; then the m term. P = 1 (every xb of the block zero): the xa products only, half the
 * vpdpbusd of every kind (8-bit kinds too: they multiply the parts apart, not x16), and one_part
 * gives what two_parts gives with sb = 0. */
static inline __attribute__((always_inline)) void
block_dot(const uint8_t *wg, const int kind, int64_t nb, int64_t b, const gguf_acts_t *a, const int R, const int P,
          __m256 acc[R_MAX][2]) {
    const int sums = gguf_two_halves(kind) ? 2 : 1, cn = gguf_nibble_kind(kind) ? 4 : 8 / sums;   /* chunks per sum */
    #pragma GCC unroll 2
    for (int k = 0; k < sums; k++) {
        __m256i s[R_MAX][2][2];                    /* [row][part xa | xb][half] */
        for (int r = 0; r < R; r++)
            for (int p = 0; p < P; p++) s[r][p][0] = s[r][p][1] = _mm256_setzero_si256();
        #pragma GCC unroll 8   /* c a constant: the compact kinds' unpacking shifts by immediates */
        for (int c = k * cn; c < k * cn + cn; c++) {
            __m256i w[4];
            vnni_chunk(wg, kind, c, w);
            vnni_products(w, kind, c, a, nb, b, R, P, s);
        }
        const __m256 d[2] = {block_scale(wg, kind, nb, b, k, 0), block_scale(wg, kind, nb, b, k, 1)};
        vnni_finish(s, d, k, kind, a, nb, b, R, P, acc);
    }
    if (vnni_has_min(kind)) {
        const __m256 m[2] = {block_min(wg, kind, nb, b, 0), block_min(wg, kind, nb, b, 1)};
        vnni_min_term(m, a, nb, b, R, acc);
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
#include "ready_group_avx.h"

/* Tiles of more than 2 rows (ready_group_avx.h). A ready_t holds a block's vnni_chunk bytes (chunk
 * c at w + 4c for 4-bit kinds, at w + 2c for kinds 26, 13, 24), its scales (sum k, rows half h at
 * s[2k + h]) and its m (at s[4 + h]). */
static inline __attribute__((always_inline)) void ready_unpack(const uint8_t *wg, const int kind, int64_t nb,
                                                               int64_t b, ready_t *rb) {
    const int four = gguf_nibble_kind(kind), cn = four ? 4 : 8, sums = gguf_two_halves(kind) ? 2 : 1;
    #pragma GCC unroll 8
    for (int c = 0; c < cn; c++) {
        __m256i w[4];
        vnni_chunk(wg, kind, c, w);
        for (int i = 0; i < (four ? 4 : 2); i++) rb->w[(four ? 4 : 2) * c + i] = w[i];
    }
    for (int k = 0; k < sums; k++)
        for (int h = 0; h < 2; h++) rb->s[2 * k + h] = block_scale(wg, kind, nb, b, k, h);
    if (vnni_has_min(kind))
        for (int h = 0; h < 2; h++) rb->s[4 + h] = block_min(wg, kind, nb, b, h);
}

/* Block b from its ready_t (rp) against R <= 2 activation rows, added to acc: block_dot's
 * products and float steps, the chunks and scales loaded instead of unpacked. */
static inline __attribute__((always_inline)) void
ready_block(const uint8_t *rp, const int kind, int64_t nb, int64_t b, const gguf_acts_t *a, const int R, const int P,
            __m256 acc[R_MAX][2]) {
    const ready_t *rb = (const ready_t *)rp;
    const int four = gguf_nibble_kind(kind), sums = gguf_two_halves(kind) ? 2 : 1, cn = four ? 4 : 8 / sums;
    #pragma GCC unroll 2
    for (int k = 0; k < sums; k++) {
        __m256i s[R_MAX][2][2];
        for (int r = 0; r < R; r++)
            for (int p = 0; p < P; p++) s[r][p][0] = s[r][p][1] = _mm256_setzero_si256();
        #pragma GCC unroll 8
        for (int c = k * cn; c < k * cn + cn; c++) vnni_products(rb->w + (four ? 4 : 2) * c, kind, c, a, nb, b, R, P, s);
        vnni_finish(s, rb->s + 2 * k, k, kind, a, nb, b, R, P, acc);
    }
    if (vnni_has_min(kind)) vnni_min_term(rb->s + 4, a, nb, b, R, acc);
}

/* The kinds whose unpacking ready_group saves (kinds 8, 18, 19 are loaded as they are). */
static inline int ready_takes(const int kind) {
    return gguf_nibble_kind(kind) || kind == GGUF_K6 || kind == GGUF_K3 || kind == GGUF_X4;
}

#include "f32_tile_avx2.h"
