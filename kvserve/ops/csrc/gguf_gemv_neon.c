/* gguf_group_dot (gguf_gemv.h) for Arm NEON with the dot product extension (Armv8.2-A+dotprod:
 * Graviton 2/3/4, Ampere Altra, Apple M1 and later, Cortex-A76 and later).
 *
 * sdot by lane (vdotq_laneq_s32) multiplies 4 s8 weights of 4 rows by the same 4 s8 activations
 * and adds each row's sum to an int32 lane: the packed layout's 16-byte slice 16v..16v+15 of a
 * 64-byte chunk is exactly that for rows 4v..4v+3, so a group of 16 rows is four int32x4 vectors
 * and no horizontal sums are needed. Per block, row quad v and activation row r:
 *   w[c]     weights j = 4c..4c+3       (Q4: chunk c's low nibbles;  Q8: chunk c)      c = 0..3
 *   w[4 + c] weights j = 16+4c..16+4c+3 (Q4: chunk c's high nibbles; Q8: chunk 4 + c)
 * dotted with lane c of the part's x[0..15] and x[16..31]. Q4 nibbles (0..15) are valid s8 as
 * they are; 8-bit kinds' bytes (q + 128) become s8 q by flipping the top bit (kind 26: its
 * 6-bit u less 32; kind 13: its 3-bit u less 4; kind 24: each index's s8 value by tbl). Both parts (xa, xb) go into one exact int32: s = 256 sum q xa + sum q xb
 * (|s| < 2^28; kind 18: one per half); every kind multiplies the parts apart, so a block whose xb are all zero (one-part activations, and
 * with mixed parts the runs of such blocks: group_dot) takes the xa products only. The
 * float steps are the portable kernel's: (float)s * (d dx), then a separate add (vmulq_f32 +
 * vaddq_f32, never vfmaq; built with -ffp-contract=off), and for kinds with m + m sx. fp16 d and
 * m: vcvt_f32_f16 is exact; kinds 14 and 18 store them as fp32.
 *
 * Register budget (32 x 128 bit): 8 weight vectors, 4 R float accumulators, the activation parts
 * and the int32 sums. Up to R_MAX = 4 activation rows go in one pass over the group's weights;
 * R = 5..8 takes two passes (4 + the rest), the second re-reading the group's weights from L1 -
 * one pass of 8 rows would need all 32 registers for its accumulators alone and spill.
 * Build: -march=armv8.2-a+dotprod (or any later -march / -mcpu with dotprod). */
#include <arm_neon.h>

#include "gguf_gemv.h"

#ifndef __ARM_FEATURE_DOTPROD
#error "gguf_gemv_neon.c needs the Armv8.2 dot product extension: build with -march=armv8.2-a+dotprod"
#endif
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF   /* clang: no fused multiply-add, whatever the command line says */
#elif defined(__GNUC__)
/* GCC's scheduler before register allocation hoists every weight load of a block to its start
 * and spills the float accumulators (R = 4: ~180 stack accesses a block instead of ~40). The
 * exact float steps hold even if the library is built with -ffast-math or -ffp-contract=fast. */
#pragma GCC optimize("no-schedule-insns", "fp-contract=off", "no-fast-math")
#endif

const char *gguf_kernel_isa(void) { return "neon"; }

#define R_MAX 4     /* activation rows per pass: 4 R_MAX accumulators + 8 weight registers + parts */
#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 8")   /* whole: constant indices keep the arrays in registers */

/* acc + sum over the 32 weights of 4 rows (w, as above) times one part (lo: x[0..15], hi:
 * x[16..31]): 8 sdot, one dependency chain. */
