/* The contract between the GGUF block GEMV driver (gguf_gemv.c) and its per-ISA kernels
 * (gguf_gemv_avx512vnni.c, gguf_gemv_avx2.c, gguf_gemv_avxvnni.c, gguf_gemv_neon.c,
 * gguf_gemv_portable.c).
 *
 * Weights: the file's blocks, decoded without changing a value and interleaved at load time 16
 * output rows at a time (kvserve/ops/gguf_blocks.py) into one of the kinds below. Per block of 32
 * weights each row has integers q and float scales with w = d q + m (K-quants: d per half).
 * Per group of 16 rows and block of 32 weights (rows past N are zero):
 *   kind 4  (Q4_0, Q4_1):  d[16] fp16, m[16] fp16, then 4 chunks of 64 bytes: chunk c holds, for
 *           row i, the bytes (q[4c + t] | q[4c + 16 + t] << 4), t = 0..3, at offset 4 i + t,
 *           q in 0..15 (Q4_0: m = -8 d).                                                320 bytes
 *   kind 8  (Q8_0, Q5_0):  d[16] fp16, then 8 chunks of 64 bytes: chunk c holds q[4c + t] + 128
 *           (as u8) of row i at offset 4 i + t, q signed (Q5_0: its 5-bit q - 16).      544 bytes
 *   kind 14 (Q4_K):  sc[16] u8, mn[16] u8 (row i's 6-bit scale and min of the sub-block),
 *           then kind 4's nibble chunks.                                                288 bytes
 *   kind 18 (K-quant-like 8-bit weights; no GGUF type packs into it, its compact kinds 15, 26, 13
 *           and 24 unpack into its chunks):  s0[16] s8 (weights 0..15), s1[16] s8 (weights 16..31),
 *           mn[16] u8 (a 6-bit min, or 0 where the scales are per 16 weights), then kind 8's
 *           chunks of q + 128, q signed: chunks 0..3 are weights 0..15, chunks 4..7 weights
 *           16..31.                                                                     560 bytes
 *   kind 19 (Q5_1):  d0[16] fp32, d1[16] fp32, m[16] fp32 (d0 = d1: the block's d, m its min),
 *           then kind 18's chunks (q in 0..31): kind 18's sums with the scales as they are. 704 bytes
 *   kind 15 (Q5_K, in the file's 5 bits):  kind 14's scales and nibble chunks (the low 4 bits of
 *           q, 0..31), then one chunk of 64 bytes holding the top bits: byte 4 i + t, bit c is
 *           bit 4 of row i's weight 4c + t (c < 4) or 16 + 4(c - 4) + t (gguf_k5_top). Kind 14's
 *           sums and scales.                                                            352 bytes
 *   kind 26 (Q6_K, in the file's 6 bits):  s0[16] s8, s1[16] s8 (as kind 18), then 4 chunks of
 *           64 bytes holding the low 4 bits of u = q + 32 (0..63) as kind 4 holds its nibbles
 *           (low nibble: weights 0..15, high nibble: weights 16..31), then 2 chunks of 64 bytes
 *           holding the top 2 bits: chunk h (weights 16 h .. 16 h + 15), byte 4 i + t, bits
 *           2c, 2c + 1 are those of weight 16 h + 4c + t of row i. Unpacked, it is kind 18's
 *           chunk 4h + c with u in place of q + 128 (gguf_k6_byte): kind 18's sums less 32 sq
 *           instead of 128 sq, and no m term.                                           416 bytes
 *   kind 13 (Q3_K, in the file's 3 bits):  s0[16] s8, s1[16] s8 (as kind 26: the scales of
 *           weights 0..15 and 16..31), then 2 chunks of 64 bytes holding the low 2 bits of
 *           u = q + 4 (0..7): chunk h, byte 4 i + t, bits 2c, 2c + 1 are those of weight
 *           16 h + 4c + t of row i (kind 26's top-bit chunks), then one chunk of 64 bytes holding
 *           bit 2 of u as kind 15 holds its top bits (byte 4 i + t, bit c: kind 18's chunk c).
 *           Unpacked, it is kind 18's chunk c with u in place of q + 128 (gguf_k3_byte): kind
 *           26's sums, less 4 sq instead of 32 sq.                                     224 bytes
 *   kind 24 (IQ4_XS, in the file's 4 bits):  s[16] s8 (row i's 6-bit sub-scale less 32, one per
 *           block), then kind 4's nibble chunks of the 4-bit indices into the IQ4_NL table
 *           (gguf_iq4_values). Unpacked, it is kind 8's chunk c with value + 128 of the index
 *           (gguf_x4_byte): kind 8's sums with d = D s.                               272 bytes
 *   kind 10 (Q2_K):  sc0[16] u8, sc1[16] u8 (the 4-bit scales of weights 0..15 and 16..31),
 *           mn0[16] u8, mn1[16] u8 (their 4-bit mins), then kind 4's nibble chunks (q in 0..3).
 *                                                                                       320 bytes
 *   kind 32 (F32, F16, BF16 weights, all exact in float32):  32 rows of 16 float32, weight j of
 *           row i at byte 64 j + 4 i.                                                  2048 bytes
 *   kind 33 (F16 weights, in the file's 16 bits):  kind 32's layout with fp16 values, weight j of
 *           row i at byte 32 j + 2 i; kind 34 (BF16) the same with bf16 values. Each value
 *           widened to float32 (exactly) is kind 32's, and so is every result.        1024 bytes
 *   Kinds 10, 32, 33 and 34 run one kernel source in every build (gguf_gemv_generic.h: 16-lane vector
 *   types each build compiles with its own target flags), called by the driver.
 *   The K-quant kinds (14, 15, 18, 26, 13, 24, 10) keep the file's super-block scales once per 8
 *   blocks: before a group's nb blocks (nb a multiple of 8), per super-block of 256 weights d[16]
 *   fp16, then (kinds 14, 15, 18, 10) dmin[16] fp16 of its 16 rows (gguf_super_scales): 64 bytes,
 *   32 for kinds 26, 13 and 24 (no min). Before, not after: a decode step then reads the weights
 *   as one unbroken stream (gguf_group_blocks), which the hardware prefetcher follows across
 *   groups; a hole of skipped bytes at every group's end stalls it.
 *   A row's float scales are then d0 = d s0, d1 = d s1 (kind 14: d sc), m = -(dmin mn): an fp16
 *   times an integer below 2^8, exact in float32, the values the file's own dequantization
 *   multiplies by.
 * Every product d q is exact in float32 (at most 24 significant bits), so w = d q + m rounds
 * once, as gguf's own dequantization.
 *
 * Activations: each row, per block of 32, becomes two signed 8-bit parts (gguf_gemv.c,
 * quantize_block): v = x 127 / max|x|, xa = rint(v), xb = rint((v - xa) 256) clamped to +-127, so
 * x ~= dx (256 xa + xb) with dx = max|x| / (127 256): about 15 bits. How many parts a block keeps
 * is the activations' `parts` (gguf_acts_t):
 *   GGUF_TWO_PARTS (the gguf format): every block both parts.
 *   GGUF_ONE_PART (gguf-a8): one part, as llama.cpp does: every xb = 0 and sx = dx sq, the sum of
 *       the quantized values, so the m term's error cancels the d q term's.
 *   GGUF_MIXED_PARTS (gguf-mixed): per block, one part where the second one carries little:
 *       the block keeps xb (and sx = the float sum) when sum xb^2 >= 4 sum xa^2 (the residual
 *       holds at least 2^-14 of the block's energy: blocks with an outlier, whose other values
 *       one part would round away), else it is a one-part block as above. Integers: the choice
 *       is the same on every build. The line is where every kind of eval-quality's varied text
 *       (code, prose, chat, eight languages) keeps the top-1 bound (at 2^-13 most languages
 *       other than English and French do not: docs/methodology.md).
 * The formulas below are the same for every block: a zero xb contributes nothing, so a kernel
 * that skips the xb products of a block whose xb are all zero (every block with one part, any
 * block with mixed parts; gguf_xb_zero) gives the bits of one that multiplies the zeros. One part
 * is just outside eval-quality's top-1 bound on the default model, so it is opt-in; mixed parts
 * are inside it (figures: docs/benchmarks.md).
 *
 * What every kernel computes, exactly (the same bits on every ISA; tests compare them):
 *   for each of the 16 rows i and each activation row r < R:
 *     acc = 0
 *     for each block b, in order:
 *       kinds 4, 8, 14, 15, 24:
 *         s   = sum_j q_ij (256 xa_rj + xb_rj)          integers, exact in int32
 *         acc = acc + (float)s * (d_i * dx_rb)           float32, rounded after each operation
 *         kinds 4, 14, 15: acc = acc + m_i * sx_rb           sx: the float sum of the block's x (a one-part block: dx sq)
 *       kinds 18, 19, 26, 13:
 *         s0  = sum_{j<16} q_ij (256 xa_rj + xb_rj),  s1 = the same over j >= 16
 *         acc = acc + (float)s0 * (d0_i * dx_rb)
 *         acc = acc + (float)s1 * (d1_i * dx_rb)
 *         kinds 18, 19: acc = acc + m_i * sx_rb
 *       kind 10 (m0, m1: each half's min -(dmin mn); sums of the quantized x, sq0 and sq - sq0):
 *         s0, s1 as kind 18's, q in 0..3
 *         acc = acc + (float)s0 * (d0_i * dx_rb)
 *         acc = acc + (float)s1 * (d1_i * dx_rb)
 *         acc = acc + m0_i * (dx_rb * (float)sq0_rb)
 *         acc = acc + m1_i * (dx_rb * (float)(sq_rb - sq0_rb))
 *       kinds 32, 33, 34 (w the float weights, x16 = 256 xa + xb):
 *         s   = 0;  for j = 0 .. 31 in order:  s = s + w_ij * (float)x16_rj
 *         acc = acc + s * dx_rb
 *     out[r * 16 + i] = acc
 * No fused multiply-add: a separate multiply and add round the same way in SIMD lanes and in
 * scalar code, so builds are bit-identical (they are compiled with -ffp-contract=off).
 *
 * The float32 GEMM (prompt tokens, gguf_gemm_f32_team in gguf_gemv.c): compute-bound work, where
 * the two-part integer dot products above run at about half the rate of float32 fused
 * multiply-adds on the same cores. Two groups' weights (32 rows) are dequantized slice by slice
 * into wt[k][32] (float32, w = d q + m: the product is exact, so one rounding, as gguf's own
 * dequantization), activation rows are packed in tiles xp[k][T] (T = gguf_f32_tile_rows(),
 * rows past the end zero), and
 *   for each of the 32 rows i and tile row r:
 *     acc = 0;  for k = 0 .. K-1 in order:  acc = fma(wt[k][i], xp[k][r], acc)
 *     out[r][i] = acc
 * with an explicit fused multiply-add (one rounding) in every build: the same bits on every ISA.
 */
