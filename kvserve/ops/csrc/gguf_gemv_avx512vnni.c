/* gguf_group_dot (gguf_gemv.h) for AVX-512 VNNI: one 512-bit vpdpbusd multiplies 4 weights of
 * all 16 rows of a group by 4 activation bytes (u8 weights x s8 activations, summed in int32),
 * so no horizontal sums are needed. 8-bit weights are stored + 128 (u8); the 128 sum(x) that
 * adds is taken off with the precomputed sq (kind 18: sq0 and sq - sq0, one per half). The
 * compact kinds are unpacked to such bytes in registers: kind 26's 6-bit and kind 13's 3-bit u
 * (q + 32, q + 4: their own offsets taken off), kind 24's indices by a vpshufb table lookup.
 * Build: -mavx512f -mavx512bw -mavx512vnni -mf16c. */
#include <immintrin.h>

#include "gguf_gemv.h"
#include "one_part_avx.h"

const char *gguf_kernel_isa(void) { return "avx512vnni"; }

/* Whole unrolling of the chunk loops: with c a constant, each chunk's unpacking shifts by
 * immediates and picks its source register at compile time (GCC keeps 8-iteration loops rolled). */
#define UNROLL _Pragma("GCC unroll 8")

/* 256 sum_j q_j xa_j + sum_j q_j xb_j for the 16 rows over chunks c0 .. c1 - 1: q[c] holds
 * weights 4c..4c+3 of each row, x the block's 32 xa then 32 xb. P = 1 (one-part activations, every
 * xb = 0): 256 sum_j q_j xa_j, the same integer from half the multiplies, summed in two chains
 * (even and odd chunks) so that consecutive vpdpbusd do not wait on each other's latency. */
static inline __attribute__((always_inline)) __m512i
dot_two_parts(const __m512i q[8], const int8_t *x, const int c0, const int c1, const int P) {
    const int32_t *xa = (const int32_t *)x, *xb = xa + 8;
    __m512i sa = _mm512_setzero_si512(), sb = _mm512_setzero_si512();
    for (int c = c0; c < c1; c++) {
        if (P == 1 && (c - c0) & 1) sb = _mm512_dpbusd_epi32(sb, q[c], _mm512_set1_epi32(xa[c]));
        else sa = _mm512_dpbusd_epi32(sa, q[c], _mm512_set1_epi32(xa[c]));
        if (P == 2) sb = _mm512_dpbusd_epi32(sb, q[c], _mm512_set1_epi32(xb[c]));
    }
    return P == 2 ? _mm512_add_epi32(_mm512_slli_epi32(sa, 8), sb) : _mm512_slli_epi32(_mm512_add_epi32(sa, sb), 8);
}

/* dot_two_parts of row r's block b, with the xb products skipped (P = 1) where mixed parts left
 * that block one part (gguf_xb_zero): the same integer. */
static inline __attribute__((always_inline)) __m512i
dot_row(const __m512i q[8], const gguf_acts_t *a, int64_t r, int64_t nb, int64_t b, const int c0, const int c1,
        const int P) {
    const int8_t *x = a->xq + (r * nb + b) * 64;
    if (P == 2 && a->parts == GGUF_MIXED_PARTS && gguf_xb_zero(a, r, nb, b)) return dot_two_parts(q, x, c0, c1, 1);
    return dot_two_parts(q, x, c0, c1, P);
}

/* The K-quant kinds' float scales of a block (gguf_gemv.h): the super-block's fp16 scale times
 * each row's 16 integer scales at p (signed or not), exact in float32; m = -(dmin mn). */
static inline __attribute__((always_inline)) __m512 k_scale(const uint8_t *sup, const uint8_t *p, const int sgn) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    const __m512 n = _mm512_cvtepi32_ps(sgn ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sup)), n);
}

static inline __attribute__((always_inline)) __m512 neg(__m512 v) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)));
}