INLINE int32x4_t dot32(int32x4_t acc, const int8x16_t w[8], int8x16_t lo, int8x16_t hi) {
    acc = vdotq_laneq_s32(acc, w[0], lo, 0);
    acc = vdotq_laneq_s32(acc, w[1], lo, 1);
    acc = vdotq_laneq_s32(acc, w[2], lo, 2);
    acc = vdotq_laneq_s32(acc, w[3], lo, 3);
    acc = vdotq_laneq_s32(acc, w[4], hi, 0);
    acc = vdotq_laneq_s32(acc, w[5], hi, 1);
    acc = vdotq_laneq_s32(acc, w[6], hi, 2);
    acc = vdotq_laneq_s32(acc, w[7], hi, 3);
    return acc;
}

/* s = 256 sum q xa + sum q xb for 4 rows, from one activation row's block (x: xa[32], xb[32]).
 * With one activation row the two parts are two independent chains (latency); with several,
 * the rows already give the core independent chains, and one chain saves two instructions.
 * P = 1 (the block's xb all zero): 256 sum q xa, the same integer from half the sdot. */
INLINE int32x4_t block_s(const int8x16_t w[8], const int8_t *x, const int R, const int P) {
    const int8x16_t a0 = vld1q_s8(x), a1 = vld1q_s8(x + 16);
    if (P == 1) return vshlq_n_s32(dot32(vdupq_n_s32(0), w, a0, a1), 8);
    const int8x16_t b0 = vld1q_s8(x + 32), b1 = vld1q_s8(x + 48);
    if (R == 1) {
        const int32x4_t sa = dot32(vdupq_n_s32(0), w, a0, a1), sb = dot32(vdupq_n_s32(0), w, b0, b1);
        return vaddq_s32(vshlq_n_s32(sa, 8), sb);
    }
    return dot32(vshlq_n_s32(dot32(vdupq_n_s32(0), w, a0, a1), 8), w, b0, b1);
}

/* Kind 18: s0 = 256 sum q xa + sum q xb over weights 0..15 (w[0..3] with x[0..15] of each part),
 * s1 the same over weights 16..31 (w[4..7] with x[16..31]). P = 1: the xa products only. */
INLINE void block_s_halves(const int8x16_t w[8], const int8_t *x, const int P, int32x4_t *s0, int32x4_t *s1) {
    const int8x16_t a0 = vld1q_s8(x), a1 = vld1q_s8(x + 16);
    int32x4_t lo = vdupq_n_s32(0), hi = vdupq_n_s32(0);
    /* The lane is written out: clang (Apple's compiler) takes only a literal there, even in an
     * unrolled loop. */
#define HALVES(xl, xh, c) lo = vdotq_laneq_s32(lo, w[c], xl, c); hi = vdotq_laneq_s32(hi, w[4 + c], xh, c)
    HALVES(a0, a1, 0); HALVES(a0, a1, 1); HALVES(a0, a1, 2); HALVES(a0, a1, 3);
    lo = vshlq_n_s32(lo, 8);
    hi = vshlq_n_s32(hi, 8);
    if (P == 2) {
        const int8x16_t b0 = vld1q_s8(x + 32), b1 = vld1q_s8(x + 48);
        HALVES(b0, b1, 0); HALVES(b0, b1, 1); HALVES(b0, b1, 2); HALVES(b0, b1, 3);
    }
#undef HALVES
    *s0 = lo;
    *s1 = hi;
}

/* Four float32x4 vectors of 16 fp16 row scales at p. */
INLINE void load_scales(const uint8_t *p, float32x4_t v[4]) {
    const float16x8_t h0 = vreinterpretq_f16_u8(vld1q_u8(p)), h1 = vreinterpretq_f16_u8(vld1q_u8(p + 16));
    v[0] = vcvt_f32_f16(vget_low_f16(h0));
    v[1] = vcvt_high_f32_f16(h0);
    v[2] = vcvt_f32_f16(vget_low_f16(h1));
    v[3] = vcvt_high_f32_f16(h1);
}

/* The K-quant kinds' float scales (gguf_gemv.h): the super-block's 16 fp16 scales at sup times
 * the rows' 16 integer scales at p (signed or not), exact in float32; neg: m = -(dmin mn). */
