/* The kernels of kinds 10 (Q2_K) and 32, 33, 34 (float weights: float32, fp16, bf16), gguf_gemv.h: one source for every build,
 * written with GCC/clang vector types of 8 lanes (half the 16 rows of a group), which each build
 * compiles with its own target flags (AVX-512, AVX2, NEON or the baseline); kind 10's integer sums
 * take AVX-512 VNNI's vpdpbusd where the build has it (the same integers). Lane-wise integer and
 * IEEE float operations in a fixed order, no contraction (-ffp-contract=off): the same bits in
 * every build, as gguf_gemv.h asks. The driver (gguf_gemv.c) calls them in place of the per-ISA
 * gguf_group_dot for these kinds, and dequantizes them for the float32 GEMM and row reads. */
#ifndef KVSERVE_GGUF_GEMV_GENERIC_H
#define KVSERVE_GGUF_GEMV_GENERIC_H

#include "fixed_math.h"
#include "gguf_gemv.h"
#if defined(__F16C__) || (defined(__AVX512VNNI__) && defined(__AVX512BW__))
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

/* 8 lanes: half a group's rows (32 bytes, a register of AVX2 and wider; two on NEON). */
typedef float gguf_v8f __attribute__((vector_size(32)));
typedef int32_t gguf_v8i __attribute__((vector_size(32)));
typedef uint32_t gguf_v8u __attribute__((vector_size(32)));
typedef uint8_t gguf_v8b __attribute__((vector_size(8)));
typedef uint16_t gguf_v8h __attribute__((vector_size(16)));

static inline __attribute__((always_inline)) gguf_v8f gguf_v8f_load(const void *p) {
    gguf_v8f v;
    memcpy(&v, p, 32);
    return v;
}

static inline __attribute__((always_inline)) gguf_v8u gguf_v8u_load(const void *p) {
    gguf_v8u v;
    memcpy(&v, p, 32);
    return v;
}

/* 8 u8 values at p -> float32 lanes. */
static inline __attribute__((always_inline)) gguf_v8f gguf_v8f_bytes(const uint8_t *p) {
    gguf_v8b v;
    memcpy(&v, p, 8);
    return __builtin_convertvector(__builtin_convertvector(v, gguf_v8i), gguf_v8f);
}

/* 8 fp16 values at p -> float32 lanes, exactly (F16C where the build has it, else half_to_float). */
static inline gguf_v8f gguf_v8f_halves(const uint8_t *p) {
    gguf_v8f v;
#if defined(__F16C__)
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    memcpy(&v, &f, 32);
#elif defined(__aarch64__) && defined(__ARM_NEON)
    const float16x8_t h = vreinterpretq_f16_u8(vld1q_u8(p));
    const float32x4_t lo = vcvt_f32_f16(vget_low_f16(h)), hi = vcvt_high_f32_f16(h);
    memcpy(&v, &lo, 16);
    memcpy((char *)&v + 16, &hi, 16);
#else
    for (int i = 0; i < 8; i++) v[i] = half_to_float(gguf_load_u16(p + 2 * i));
#endif
    return v;
}

/* 8 float weights of kind 32 (float32), 33 (fp16) or 34 (bf16: its bits are a float32's top
 * half) at p, as float32 lanes: every value exact. */
static inline __attribute__((always_inline)) gguf_v8f gguf_v8f_weights(const uint8_t *p, const int64_t kind) {
    if (kind == GGUF_W32) return gguf_v8f_load(p);
    if (kind == GGUF_W16) return gguf_v8f_halves(p);
    gguf_v8h h;
    memcpy(&h, p, 16);
    return (gguf_v8f)(__builtin_convertvector(h, gguf_v8u) << 16);
}

/* Bytes of one weight of the float kinds (32: 4, 33 and 34: 2). */
static inline int64_t gguf_float_bytes(int64_t kind) { return kind == GGUF_W32 ? 4 : 2; }