#ifndef KVSERVE_GGUF_GEMV_H
#define KVSERVE_GGUF_GEMV_H

#include <stdint.h>
#include <string.h>

#include "half.h"

#define GGUF_ROWS 16         /* output rows per interleaved group */
#define GGUF_TILE_M 8        /* activation rows per pass over a group's weights */
#define GGUF_F32_N 32        /* weight rows per float32 tile: two groups */
#define GGUF_F32_KC 128      /* k per slice of the float32 GEMM (16 KB of two groups' weights) */
#define GGUF_F32_MC 192      /* activation rows per chunk of the float32 GEMM */
#define GGUF_F32_FEW 4       /* float weights against at most this many rows: without tiles */

/* The packed kinds (above) and the bytes of one block of 32 weights of a group; 0: not a kind. */
enum { GGUF_Q4 = 4, GGUF_Q8 = 8, GGUF_K4 = 14, GGUF_K8 = 18, GGUF_F8 = 19, GGUF_K6 = 26, GGUF_K2 = 10, GGUF_W32 = 32,
       GGUF_K5 = 15, GGUF_K3 = 13, GGUF_X4 = 24, GGUF_W16 = 33, GGUF_B16 = 34 };
static inline int64_t gguf_packed_block_bytes(int64_t kind) {
    return kind == GGUF_Q4 ? 320 : kind == GGUF_Q8 ? 544 : kind == GGUF_K4 ? 288 : kind == GGUF_K8 ? 560
         : kind == GGUF_F8 ? 704 : kind == GGUF_K6 ? 416 : kind == GGUF_K2 ? 320 : kind == GGUF_W32 ? 2048
         : kind == GGUF_K5 ? 352 : kind == GGUF_K3 ? 224 : kind == GGUF_X4 ? 272
         : kind == GGUF_W16 || kind == GGUF_B16 ? 1024 : 0;
}