INLINE void k_scales(const uint8_t *sup, const uint8_t *p, const int sgn, const int neg, float32x4_t v[4]) {
    float32x4_t d[4], n[4];
    load_scales(sup, d);
    const uint8x16_t u = vld1q_u8(p);
    if (sgn) {
        const int16x8_t lo = vmovl_s8(vget_low_s8(vreinterpretq_s8_u8(u))), hi = vmovl_high_s8(vreinterpretq_s8_u8(u));
        n[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
        n[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
        n[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
        n[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
    } else {
        const uint16x8_t lo = vmovl_u8(vget_low_u8(u)), hi = vmovl_high_u8(u);
        n[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo)));
        n[1] = vcvtq_f32_u32(vmovl_high_u16(lo));
        n[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi)));
        n[3] = vcvtq_f32_u32(vmovl_high_u16(hi));
    }
    UNROLL for (int i = 0; i < 4; i++) v[i] = neg ? vnegq_f32(vmulq_f32(d[i], n[i])) : vmulq_f32(d[i], n[i]);
}

/* Kind 26: the top 2 bits of weights 4c..4c+3 (bits 2c, 2c + 1 of t) moved to bits 4, 5. The
 * shift is written out per c: it must be a literal. */
INLINE uint8x16_t k6_top(uint8x16_t t, const int c) {
    const uint8x16_t m = vdupq_n_u8(0x30);
    return c == 0 ? vandq_u8(vshlq_n_u8(t, 4), m) : c == 1 ? vandq_u8(vshlq_n_u8(t, 2), m)
         : c == 2 ? vandq_u8(t, m) : vandq_u8(vshrq_n_u8(t, 2), m);
}

/* Kind 15: bit c of t (bit 4 of chunk c's q) moved to bit 4, written out per c (a literal). */
INLINE uint8x16_t k5_top(uint8x16_t t, const int c) {
    const uint8x16_t m = vdupq_n_u8(0x10);
    return c == 0 ? vandq_u8(vshlq_n_u8(t, 4), m) : c == 1 ? vandq_u8(vshlq_n_u8(t, 3), m)
         : c == 2 ? vandq_u8(vshlq_n_u8(t, 2), m) : c == 3 ? vandq_u8(vshlq_n_u8(t, 1), m)
         : c == 4 ? vandq_u8(t, m) : c == 5 ? vandq_u8(vshrq_n_u8(t, 1), m)
         : c == 6 ? vandq_u8(vshrq_n_u8(t, 2), m) : vandq_u8(vshrq_n_u8(t, 3), m);
}

/* Kind 13: bits 2c, 2c + 1 of l (the low 2 bits of u), written out per c (a literal). */
INLINE uint8x16_t k3_low(uint8x16_t l, const int c) {
    const uint8x16_t m = vdupq_n_u8(0x03);
    return c == 0 ? vandq_u8(l, m) : c == 1 ? vandq_u8(vshrq_n_u8(l, 2), m)
         : c == 2 ? vandq_u8(vshrq_n_u8(l, 4), m) : vshrq_n_u8(l, 6);
}

/* Kind 13: bit c of t (bit 2 of chunk c's u) moved to bit 2, written out per c (a literal). */
INLINE uint8x16_t k3_top(uint8x16_t t, const int c) {
    const uint8x16_t m = vdupq_n_u8(0x04);
    return c == 0 ? vandq_u8(vshlq_n_u8(t, 2), m) : c == 1 ? vandq_u8(vshlq_n_u8(t, 1), m)
         : c == 2 ? vandq_u8(t, m) : c == 3 ? vandq_u8(vshrq_n_u8(t, 1), m)
         : c == 4 ? vandq_u8(vshrq_n_u8(t, 2), m) : c == 5 ? vandq_u8(vshrq_n_u8(t, 3), m)
         : c == 6 ? vandq_u8(vshrq_n_u8(t, 4), m) : vandq_u8(vshrq_n_u8(t, 5), m);
}