/* Kind 10's super-block scales D and DMIN of block b's 16 rows, as two halves of 8 lanes. */
static inline void gguf_k2_supers(const uint8_t *blk, int64_t nb, int64_t b, gguf_v8f d[2], gguf_v8f dmin[2]) {
    const uint8_t *sup = gguf_super_scales(blk, GGUF_K2, nb, b);
    for (int h = 0; h < 2; h++) {
        d[h] = gguf_v8f_halves(sup + 16 * h);
        dmin[h] = gguf_v8f_halves(sup + 32 + 16 * h);
    }
}

/* Kind 10's float scales of a block (blk) for rows 8h .. 8h + 7: d0 = D sc0, d1 = D sc1,
 * m0 = -(DMIN mn0), m1 = -(DMIN mn1): exact products (fp16 times 4 bits). */
static inline __attribute__((always_inline)) void gguf_k2_scales(const uint8_t *blk, int h, gguf_v8f d, gguf_v8f dmin,
                                                                 gguf_v8f *d0, gguf_v8f *d1, gguf_v8f *m0,
                                                                 gguf_v8f *m1) {
    *d0 = d * gguf_v8f_bytes(blk + 8 * h);
    *d1 = d * gguf_v8f_bytes(blk + 16 + 8 * h);
    *m0 = -(dmin * gguf_v8f_bytes(blk + 32 + 8 * h));
    *m1 = -(dmin * gguf_v8f_bytes(blk + 48 + 8 * h));
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* s0, s1 of kind 10 for the 16 rows (AVX-512 VNNI): each 512-bit vpdpbusd multiplies 4 weights
 * (u8 nibbles) of every row by 4 xa (or xb) bytes, as gguf_gemv_avx512vnni.c does for kind 4;
 * the low nibbles are weights 0..15, the high ones 16..31. The same integers as the lane code. */
static inline __attribute__((always_inline)) void gguf_k2_sums(const __m512i q[8], const int8_t *x, int P,
                                                               int32_t s0[16], int32_t s1[16]) {
    const int32_t *xa = (const int32_t *)x, *xb = xa + 8;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, b0 = a0, b1 = a0;
    for (int c = 0; c < 4; c++) {
        a0 = _mm512_dpbusd_epi32(a0, q[c], _mm512_set1_epi32(xa[c]));
        a1 = _mm512_dpbusd_epi32(a1, q[c + 4], _mm512_set1_epi32(xa[c + 4]));
        if (P == 2) {
            b0 = _mm512_dpbusd_epi32(b0, q[c], _mm512_set1_epi32(xb[c]));
            b1 = _mm512_dpbusd_epi32(b1, q[c + 4], _mm512_set1_epi32(xb[c + 4]));
        }
    }
    _mm512_storeu_si512(s0, _mm512_add_epi32(_mm512_slli_epi32(a0, 8), b0));
    _mm512_storeu_si512(s1, _mm512_add_epi32(_mm512_slli_epi32(a1, 8), b1));
}
#endif

/* Kind 10 against R (a constant, <= 4) activation rows (gguf_gemv.h's formula for kind 10). */
static inline __attribute__((always_inline)) void gguf_k2_rows(const uint8_t *wg, int64_t nb, const gguf_acts_t *a,
                                                               const int R, float *out) {
    const int64_t pb = gguf_packed_block_bytes(GGUF_K2);
    gguf_v8f acc[4][2], d[2], dmin[2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = (gguf_v8f){0};
    for (int64_t b = 0; b < nb; b++, wg += pb) {
        gguf_prefetch_block(wg, pb);
        if (b % 8 == 0) gguf_k2_supers(wg, nb, b, d, dmin);
        int32_t s0[4][16], s1[4][16];                        /* weights 0..15, 16..31 of each row */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        __m512i q[8];
        const __m512i low4 = _mm512_set1_epi8(0x0f);
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512(wg + 64 + 64 * c);
            q[c] = _mm512_and_si512(v, low4);
            q[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        for (int r = 0; r < R; r++) {
            const int P = a->parts == GGUF_ONE_PART || gguf_xb_zero(a, r, nb, b) ? 1 : 2;
            gguf_k2_sums(q, a->xq + (r * nb + b) * 64, P, s0[r], s1[r]);
        }
#else
        for (int h = 0; h < 2; h++) {
            gguf_v8i t0[4], t1[4];
            for (int r = 0; r < R; r++) t0[r] = t1[r] = (gguf_v8i){0};
            for (int c = 0; c < 4; c++) {
                const gguf_v8u u = gguf_v8u_load(wg + 64 + 64 * c + 32 * h);
                for (int t = 0; t < 4; t++) {
                    const gguf_v8i lo = (gguf_v8i)((u >> (8 * t)) & 15), hi = (gguf_v8i)((u >> (8 * t + 4)) & 15);
                    for (int r = 0; r < R; r++) {
                        const int16_t *x = a->x16 + (r * nb + b) * 32;
                        t0[r] += lo * (int32_t)x[4 * c + t];
                        t1[r] += hi * (int32_t)x[16 + 4 * c + t];
                    }
                }
            }
            for (int r = 0; r < R; r++) {
                memcpy(s0[r] + 8 * h, &t0[r], 32);
                memcpy(s1[r] + 8 * h, &t1[r], 32);
            }
        }
#endif
        for (int h = 0; h < 2; h++) {
            gguf_v8f d0, d1, m0, m1;
            gguf_k2_scales(wg, h, d[h], dmin[h], &d0, &d1, &m0, &m1);
            for (int r = 0; r < R; r++) {
                const int64_t rb = r * nb + b;
                const float dx = a->dx[rb];
                const float sx0 = dx * (float)a->sq0[rb], sx1 = dx * (float)(a->sq[rb] - a->sq0[rb]);
                gguf_v8i i0, i1;
                memcpy(&i0, s0[r] + 8 * h, 32);
                memcpy(&i1, s1[r] + 8 * h, 32);
                gguf_v8f v = acc[r][h];
                v = v + __builtin_convertvector(i0, gguf_v8f) * (d0 * dx);
                v = v + __builtin_convertvector(i1, gguf_v8f) * (d1 * dx);
                v = v + m0 * sx0;
                v = v + m1 * sx1;
                acc[r][h] = v;
            }
        }
    }
    for (int r = 0; r < R; r++) memcpy(out + r * GGUF_ROWS, acc[r], 64);
}

/* Kinds 32, 33, 34 against R (a constant, <= 4) activation rows (gguf_gemv.h's formula for kind
 * 32): each weight vector loaded (and widened) once for the R rows, one half of the rows at a
 * time. */
static inline __attribute__((always_inline)) void gguf_wf_rows(const int64_t kind, const uint8_t *wg, int64_t nb,
                                                               const gguf_acts_t *a, const int R, float *out) {
    const int64_t pb = gguf_packed_block_bytes(kind), wb = gguf_float_bytes(kind);
    gguf_v8f acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = (gguf_v8f){0};
    for (int64_t b = 0; b < nb; b++, wg += pb) {
        gguf_prefetch_block(wg, pb);
        float xf[4][32];                                     /* x16 as floats (exact) */
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 32; j++) xf[r][j] = (float)a->x16[(r * nb + b) * 32 + j];
        for (int h = 0; h < 2; h++) {
            gguf_v8f s[4];
            for (int r = 0; r < R; r++) s[r] = (gguf_v8f){0};
            for (int j = 0; j < 32; j++) {
                const gguf_v8f w = gguf_v8f_weights(wg + 16 * wb * j + 8 * wb * h, kind);
                for (int r = 0; r < R; r++) s[r] = s[r] + w * xf[r][j];
            }
            for (int r = 0; r < R; r++) acc[r][h] = acc[r][h] + s[r] * a->dx[r * nb + b];
        }
    }
    for (int r = 0; r < R; r++) memcpy(out + r * GGUF_ROWS, acc[r], 64);
}

static inline __attribute__((always_inline)) void gguf_w32_rows(const uint8_t *wg, int64_t nb, const gguf_acts_t *a,
                                                                const int R, float *out) {
    gguf_wf_rows(GGUF_W32, wg, nb, a, R, out);
}
static inline __attribute__((always_inline)) void gguf_w16_rows(const uint8_t *wg, int64_t nb, const gguf_acts_t *a,
                                                                const int R, float *out) {
    gguf_wf_rows(GGUF_W16, wg, nb, a, R, out);
}
static inline __attribute__((always_inline)) void gguf_b16_rows(const uint8_t *wg, int64_t nb, const gguf_acts_t *a,
                                                                const int R, float *out) {
    gguf_wf_rows(GGUF_B16, wg, nb, a, R, out);
}

/* Kinds 32, 33, 34 against R (a constant, <= GGUF_F32_FEW) float32 rows x + rows[r] ldx: the
 * float32 GEMM's sums without its tiles (gguf_gemv.h: for each of the group's 16 rows,
 * acc = fma(w, x, acc) over k = 0 .. K-1 in order, from 0), so a row gets the bits a tile gives
 * it. For a decode's few rows the tiles' packing and zero rows cost more than the stream of the
 * weights, which this reads once for the R rows. out[r * 16 + i]. */
static inline __attribute__((always_inline)) void gguf_wf_fma_rows(const int64_t kind, const uint8_t *wg, int64_t nb,
                                                                   const float *const *x, const int R, float *out) {
    const int64_t pb = gguf_packed_block_bytes(kind), wb = gguf_float_bytes(kind);
    gguf_v8f acc[GGUF_F32_FEW][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = (gguf_v8f){0};
    for (int64_t b = 0; b < nb; b++, wg += pb) {
        gguf_prefetch_block(wg, pb);
        for (int j = 0; j < 32; j++) {
            const gguf_v8f w0 = gguf_v8f_weights(wg + 16 * wb * j, kind);
            const gguf_v8f w1 = gguf_v8f_weights(wg + 16 * wb * j + 8 * wb, kind);
            for (int r = 0; r < R; r++) {
                const float v = x[r][32 * b + j];
                const gguf_v8f xv = {v, v, v, v, v, v, v, v};
                acc[r][0] = fma8(w0, xv, acc[r][0]);
                acc[r][1] = fma8(w1, xv, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < R; r++) memcpy(out + r * GGUF_ROWS, acc[r], 64);
}

/* gguf_wf_fma_rows for R <= GGUF_F32_FEW rows given at run time. */
static void gguf_float_group_fma(const uint8_t *wg, int64_t kind, int64_t nb, const float *const *x, int R,
                                 float *out) {
#define GGUF_FMA_ROWS(K) \
    switch (R) { case 1: gguf_wf_fma_rows(K, wg, nb, x, 1, out); break; \
                 case 2: gguf_wf_fma_rows(K, wg, nb, x, 2, out); break; \
                 case 3: gguf_wf_fma_rows(K, wg, nb, x, 3, out); break; \
                 default: gguf_wf_fma_rows(K, wg, nb, x, 4, out); break; }
    if (kind == GGUF_W16) {
        GGUF_FMA_ROWS(GGUF_W16)
    } else if (kind == GGUF_B16) {
        GGUF_FMA_ROWS(GGUF_B16)
    } else {
        GGUF_FMA_ROWS(GGUF_W32)
    }
#undef GGUF_FMA_ROWS
}

/* Kinds 10, 32, 33 and 34 against R <= GGUF_TILE_M activation rows: up to 4 rows a pass over the group's
 * weights (R a constant in each pass: the sums stay in registers). */
static void gguf_group_dot_generic(const uint8_t *wg, int64_t kind, int64_t nb, const gguf_acts_t *a, int R,
                                   float *out) {
    for (int r0 = 0; r0 < R; r0 += 4) {
        const gguf_acts_t ar = gguf_acts_from_row(a, r0, nb);
        const int n = R - r0 < 4 ? R - r0 : 4;
        float *o = out + r0 * GGUF_ROWS;
#define GGUF_GENERIC_ROWS(F) \
        switch (n) { case 1: F(wg, nb, &ar, 1, o); break; case 2: F(wg, nb, &ar, 2, o); break; \
                     case 3: F(wg, nb, &ar, 3, o); break; default: F(wg, nb, &ar, 4, o); break; }
        if (kind == GGUF_K2) {
            GGUF_GENERIC_ROWS(gguf_k2_rows)
        } else if (kind == GGUF_W16) {
            GGUF_GENERIC_ROWS(gguf_w16_rows)
        } else if (kind == GGUF_B16) {
            GGUF_GENERIC_ROWS(gguf_b16_rows)
        } else {
            GGUF_GENERIC_ROWS(gguf_w32_rows)
        }
#undef GGUF_GENERIC_ROWS
    }
}

/* Blocks b0 .. b1 - 1 of a kind-10, 32, 33 or 34 group -> wt[k][16] (row k at wt + k ld): kind 10
 * w = d q + m (the product exact: one rounding, as gguf's dequantization), the float kinds their
 * values. */
static void gguf_dequantize_group_generic(const uint8_t *wg, int64_t kind, int64_t nb, int64_t b0, int64_t b1,
                                          float *wt, int64_t ld) {
    const int64_t pb = gguf_packed_block_bytes(kind);
    wg += b0 * pb;
    for (int64_t b = b0; b < b1; b++, wg += pb) {
        float *o = wt + (b - b0) * 32 * ld;
        if (kind == GGUF_W32) {
            for (int j = 0; j < 32; j++) memcpy(o + j * ld, wg + 64 * j, 64);
            continue;
        }
        if (kind == GGUF_W16 || kind == GGUF_B16) {
            for (int j = 0; j < 32; j++)
                for (int h = 0; h < 2; h++) {
                    const gguf_v8f w = gguf_v8f_weights(wg + 32 * j + 16 * h, kind);
                    memcpy(o + j * ld + 8 * h, &w, 32);
                }
            continue;
        }
        gguf_v8f d[2], dmin[2];
        gguf_k2_supers(wg, nb, b, d, dmin);
        for (int h = 0; h < 2; h++) {
            gguf_v8f d0, d1, m0, m1;
            gguf_k2_scales(wg, h, d[h], dmin[h], &d0, &d1, &m0, &m1);
            for (int c = 0; c < 4; c++) {
                const gguf_v8u u = gguf_v8u_load(wg + 64 + 64 * c + 32 * h);
                for (int t = 0; t < 4; t++) {
                    const gguf_v8f lo = __builtin_convertvector((gguf_v8i)((u >> (8 * t)) & 15), gguf_v8f);
                    const gguf_v8f hi = __builtin_convertvector((gguf_v8i)((u >> (8 * t + 4)) & 15), gguf_v8f);
                    const gguf_v8f w0 = d0 * lo + m0, w1 = d1 * hi + m1;
                    memcpy(o + (4 * c + t) * ld + 8 * h, &w0, 32);
                    memcpy(o + (16 + 4 * c + t) * ld + 8 * h, &w1, 32);
                }
            }
        }
    }
}

/* Row r of a kind-10, 32, 33 or 34 weight of K columns -> out[K], as gguf_dequantize_group_generic. */
static void gguf_dequantize_row_generic(const uint8_t *w, int64_t kind, int64_t K, int64_t r, float *out) {
    const int64_t nb = K / 32;
    float wt[32 * GGUF_ROWS];
    const uint8_t *g = gguf_group_blocks(w, kind, nb, r / GGUF_ROWS);
    for (int64_t b = 0; b < nb; b++) {
        gguf_dequantize_group_generic(g, kind, nb, b, b + 1, wt, GGUF_ROWS);
        for (int j = 0; j < 32; j++) out[32 * b + j] = wt[j * GGUF_ROWS + r % GGUF_ROWS];
    }
}

#endif