/* Whether a kind runs the kernels of gguf_gemv_generic.h (kinds 10, 32, 33, 34). */
static inline int gguf_generic_kind(int64_t kind) {
    return kind == GGUF_K2 || kind == GGUF_W32 || kind == GGUF_W16 || kind == GGUF_B16;
}

/* The 16 values an IQ4_NL / IQ4_XS index stands for (ggml's kvalues_iq4nl). */
static const int8_t gguf_iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* Whether a kind keeps 4-bit values in kind 4's nibble chunks (kind 15: plus a top bit each). */
static inline int gguf_nibble_kind(int64_t kind) { return kind == GGUF_Q4 || kind == GGUF_K4 || kind == GGUF_K5; }

/* Kind 15: the top bit (bit 4 of q) of kind 18's chunk c (weights 4c..4c+3, c >= 4: 16 + 4(c - 4)..)
 * of row i, t-th weight, from the block's top-bit chunk (blk: the block). */
static inline int32_t gguf_k5_top(const uint8_t *blk, int c, int i, int t) {
    return ((blk[32 + 256 + 4 * i + t] >> c) & 1) << 4;
}

/* Whether a kind sums weights 0..15 and 16..31 apart, each with its own scale (kinds 18, 19, 26). */
static inline int gguf_two_halves(int64_t kind) {
    return kind == GGUF_K8 || kind == GGUF_F8 || kind == GGUF_K6 || kind == GGUF_K3;
}