/* Block b of a group (wg: the block) against R <= R_MAX activation rows, added to acc. */
INLINE void block_dot(const uint8_t *wg, const int kind, int64_t nb, int64_t b, const gguf_acts_t *a, const int R,
                      const int P, float32x4_t acc[R_MAX][4]) {
    const int64_t qo = gguf_ints_offset(kind);
    const int nibbles = gguf_nibble_kind(kind), no_m = kind == GGUF_Q8 || gguf_no_min_super(kind);
    const uint8x16_t low4 = vdupq_n_u8(0x0f), top = vdupq_n_u8(0x80);
    float dx[R_MAX], sx[R_MAX];
    UNROLL for (int r = 0; r < R; r++) {
        dx[r] = a->dx[r * nb + b];
        if (!no_m) sx[r] = a->sx[r * nb + b];
    }
    float32x4_t d[4], d1[4], m[4];
    if (kind == GGUF_Q4 || kind == GGUF_Q8) {
        load_scales(wg, d);
        if (kind == GGUF_Q4) load_scales(wg + 32, m);
    } else if (kind == GGUF_F8) {
        UNROLL for (int i = 0; i < 4; i++) {
            d[i] = vld1q_f32((const float *)wg + 4 * i);
            d1[i] = vld1q_f32((const float *)(wg + 64) + 4 * i);
            m[i] = vld1q_f32((const float *)(wg + 128) + 4 * i);
        }
    } else {
        const uint8_t *sup = gguf_super_scales(wg, kind, nb, b);
        k_scales(sup, wg, !nibbles, 0, d);
        if (gguf_two_halves(kind)) k_scales(sup, wg + 16, 1, 0, d1);
        if (!no_m) k_scales(sup + 32, wg + (nibbles ? 16 : 32), 0, 1, m);
    }
    UNROLL for (int v = 0; v < 4; v++) {   /* rows 4v..4v+3 */
        int8x16_t w[8];
        if (nibbles) {
            UNROLL for (int c = 0; c < 4; c++) {
                const uint8x16_t p = vld1q_u8(wg + qo + 64 * c + 16 * v);
                w[c] = vreinterpretq_s8_u8(vandq_u8(p, low4));
                w[c + 4] = vreinterpretq_s8_u8(vshrq_n_u8(p, 4));
            }
            if (kind == GGUF_K5) {             /* bit 4 of chunk c's q is bit c of the top chunk */
                const uint8x16_t t = vld1q_u8(wg + qo + 256 + 16 * v);
                UNROLL for (int c = 0; c < 8; c++) w[c] = vorrq_s8(w[c], vreinterpretq_s8_u8(k5_top(t, c)));
            }
        } else if (kind == GGUF_X4) {          /* q = the table's value of each nibble (gguf_x4_byte, less 128) */
            const int8x16_t table = vld1q_s8(gguf_iq4_values);
            UNROLL for (int c = 0; c < 4; c++) {
                const uint8x16_t p = vld1q_u8(wg + qo + 64 * c + 16 * v);
                w[c] = vqtbl1q_s8(table, vandq_u8(p, low4));
                w[c + 4] = vqtbl1q_s8(table, vshrq_n_u8(p, 4));
            }
        } else if (kind == GGUF_K3) {          /* q = (low 2 bits | high bit << 2) - 4 (gguf_k3_byte) */
            const uint8x16_t l0 = vld1q_u8(wg + qo + 16 * v), l1 = vld1q_u8(wg + qo + 64 + 16 * v);
            const uint8x16_t t = vld1q_u8(wg + qo + 128 + 16 * v);
            UNROLL for (int c = 0; c < 4; c++) {
                const uint8x16_t u0 = vorrq_u8(k3_low(l0, c), k3_top(t, c));
                const uint8x16_t u1 = vorrq_u8(k3_low(l1, c), k3_top(t, c + 4));
                w[c] = vsubq_s8(vreinterpretq_s8_u8(u0), vdupq_n_s8(4));
                w[c + 4] = vsubq_s8(vreinterpretq_s8_u8(u1), vdupq_n_s8(4));
            }
        } else if (kind == GGUF_K6) {          /* q = (low 4 bits | top 2 bits << 4) - 32 (gguf_k6_byte) */
            const uint8x16_t t0 = vld1q_u8(wg + qo + 256 + 16 * v), t1 = vld1q_u8(wg + qo + 320 + 16 * v);
            UNROLL for (int c = 0; c < 4; c++) {
                const uint8x16_t p = vld1q_u8(wg + qo + 64 * c + 16 * v);
                const uint8x16_t u0 = vorrq_u8(vandq_u8(p, low4), k6_top(t0, c));
                const uint8x16_t u1 = vorrq_u8(vshrq_n_u8(p, 4), k6_top(t1, c));
                w[c] = vsubq_s8(vreinterpretq_s8_u8(u0), vdupq_n_s8(32));
                w[c + 4] = vsubq_s8(vreinterpretq_s8_u8(u1), vdupq_n_s8(32));
            }
        } else {
            UNROLL for (int c = 0; c < 8; c++)
                w[c] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(wg + qo + 64 * c + 16 * v), top));
        }
        UNROLL for (int r = 0; r < R; r++) {
            if (gguf_two_halves(kind)) {
                int32x4_t s0, s1;
                block_s_halves(w, a->xq + (r * nb + b) * 64, P, &s0, &s1);
                acc[r][v] = vaddq_f32(acc[r][v], vmulq_f32(vcvtq_f32_s32(s0), vmulq_n_f32(d[v], dx[r])));
                acc[r][v] = vaddq_f32(acc[r][v], vmulq_f32(vcvtq_f32_s32(s1), vmulq_n_f32(d1[v], dx[r])));
            } else {
                const float32x4_t s = vcvtq_f32_s32(block_s(w, a->xq + (r * nb + b) * 64, R, P));
                acc[r][v] = vaddq_f32(acc[r][v], vmulq_f32(s, vmulq_n_f32(d[v], dx[r])));
            }
            if (!no_m) acc[r][v] = vaddq_f32(acc[r][v], vmulq_n_f32(m[v], sx[r]));
        }
    }
}