/* Block b of a group (wg: its bytes) against R activation rows, added to acc[r]. kind, R and P
 * (activation parts) are constants at every call (gguf_group_dot's switch): one specialized body
 * each. P = 1 where every row's xb of the block is zero (GGUF_BLOCK_RUNS), P = 2 otherwise. */
static inline __attribute__((always_inline)) void
block_dot(const uint8_t *wg, const int kind, int64_t nb, int64_t b, const gguf_acts_t *a, const int R, const int P,
          __m512 *acc) {
    const int64_t qo = gguf_ints_offset(kind);
    if (gguf_nibble_kind(kind)) {
        const __m512i low4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
        const uint8_t *sup = gguf_super_scales(wg, kind, nb, b);
        const __m512 d = kind == GGUF_Q4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)wg))
                                         : k_scale(sup, wg, 0);
        const __m512 m = kind == GGUF_Q4 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wg + 32)))
                                         : neg(k_scale(sup + 32, wg + 16, 0));
        __m512i q[8];
        UNROLL for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512(wg + qo + 64 * c);
            q[c] = _mm512_and_si512(v, low4);                           /* q[4c .. 4c+3] */
            q[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4); /* q[4c+16 .. 4c+19] */
        }
        if (kind == GGUF_K5) {             /* bit 4 of chunk c's q is bit c of the top chunk */
            const __m512i t = _mm512_loadu_si512(wg + qo + 256);
            UNROLL for (int c = 0; c < 8; c++) {
                const __m512i tc = c < 4 ? _mm512_slli_epi16(t, 4 - c) : c == 4 ? t : _mm512_srli_epi16(t, c - 4);
                q[c] = _mm512_ternarylogic_epi32(q[c], tc, bit4, 0xF8);    /* q | (tc & bit4) */
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t rb = r * nb + b;
            const __m512 s = _mm512_cvtepi32_ps(dot_row(q, a, r, nb, b, 0, 8, P));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(a->dx[rb]))));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(m, _mm512_set1_ps(a->sx[rb])));
        }
    } else if (kind == GGUF_Q8 || kind == GGUF_X4) {
        /* kind 24: each nibble looked up in the table of value + 128 (vpshufb, per 128-bit lane),
         * the low nibbles give kind 8's chunk c, the high ones chunk c + 4 (gguf_x4_byte) */
        const __m512i table = _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)gguf_iq4_values)),
                                               _mm512_set1_epi8((char)0x80));
        const __m512i low4 = _mm512_set1_epi8(0x0f);
        const __m512 d = kind == GGUF_Q8 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)wg))
                                         : k_scale(gguf_super_scales(wg, kind, nb, b), wg, 1);
        __m512i q[8];
        if (kind == GGUF_X4) {
            UNROLL for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512(wg + qo + 64 * c);
                q[c] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low4));
                q[c + 4] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
            }
        } else {
            for (int c = 0; c < 8; c++) q[c] = _mm512_loadu_si512(wg + qo + 64 * c);
        }
        for (int r = 0; r < R; r++) {
            const int64_t rb = r * nb + b;
            const __m512i si = _mm512_sub_epi32(dot_row(q, a, r, nb, b, 0, 8, P),
                                                _mm512_set1_epi32(128 * a->sq[rb]));
            const __m512 s = _mm512_cvtepi32_ps(si);
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(a->dx[rb]))));
        }
    } else {                   /* GGUF_K8, GGUF_F8, GGUF_K6, GGUF_K3: a scale per half, then m (not 26, 13) */
        const int k6 = kind == GGUF_K6, k3 = kind == GGUF_K3, bias = k6 ? 32 : k3 ? 4 : 128;  /* stored u less q */
        const __m512i low4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30);
        const __m512i low2 = _mm512_set1_epi8(0x03), bit2 = _mm512_set1_epi8(0x04);
        const uint8_t *sup = gguf_super_scales(wg, kind, nb, b);
        const __m512 d0 = kind == GGUF_F8 ? _mm512_loadu_ps(wg) : k_scale(sup, wg, 1);
        const __m512 d1 = kind == GGUF_F8 ? _mm512_loadu_ps(wg + 64) : k_scale(sup, wg + 16, 1);
        const __m512 m = kind == GGUF_F8 ? _mm512_loadu_ps(wg + 128)
                         : k6 || k3    ? _mm512_setzero_ps() : neg(k_scale(sup + 32, wg + 32, 0));
        __m512i q[8];
        if (k3) {                          /* u = low 2 bits | high bit << 2 (gguf_k3_byte) */
            const __m512i l0 = _mm512_loadu_si512(wg + qo), l1 = _mm512_loadu_si512(wg + qo + 64);
            const __m512i t = _mm512_loadu_si512(wg + qo + 128);
            UNROLL for (int c = 0; c < 8; c++) {
                const __m512i l = c < 4 ? l0 : l1;
                const int sh = 2 * (c & 3);
                const __m512i lo = _mm512_and_si512(sh == 0 ? l : sh == 2 ? _mm512_srli_epi16(l, 2)
                                                    : sh == 4 ? _mm512_srli_epi16(l, 4) : _mm512_srli_epi16(l, 6), low2);
                const __m512i tc = c == 0 ? _mm512_slli_epi16(t, 2) : c == 1 ? _mm512_slli_epi16(t, 1)
                                 : c == 2 ? t : _mm512_srli_epi16(t, c - 2);
                q[c] = _mm512_ternarylogic_epi32(lo, tc, bit2, 0xF8);     /* a | (b & c) */
            }
        } else if (k6) {                          /* u = low 4 bits | top 2 bits << 4 (gguf_k6_byte) */
            const __m512i h0 = _mm512_loadu_si512(wg + qo + 256), h1 = _mm512_loadu_si512(wg + qo + 320);
            UNROLL for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512(wg + qo + 64 * c);
                const __m512i t0 = c == 0 ? _mm512_slli_epi16(h0, 4) : c == 1 ? _mm512_slli_epi16(h0, 2)
                                 : c == 2 ? h0 : _mm512_srli_epi16(h0, 2);
                const __m512i t1 = c == 0 ? _mm512_slli_epi16(h1, 4) : c == 1 ? _mm512_slli_epi16(h1, 2)
                                 : c == 2 ? h1 : _mm512_srli_epi16(h1, 2);
                q[c] = _mm512_ternarylogic_epi32(_mm512_and_si512(v, low4), t0, top2, 0xF8);     /* a | (b & c) */
                q[c + 4] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), t1, top2,
                                                     0xF8);
            }
        } else {
            for (int c = 0; c < 8; c++) q[c] = _mm512_loadu_si512(wg + qo + 64 * c);
        }
        for (int r = 0; r < R; r++) {
            const int64_t rb = r * nb + b;
            const __m512 s0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot_row(q, a, r, nb, b, 0, 4, P),
                                                                   _mm512_set1_epi32(bias * a->sq0[rb])));
            const __m512 s1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot_row(q, a, r, nb, b, 4, 8, P),
                                                                   _mm512_set1_epi32(bias * (a->sq[rb] - a->sq0[rb]))));
            const __m512 dx = _mm512_set1_ps(a->dx[rb]);
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(s0, _mm512_mul_ps(d0, dx)));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(s1, _mm512_mul_ps(d1, dx)));
            if (!k6 && !k3) acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(m, _mm512_set1_ps(a->sx[rb])));
        }
    }
}