/* Whether a kind keeps super-block scales before its blocks (the K-quant kinds). */
static inline int gguf_has_super(int64_t kind) {
    return kind == GGUF_K4 || kind == GGUF_K8 || kind == GGUF_K6 || kind == GGUF_K2 || kind == GGUF_K5
        || kind == GGUF_K3 || kind == GGUF_X4;
}

/* Whether a kind's super-block scales are d only (no dmin) and its weights no m. */
static inline int gguf_no_min_super(int64_t kind) { return kind == GGUF_K6 || kind == GGUF_K3 || kind == GGUF_X4; }

/* The bytes of a group's super-block scales per 8 blocks (0: none). */
static inline int64_t gguf_super_bytes(int64_t kind) {
    return gguf_no_min_super(kind) ? 32 : gguf_has_super(kind) ? 64 : 0;
}

/* The bytes of one group of nb blocks: (K-quant kinds) their super-block scales, then its blocks. */
static inline int64_t gguf_group_bytes(int64_t kind, int64_t nb) {
    return nb / 8 * gguf_super_bytes(kind) + nb * gguf_packed_block_bytes(kind);
}

/* Block 0 of group g of a packed weight (w: its first byte; nb blocks a row): what the kernels
 * take as a group, block b at + b gguf_packed_block_bytes(kind). */