/* Whether rows 0 .. R-1 all have one part in block b (mixed activations: their xb all zero). */
INLINE int one_part_block(const gguf_acts_t *a, const int R, int64_t nb, int64_t b) {
    uint8x16_t xb = vdupq_n_u8(0);
    UNROLL for (int r = 0; r < R; r++) {   /* gguf_xb_zero, by vector */
        const uint8_t *p = (const uint8_t *)a->xq + (r * nb + b) * 64 + 32;
        xb = vorrq_u8(xb, vorrq_u8(vld1q_u8(p), vld1q_u8(p + 16)));
    }
    return vmaxvq_u32(vreinterpretq_u32_u8(xb)) == 0;
}

/* A group against R <= R_MAX activation rows, block by block (block_dot), with mixed parts in runs
 * of one-part blocks (GGUF_BLOCK_RUNS). */
INLINE void group_dot(const uint8_t *wg, const int kind, int64_t nb, const gguf_acts_t *a, const int R, const int P,
                      float *out) {
    float32x4_t acc[R_MAX][4];
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int v = 0; v < 4; v++) acc[r][v] = vdupq_n_f32(0.f);
    GGUF_BLOCK_RUNS(block_dot, one_part_block, wg, kind, nb, a, R, P, acc);
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int v = 0; v < 4; v++) vst1q_f32(out + r * GGUF_ROWS + 4 * v, acc[r][v]);
}

/* kind, R and P (activation parts: 1 when every block has one) as constants: the accumulators
 * stay in registers, the loops unroll. */