/* A group against R activation rows, block by block (block_dot), with mixed parts in runs of
 * blocks where every row has one part (GGUF_BLOCK_RUNS): those skip the per-row check. */
static inline __attribute__((always_inline)) void
group_dot(const uint8_t *wg, const int kind, int64_t nb, const gguf_acts_t *a, const int R, const int P, float *out) {
    __m512 acc[GGUF_TILE_M];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    GGUF_BLOCK_RUNS(block_dot, one_part_block, wg, kind, nb, a, R, P, acc);
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * GGUF_ROWS, acc[r]);
}

#define ROWS(K, P) switch (R) {   /* R as a constant: the accumulators stay in registers */ \
        case 1: group_dot(wg, K, nb, a, 1, P, out); break;                                \
        case 2: group_dot(wg, K, nb, a, 2, P, out); break;                                \
        case 3: group_dot(wg, K, nb, a, 3, P, out); break;                                \
        case 4: group_dot(wg, K, nb, a, 4, P, out); break;                                \
        case 5: group_dot(wg, K, nb, a, 5, P, out); break;                                \
        case 6: group_dot(wg, K, nb, a, 6, P, out); break;                                \
        case 7: group_dot(wg, K, nb, a, 7, P, out); break;                                \
        default: group_dot(wg, K, nb, a, 8, P, out); break;                               \
    }