static inline const uint8_t *gguf_group_blocks(const uint8_t *w, int64_t kind, int64_t nb, int64_t g) {
    return w + g * gguf_group_bytes(kind, nb) + nb / 8 * gguf_super_bytes(kind);
}

/* The super-block scales of block b of a group of nb blocks (blk: block b's bytes): d[16] fp16,
 * then (kinds 14, 15, 18, 10) dmin[16] fp16. */
static inline const uint8_t *gguf_super_scales(const uint8_t *blk, int64_t kind, int64_t nb, int64_t b) {
    return blk - b * gguf_packed_block_bytes(kind) - (nb / 8 - (b >> 3)) * gguf_super_bytes(kind);
}

/* Kind 26: the byte u = q + 32 (0..63) of row i's weight 4c + t (c < 4) or 16 + 4(c - 4) + t
 * (c >= 4) of a block (blk: the block), as kind 18's chunk c would hold q + 128 less 96. */
static inline int32_t gguf_k6_byte(const uint8_t *blk, int c, int i, int t) {
    const uint8_t lo = blk[32 + 64 * (c & 3) + 4 * i + t], hi = blk[32 + 256 + 64 * (c >> 2) + 4 * i + t];
    return (int32_t)(((c < 4 ? lo & 15 : lo >> 4)) | (((hi >> (2 * (c & 3))) & 3) << 4));
}

/* Kind 13: the byte u = q + 4 (0..7) of row i's weight 4c + t (c < 4) or 16 + 4(c - 4) + t
 * (c >= 4) of a block (blk: the block), as kind 18's chunk c would hold q + 128 less 124. */
static inline int32_t gguf_k3_byte(const uint8_t *blk, int c, int i, int t) {
    const uint8_t lo = blk[32 + 64 * (c >> 2) + 4 * i + t], hi = blk[32 + 128 + 4 * i + t];
    return (int32_t)(((lo >> (2 * (c & 3))) & 3) | (((hi >> c) & 1) << 2));
}

/* Kind 24: value + 128 of row i's weight 4c + t (c < 4) or 16 + 4(c - 4) + t (c >= 4) of a block
 * (blk: the block), as kind 8's chunk c holds it. */
static inline int32_t gguf_x4_byte(const uint8_t *blk, int c, int i, int t) {
    const uint8_t v = blk[16 + 64 * (c & 3) + 4 * i + t];
    return (int32_t)gguf_iq4_values[c < 4 ? v & 15 : v >> 4] + 128;
}

/* Every kernel prefetches the block GGUF_PREFETCH blocks ahead of the one it multiplies (all its
 * cache lines; a prefetch past the end of the weights never faults). Batch-1 decode streams each
 * matrix once from memory, and the hardware prefetcher alone ramps up too slowly on these short
 * streams (timings: docs/benchmarks.md). */
#define GGUF_PREFETCH 16
static inline __attribute__((always_inline)) void gguf_prefetch_block(const uint8_t *wg, int64_t pb) {
    const uint8_t *p = wg + GGUF_PREFETCH * pb;
    for (int64_t o = 0; o < pb; o += 64) __builtin_prefetch(p + o, 0, 3);
}

/* Activations of one pass: R rows of nb blocks each. xq holds, per (row, block), 64 s8 values:
 * the 32 xa, then the 32 xb; x16 the same 32 values as 256 xa + xb (|.| <= 32639: int16, for
 * kernels that multiply 16-bit lanes). dx: scale; sx: sum of the block's float x (the m term); sq:
 * 256 sum xa + sum xb (for kernels that store 8-bit weights offset by 128), sq0 the same over
 * j < 16 (kind 18's first half; its second half's is sq - sq0). */
enum { GGUF_TWO_PARTS = 0, GGUF_ONE_PART = 1, GGUF_MIXED_PARTS = 2 };
typedef struct {
    const int8_t *xq;
    const int16_t *x16;
    const float *dx, *sx;
    const int32_t *sq, *sq0;
    int parts;               /* GGUF_ONE_PART: every xb is 0 (kernels may skip the xb products);
                                GGUF_MIXED_PARTS: some blocks' xb are (gguf_xb_zero); else two parts */
} gguf_acts_t;