#define KINDS_P(R, P) (kind == GGUF_Q4 ? group_dot(wg, GGUF_Q4, nb, a, R, P, out) \
                       : kind == GGUF_Q8 ? group_dot(wg, GGUF_Q8, nb, a, R, P, out) \
                       : kind == GGUF_K4 ? group_dot(wg, GGUF_K4, nb, a, R, P, out) \
                       : kind == GGUF_K5 ? group_dot(wg, GGUF_K5, nb, a, R, P, out) \
                       : kind == GGUF_K8 ? group_dot(wg, GGUF_K8, nb, a, R, P, out) \
                       : kind == GGUF_K6 ? group_dot(wg, GGUF_K6, nb, a, R, P, out) \
                       : kind == GGUF_K3 ? group_dot(wg, GGUF_K3, nb, a, R, P, out) \
                       : kind == GGUF_X4 ? group_dot(wg, GGUF_X4, nb, a, R, P, out) : group_dot(wg, GGUF_F8, nb, a, R, P, out))
#define KINDS(R) (a->parts == GGUF_ONE_PART ? KINDS_P(R, 1) : KINDS_P(R, 2))

static void group_dot_upto4(const uint8_t *wg, int64_t kind, int64_t nb, const gguf_acts_t *a, int R, float *out) {
    switch (R) {
        case 1: KINDS(1); break;
        case 2: KINDS(2); break;
        case 3: KINDS(3); break;
        default: KINDS(4); break;
    }
}

void gguf_group_dot(const uint8_t *wg, int64_t kind, int64_t nb, const gguf_acts_t *a, int R, float *out) {
    for (int r0 = 0; r0 < R; r0 += R_MAX) {
        const gguf_acts_t ar = gguf_acts_from_row(a, r0, nb);
        group_dot_upto4(wg, kind, nb, &ar, R - r0 < R_MAX ? R - r0 : R_MAX, out + r0 * GGUF_ROWS);
    }
}

/* The float32 tile (gguf_gemv.h): each half (16 rows: four float32x4 vectors) of the two
 * groups in its own pass over the slice, T = 4 tile rows: one vector load brings the 4 rows'
 * activations of a k, and vfmaq_laneq_f32 (one rounding, like fmaf) multiplies a weight vector
 * by one lane: 4 weight loads + 1 for 16 fused multiply-adds, 16 accumulators. */
#define F32_T 4

int gguf_f32_tile_rows(void) { return F32_T; }

void gguf_tile_f32(const float *wt, const float *xp, int64_t kc, int cont, float *acc) {
    for (int h = 0; h < 2; h++) {
        float32x4_t a[F32_T][4];
        UNROLL for (int r = 0; r < F32_T; r++)
            UNROLL for (int v = 0; v < 4; v++)
                a[r][v] = cont ? vld1q_f32(acc + r * GGUF_F32_N + 16 * h + 4 * v) : vdupq_n_f32(0.f);
        const float *w = wt + 16 * h, *x = xp;
        for (int64_t k = 0; k < kc; k++, w += GGUF_F32_N, x += F32_T) {
            const float32x4_t w0 = vld1q_f32(w), w1 = vld1q_f32(w + 4), w2 = vld1q_f32(w + 8), w3 = vld1q_f32(w + 12);
            const float32x4_t xv = vld1q_f32(x);
#define KV_LANE(r)                                     \
            a[r][0] = vfmaq_laneq_f32(a[r][0], w0, xv, r); \
            a[r][1] = vfmaq_laneq_f32(a[r][1], w1, xv, r); \
            a[r][2] = vfmaq_laneq_f32(a[r][2], w2, xv, r); \
            a[r][3] = vfmaq_laneq_f32(a[r][3], w3, xv, r);
            KV_LANE(0) KV_LANE(1) KV_LANE(2) KV_LANE(3)
#undef KV_LANE
        }
        UNROLL for (int r = 0; r < F32_T; r++)
            UNROLL for (int v = 0; v < 4; v++) vst1q_f32(acc + r * GGUF_F32_N + 16 * h + 4 * v, a[r][v]);
    }
}