#define KIND(K) if (a->parts == GGUF_ONE_PART) { ROWS(K, 1) } else { ROWS(K, 2) }

void gguf_group_dot(const uint8_t *wg, int64_t kind, int64_t nb, const gguf_acts_t *a, int R, float *out) {
    switch (kind) {
        case GGUF_Q4: KIND(GGUF_Q4); break;
        case GGUF_Q8: KIND(GGUF_Q8); break;
        case GGUF_K4: KIND(GGUF_K4); break;
        case GGUF_K5: KIND(GGUF_K5); break;
        case GGUF_K8: KIND(GGUF_K8); break;
        case GGUF_K6: KIND(GGUF_K6); break;
        case GGUF_K3: KIND(GGUF_K3); break;
        case GGUF_X4: KIND(GGUF_X4); break;
        default: KIND(GGUF_F8); break;
    }
}

/* The float32 tile (gguf_gemv.h): the 32 rows of two groups are two 512-bit vectors, so each k
 * is two weight loads, T broadcasts and 2 T fused multiply-adds (2 T = 24 accumulators). With
 * one group (16 rows) per tile the broadcast loads, not the FMA ports, would set the pace. */
#define F32_T 12

int gguf_f32_tile_rows(void) { return F32_T; }

/* The 24 accumulators are named variables (EACH_ROW repeats a statement for rows 0..11): kept in
 * arrays, GCC 12 stores some of them to the stack on every k, and the store port paces the loop. */
#define EACH_ROW(S) S(0) S(1) S(2) S(3) S(4) S(5) S(6) S(7) S(8) S(9) S(10) S(11)

void gguf_tile_f32(const float *wt, const float *xp, int64_t kc, int cont, float *acc) {
#define INIT(r) __m512 lo##r = cont ? _mm512_loadu_ps(acc + (r) * GGUF_F32_N) : _mm512_setzero_ps(), \
                       hi##r = cont ? _mm512_loadu_ps(acc + (r) * GGUF_F32_N + 16) : _mm512_setzero_ps();
    EACH_ROW(INIT)
#undef INIT
    for (int64_t k = 0; k < kc; k++, wt += GGUF_F32_N, xp += F32_T) {
        const __m512 w0 = _mm512_load_ps(wt), w1 = _mm512_load_ps(wt + 16);
#define FMA(r) { const __m512 xv = _mm512_set1_ps(xp[r]); \
                 lo##r = _mm512_fmadd_ps(w0, xv, lo##r); hi##r = _mm512_fmadd_ps(w1, xv, hi##r); }
        EACH_ROW(FMA)
#undef FMA
    }
#define STORE(r) _mm512_storeu_ps(acc + (r) * GGUF_F32_N, lo##r); _mm512_storeu_ps(acc + (r) * GGUF_F32_N + 16, hi##r);
    EACH_ROW(STORE)
#undef STORE
}