/* Whether the xb of block b of activation row r are all zero (a one-part block). */
static inline int gguf_xb_zero(const gguf_acts_t *a, int64_t r, int64_t nb, int64_t b) {
    uint64_t w[4];
    memcpy(w, a->xq + (r * nb + b) * 64 + 32, 32);
    return !(w[0] | w[1] | w[2] | w[3]);
}

/* Blocks b0 .. b1 - 1 of a group in order, each added to acc by BODY(wb, kind, nb, b, a, R, P, acc)
 * (R, P constants; wb: block b's bytes, at base + (b - b0) stride, prefetched GGUF_PREFETCH
 * blocks ahead when PF). With mixed parts (P == 2) the blocks go in runs: those where
 * ONE_PART(a, R, nb, b) says every row of the pass has a zero xb through BODY with P = 1 (the xa
 * products only: the same integers), in one loop, and each other block through BODY with P = 2.
 * One loop per body: a branch between the two bodies inside one loop holds the registers of
 * both, which slows the mixed GEMV on blocks that all have one part. */
#define GGUF_BLOCK_RUNS_IN(BODY, ONE_PART, base, stride, PF, b0, b1, kind, nb, a, R, P, acc)     \
    do {                                                                                         \
        const int64_t st_ = (stride), b0_ = (b0), b1_ = (b1);                                    \
        if ((P) == 2 && (a)->parts == GGUF_MIXED_PARTS) {                                        \
            for (int64_t b_ = b0_; b_ < b1_;) {                                                  \
                for (; b_ < b1_ && ONE_PART(a, R, nb, b_); b_++) {                               \
                    if (PF) gguf_prefetch_block((base) + (b_ - b0_) * st_, st_);                 \
                    BODY((base) + (b_ - b0_) * st_, kind, nb, b_, a, R, 1, acc);                 \
                }                                                                                \
                if (b_ < b1_) {                                                                  \
                    if (PF) gguf_prefetch_block((base) + (b_ - b0_) * st_, st_);                 \
                    BODY((base) + (b_ - b0_) * st_, kind, nb, b_, a, R, 2, acc);                 \
                    b_++;                                                                        \
                }                                                                                \
            }                                                                                    \
        } else {                                                                                 \
            for (int64_t b_ = b0_; b_ < b1_; b_++) {                                             \
                if (PF) gguf_prefetch_block((base) + (b_ - b0_) * st_, st_);                     \
                BODY((base) + (b_ - b0_) * st_, kind, nb, b_, a, R, P, acc);                     \
            }                                                                                    \
        }                                                                                        \
    } while (0)

/* Every block of a group (wg: its bytes), GGUF_BLOCK_RUNS_IN over the packed blocks. */
#define GGUF_BLOCK_RUNS(BODY, ONE_PART, wg, kind, nb, a, R, P, acc)                              \
    GGUF_BLOCK_RUNS_IN(BODY, ONE_PART, wg, gguf_packed_block_bytes(kind), 1, 0, nb, kind, nb, a, R, P, acc)

/* The activations of rows r0.. of `a` (nb blocks a row): kernels that take fewer than
 * GGUF_TILE_M rows per pass over a group's weights run the rest from here. */
static inline gguf_acts_t gguf_acts_from_row(const gguf_acts_t *a, int64_t r0, int64_t nb) {
    const gguf_acts_t ar = {a->xq + r0 * nb * 64, a->x16 + r0 * nb * 32, a->dx + r0 * nb, a->sx + r0 * nb,
                            a->sq + r0 * nb, a->sq0 + r0 * nb, a->parts};
    return ar;
}

/* The per-ISA kernel: one group of 16 rows (wg: the first of its nb packed blocks,
 * gguf_group_blocks) against R <= GGUF_TILE_M activation rows; out[r * 16 + i]. kind: GGUF_Q4, GGUF_Q8, GGUF_K4, GGUF_K5, GGUF_K8, GGUF_F8, GGUF_K6,
 * GGUF_K3 or GGUF_X4. */
void gguf_group_dot(const uint8_t *wg, int64_t kind, int64_t nb, const gguf_acts_t *a, int R, float *out);

/* The per-ISA float32 tile: acc[r * 32 + i] for r < gguf_f32_tile_rows(), continued over kc
 * more k (wt: kc rows of two groups' dequantized weights [k][32], xp: the tile's kc rows [k][T]),
 * from 0 (cont = 0) or from the values in acc (cont = 1). */
void gguf_tile_f32(const float *wt, const float *xp, int64_t kc, int cont, float *acc);
int gguf_f32_tile_rows(void);

/* The name of the instruction set the kernel was written for ("avx512vnni", "avx2", "neon",
 * "portable"). */
const char *gguf_kernel_isa(void);

/* Row r of a packed weight of K columns as float32 (gguf_gemv.c). */
void gguf_dequantize_row(const uint8_t *w, int64_t kind, int64_t K, int64_t r, float *out);

static inline uint16_t gguf_load_u16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return h; }
static inline float gguf_load_f32(const uint8_t *p) { float f; memcpy(&f, p, 4); return f; }

/* Row i's scales of block b of a group of nb packed blocks (blk: block b's bytes): d (kinds 18,
 * 19, 26, 13: d0), the second half's d1 (others: d), and m (0 for kinds 8, 26, 13 and 24). */
static inline void gguf_row_scales(const uint8_t *blk, int64_t kind, int64_t nb, int64_t b, int i, float *d0,
                                   float *d1, float *m) {
    if (kind == GGUF_Q4 || kind == GGUF_Q8) {
        *d0 = *d1 = half_to_float(gguf_load_u16(blk + 2 * i));
        *m = kind == GGUF_Q4 ? half_to_float(gguf_load_u16(blk + 32 + 2 * i)) : 0.f;
        return;
    }
    if (kind == GGUF_F8) {
        *d0 = gguf_load_f32(blk + 4 * i);
        *d1 = gguf_load_f32(blk + 64 + 4 * i);
        *m = gguf_load_f32(blk + 128 + 4 * i);
        return;
    }
    const uint8_t *sup = gguf_super_scales(blk, kind, nb, b);
    const float d = half_to_float(gguf_load_u16(sup + 2 * i));
    if (kind == GGUF_X4) {
        *d0 = *d1 = d * (float)(int8_t)blk[i];
        *m = 0.f;
        return;
    }
    if (kind == GGUF_K6 || kind == GGUF_K3) {
        *d0 = d * (float)(int8_t)blk[i];
        *d1 = d * (float)(int8_t)blk[16 + i];
        *m = 0.f;
        return;
    }
    const float dmin = half_to_float(gguf_load_u16(sup + 32 + 2 * i));
    if (kind == GGUF_K4 || kind == GGUF_K5) {
        *d0 = *d1 = d * (float)blk[i];
        *m = -(dmin * (float)blk[16 + i]);
    } else {
        *d0 = d * (float)(int8_t)blk[i];
        *d1 = d * (float)(int8_t)blk[16 + i];
        *m = -(dmin * (float)blk[32 + i]);
    }
}

/* Byte offset of a packed block's integer chunks (after its scales). */
static inline int64_t gguf_ints_offset(int64_t kind) {
    return kind == GGUF_Q4 || kind == GGUF_K2 ? 64 : kind == GGUF_Q8 ? 32 : kind == GGUF_K4 ? 32
         : kind == GGUF_K8 ? 48 : kind == GGUF_K6 || kind == GGUF_K5 || kind == GGUF_K3 ? 32
         : kind == GGUF_X4 ? 16 : 192;
}

#endif
