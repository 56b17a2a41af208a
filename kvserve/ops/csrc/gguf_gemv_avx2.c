/* gguf_group_dot (gguf_gemv.h) for AVX2 (Haswell and later, AMD Zen): a 256-bit register holds
 * 4 weights of 8 rows, so a group of 16 rows is two halves. AVX2 has no vpdpbusd: vpmaddubsw
 * multiplies u8 weights by s8 activations into pairs summed in int16, vpmaddwd widens to int32.
 *   4-bit kinds (q in 0..15): a pair is at most 2 * 15 * 127 = 3810, so the 8 chunks of a block
 *       add up in int16 (<= 30480) before one widening per part.
 *   6- and 3-bit kinds (26, 13: u = q + 32 in 0..63, q + 4 in 0..7): a pair is at most
 *       2 * 63 * 127 = 16002, so two chunks add up in int16 before one widening per part; the
 *       bias (32 or 4) times the part's sum of x is taken off once a block.
 *   8-bit kinds: the stored u8 (q + 128) times an s8 part would saturate vpmaddubsw's int16
 *       (255 * 127 * 2). They take both parts at once instead: the weights widened to 16 bits
 *       times x16 = 256 xa + xb (an int16) by vpmaddwd, then 128 sum x16 (sq) taken off: half the
 *       operations of two signed-byte passes, which needed vpabsb/vpsignb per chunk and part.
 * Both give the exact integer s, so the results are the portable kernel's, bit for bit.
 *
 * Register use decides the speed here (16 ymm registers). A pass takes both halves of the group
 * (16 rows) against 2 activation rows: the chunk's weight registers serve both rows and both
 * parts, each activation broadcast serves both halves, and the int16/int32 sums of the pass fit
 * beside them. Passes of 4 rows over one half at a time spilled the weights, and every multiply
 * then waited on two loads (a stack reload and a broadcast); tiles of more than 2 rows unpack each
 * block once for all their passes (ready_group_avx.h). The empty asm after each chunk keeps
 * GCC from reassociating the integer sums across chunks (it would compute every product first and
 * spill them all).
 * Build: -mavx2 -mfma -mf16c (x86-64-v3). */
#include <immintrin.h>
#include <string.h>

#include "gguf_gemv.h"
#include "k_scales_avx.h"
#include "one_part_avx.h"

const char *gguf_kernel_isa(void) { return "avx2"; }

#define R_MAX 2     /* activation rows per pass (above; group_dot_pairs.h runs them) */

/* Keep the sums in registers in the order written (above). */
#define KEEP_ORDER(v) __asm__("" : "+x"(v))

/* s = sum_j q_j x16_j from the stored u = q + bias (128; kinds 26, 13: 32, 4): minus bias sum_j x16_j (sq). */
static inline __attribute__((always_inline)) __m256 unbias(__m256i su, int32_t sq, int32_t bias) {
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(su, _mm256_set1_epi32(bias * sq)));
}

static inline __attribute__((always_inline)) __m256 two_parts(__m256i sa, __m256i sb) {
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(sa, 8), sb));
}


/* Chunk c (w: nibble_chunk's bytes) of block b against R <= 2 activation rows: each row's part bytes
 * (xa, xb) at 4c and 4c + 16 broadcast, multiplied by vpmaddubsw and added to s[row][part][half].
 * Sums in int16 (4-bit pairs <= 2 * 15 * 127: the 8 chunks of a block <= 30480); kind 15's pairs
 * reach 2 * 31 * 127, so its sums are widened to int32 every chunk. */
static inline __attribute__((always_inline)) void
q4_products(const __m256i w[4], const int kind, const int c, const gguf_acts_t *a, int64_t nb, int64_t b, const int R,
            const int P, __m256i s[R_MAX][2][2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; r++) {
        const int32_t *x4 = (const int32_t *)(a->xq + (r * nb + b) * 64);
        for (int p = 0; p < P; p++) {
            const __m256i xl = _mm256_set1_epi32(x4[8 * p + c]), xh = _mm256_set1_epi32(x4[8 * p + c + 4]);
            __m256i t0 = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], xl), _mm256_maddubs_epi16(w[2], xh));
            __m256i t1 = _mm256_add_epi16(_mm256_maddubs_epi16(w[1], xl), _mm256_maddubs_epi16(w[3], xh));
            if (kind == GGUF_K5) {
                t0 = _mm256_madd_epi16(t0, ones);
                t1 = _mm256_madd_epi16(t1, ones);
                s[r][p][0] = c ? _mm256_add_epi32(s[r][p][0], t0) : t0;
                s[r][p][1] = c ? _mm256_add_epi32(s[r][p][1], t1) : t1;
            } else {
                s[r][p][0] = c ? _mm256_add_epi16(s[r][p][0], t0) : t0;
                s[r][p][1] = c ? _mm256_add_epi16(s[r][p][1], t1) : t1;
            }
            KEEP_ORDER(s[r][p][0]);
            KEEP_ORDER(s[r][p][1]);
        }
    }
}

/* A 4-bit block's sums (q4_products over its 4 chunks) into acc: widened once (kinds 4, 14),
 * s = 256 sa + sb (P = 1: every xb zero, 256 sa), then acc += s d dx + m sx per row and half. */
static inline __attribute__((always_inline)) void
q4_finish(__m256i s[R_MAX][2][2], const __m256 d[2], const __m256 m[2], const int kind, const gguf_acts_t *a,
          int64_t nb, int64_t b, const int R, const int P, __m256 acc[R_MAX][2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int k5 = kind == GGUF_K5;
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < R; r++) {
            const int64_t rb = r * nb + b;
            const __m256i sa = k5 ? s[r][0][h] : _mm256_madd_epi16(s[r][0][h], ones);
            const __m256 sf = P == 2 ? two_parts(sa, k5 ? s[r][1][h] : _mm256_madd_epi16(s[r][1][h], ones))
                                     : _mm256_cvtepi32_ps(_mm256_slli_epi32(sa, 8));
            acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(sf, _mm256_mul_ps(d[h], _mm256_set1_ps(a->dx[rb]))));
            acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(m[h], _mm256_set1_ps(a->sx[rb])));
        }
}

/* Block b of a 4-bit group (kinds 4, 14, 15; 16 rows; wg: the block) against R <= 2 activation
 * rows, added to acc: the 4 chunks unpacked in registers, each serving every row and part. */
static inline __attribute__((always_inline)) void
q4_block(const uint8_t *wg, const int kind, int64_t nb, int64_t b, const gguf_acts_t *a, const int R, const int P,
         __m256 acc[R_MAX][2]) {
    __m256i s[R_MAX][2][2];                    /* [row][part][half]; kind 15: int32 sums */
    for (int c = 0; c < 4; c++) {
        __m256i w[4];
        nibble_chunk(wg, kind, c, w);
        q4_products(w, kind, c, a, nb, b, R, P, s);
    }
    const __m256 d[2] = {block_scale(wg, kind, nb, b, 0, 0), block_scale(wg, kind, nb, b, 0, 1)};
    const __m256 m[2] = {block_min(wg, kind, nb, b, 0), block_min(wg, kind, nb, b, 1)};
    q4_finish(s, d, m, kind, a, nb, b, R, P, acc);
}

/* Chunks c, c + 1 of half `part` of a kind-26 or kind-13 block (u: their bytes per rows half,
 * k6_chunk / k3_chunk) against R <= 2 activation rows: the two chunks' pairs added in int16
 * (<= 2 * 16002), widened once, added to s[row][part][half] in int32. */
static inline __attribute__((always_inline)) void
small_products(const __m256i u[2][2], const int c, const int part, const gguf_acts_t *a, int64_t nb, int64_t b,
               const int R, const int P, __m256i s[R_MAX][2][2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; r++) {
        const int32_t *x4 = (const int32_t *)(a->xq + (r * nb + b) * 64);
        for (int p = 0; p < P; p++) {
            const __m256i x0 = _mm256_set1_epi32(x4[8 * p + c]), x1 = _mm256_set1_epi32(x4[8 * p + c + 1]);
            for (int h = 0; h < 2; h++) {
                const __m256i t16 = _mm256_add_epi16(_mm256_maddubs_epi16(u[0][h], x0),
                                                     _mm256_maddubs_epi16(u[1][h], x1));
                const __m256i t = _mm256_madd_epi16(t16, ones);
                s[r][p][h] = c == 4 * part ? t : _mm256_add_epi32(s[r][p][h], t);
                KEEP_ORDER(s[r][p][h]);
            }
        }
    }
}

/* Half `part` of a kind-26 or kind-13 block (its sums s, its scales d per rows half) into acc:
 * s = 256 sa + sb - bias sq_half, the integer q8_rows forms from x16, so the same floats. */
static inline __attribute__((always_inline)) void
small_finish(__m256i s[R_MAX][2][2], const __m256 d[2], const int part, const int kind, const gguf_acts_t *a,
             int64_t nb, int64_t b, const int R, const int P, __m256 acc[R_MAX][2]) {
    const int32_t bias = kind == GGUF_K6 ? 32 : 4;     /* the stored u less q */
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < R; r++) {
            const int64_t rb = r * nb + b;
            const int32_t sq = part == 0 ? a->sq0[rb] : a->sq[rb] - a->sq0[rb];
            const __m256i sa = _mm256_slli_epi32(s[r][0][h], 8);
            const __m256 sf = unbias(P == 2 ? _mm256_add_epi32(sa, s[r][1][h]) : sa, sq, bias);
            acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(sf, _mm256_mul_ps(d[h], _mm256_set1_ps(a->dx[rb]))));
        }
}

/* The bytes u of chunk c, rows half h, of a kind-26 or kind-13 block (wg: the block). */
static inline __attribute__((always_inline)) __m256i small_chunk(const uint8_t *wg, const int kind, const int c,
                                                                 const int h) {
    const int64_t qo = gguf_ints_offset(kind);
    return kind == GGUF_K6 ? k6_chunk(wg + qo, c, h) : k3_chunk(wg + qo, c, h);
}

/* Block b of a kind-26 or kind-13 group (16 rows; wg: the block) against R <= 2 activation rows,
 * added to acc. Per half of the block's weights (kind 18's chunks 0..3, scale d0; 4..7, d1) and
 * per two chunks: the unpacked u of rows 0..7 and 8..15 times each row's broadcast part bytes
 * (small_products). P = 1 (every xb of the block zero): the xa products only. */
static inline __attribute__((always_inline)) void
small_block(const uint8_t *wg, const int kind, int64_t nb, int64_t b, const gguf_acts_t *a, const int R,
            const int P, __m256 acc[R_MAX][2]) {
    #pragma GCC unroll 2
    for (int part = 0; part < 2; part++) {         /* unrolled: chunk c a constant (k6_chunk's shifts) */
        __m256i s[R_MAX][2][2];                    /* [row][activation part][rows half]: int32 */
        #pragma GCC unroll 2
        for (int c = 4 * part; c < 4 * part + 4; c += 2) {
            __m256i u[2][2];                       /* [chunk c, c + 1][rows half] */
            for (int k = 0; k < 2; k++)
                for (int h = 0; h < 2; h++) u[k][h] = small_chunk(wg, kind, c + k, h);
            small_products((const __m256i(*)[2])u, c, part, a, nb, b, R, P, s);
        }
        const __m256 d[2] = {block_scale(wg, kind, nb, b, part, 0), block_scale(wg, kind, nb, b, part, 1)};
        small_finish(s, d, part, kind, a, nb, b, R, P, acc);
    }
}

/* Block b through the byte-product body of its kind: q4_block (4- and 5-bit), small_block (6-
 * and 3-bit). */
static inline __attribute__((always_inline)) void
byte_block(const uint8_t *wg, const int kind, int64_t nb, int64_t b, const gguf_acts_t *a, const int R, const int P,
           __m256 acc[R_MAX][2]) {
    if (gguf_nibble_kind(kind)) q4_block(wg, kind, nb, b, a, R, P, acc);
    else small_block(wg, kind, nb, b, a, R, P, acc);
}

/* A 4-, 5-, 6- or 3-bit group against R <= 2 activation rows, block by block (byte_block), with
 * mixed parts in runs of one-part blocks (GGUF_BLOCK_RUNS). */
static inline __attribute__((always_inline)) void
byte_rows(const uint8_t *wg, const int kind, int64_t nb, const gguf_acts_t *a, const int R, const int P, float *out) {
    __m256 acc[R_MAX][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    GGUF_BLOCK_RUNS(byte_block, one_part_block, wg, kind, nb, a, R, P, acc);
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + r * GGUF_ROWS + 8 * h, acc[r][h]);
}

/* An 8-bit group (kinds 8, 18, 19 and 24, 16 rows; 24 unpacked to 8 bits) against R <= 2 activation rows. Chunk c's 64 bytes
 * hold u = q[4c .. 4c+3] + 128 of rows 0..3, 4..7, 8..11, 12..15: widened to 16 bits once for
 * both rows (four registers), each multiplied by the row's broadcast 4 values of x16; vpmaddwd
 * leaves two int32 sums a row, joined by one hadd a block. Kind 18 closes its first sum after
 * chunk 3 (weights 0..15, scale d0) and starts the second (d1). */
static inline __attribute__((always_inline)) void
q8_rows(const uint8_t *wg, const int kind, int64_t nb, const gguf_acts_t *a, const int R, float *out) {
    const int64_t pb = gguf_packed_block_bytes(kind), qo = gguf_ints_offset(kind);
    const int parts = gguf_two_halves(kind) ? 2 : 1, cn = 8 / parts;
    __m256 acc[R_MAX][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, wg += pb) {
        gguf_prefetch_block(wg, pb);
        /* Both loops unrolled: chunk c a constant, so kind 24's unpacking (x4_chunk) takes its
         * shifts as immediates, not a runtime choice per chunk. */
        #pragma GCC unroll 2
        for (int part = 0; part < parts; part++) {
            __m256i s[R_MAX][2][2];                /* [row][half][rows 0..3 | 4..7 of the half] */
            #pragma GCC unroll 8
            for (int c = part * cn; c < part * cn + cn; c++) {
                const uint8_t *wc = wg + qo + 64 * c;
                __m256i w[2][2];
                if (kind == GGUF_X4)
                    for (int h = 0; h < 2; h++) {
                        const __m256i u = x4_chunk(wg + qo, c, h);
                        w[h][0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(u));
                        w[h][1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(u, 1));
                    }
                else
                    for (int h = 0; h < 2; h++)
                        for (int k = 0; k < 2; k++)
                            w[h][k] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wc + 32 * h + 16 * k)));
                for (int r = 0; r < R; r++) {
                    int64_t x4;
                    memcpy(&x4, a->x16 + (r * nb + b) * 32 + 4 * c, 8);
                    const __m256i x = _mm256_set1_epi64x(x4);
                    for (int h = 0; h < 2; h++)
                        for (int k = 0; k < 2; k++) {
                            const __m256i t = _mm256_madd_epi16(w[h][k], x);
                            s[r][h][k] = c == part * cn ? t : _mm256_add_epi32(s[r][h][k], t);
                            KEEP_ORDER(s[r][h][k]);
                        }
                }
            }
            for (int h = 0; h < 2; h++) {
                const __m256 d = block_scale(wg, kind, nb, b, part, h);
                for (int r = 0; r < R; r++) {
                    const int64_t rb = r * nb + b;
                    const int32_t sq = parts == 1 ? a->sq[rb] : part == 0 ? a->sq0[rb] : a->sq[rb] - a->sq0[rb];
                    /* hadd: rows 0 1 4 5 | 2 3 6 7 (64-bit pairs), put in order */
                    const __m256i su = _mm256_permute4x64_epi64(_mm256_hadd_epi32(s[r][h][0], s[r][h][1]), 0xD8);
                    acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(unbias(su, sq, 128),
                                                                       _mm256_mul_ps(d, _mm256_set1_ps(a->dx[rb]))));
                }
            }
        }
        if (gguf_two_halves(kind))
            for (int h = 0; h < 2; h++) {
                const __m256 m = block_min(wg, kind, nb, b, h);
                for (int r = 0; r < R; r++)
                    acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(m, _mm256_set1_ps(a->sx[r * nb + b])));
            }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + r * GGUF_ROWS + 8 * h, acc[r][h]);
}

/* The pass for any kind (group_dot_pairs.h). The 8-bit kinds multiply x16 = 256 xa + xb whatever
 * the parts (P): one-part activations save them nothing. */
static inline __attribute__((always_inline)) void
rows_dot(const uint8_t *wg, const int kind, int64_t nb, const gguf_acts_t *a, const int R, const int P, float *out) {
    if (gguf_nibble_kind(kind) || kind == GGUF_K6 || kind == GGUF_K3) byte_rows(wg, kind, nb, a, R, P, out);
    else q8_rows(wg, kind, nb, a, R, out);
}

#include "group_dot_pairs.h"
#include "ready_group_avx.h"

/* Tiles of more than 2 rows (ready_group_avx.h). A ready_t holds 4-bit kinds' nibble_chunk of chunk c
 * at w + 4c and d[0], d[1], m[0], m[1] at s; kinds 26 and 13's small_chunk (c, h) at w[2c + h] and
 * the d of half `part` at s[2 part + h]. */
static inline __attribute__((always_inline)) void ready_unpack(const uint8_t *wg, const int kind, int64_t nb,
                                                               int64_t b, ready_t *rb) {
    if (gguf_nibble_kind(kind)) {
        for (int c = 0; c < 4; c++) nibble_chunk(wg, kind, c, rb->w + 4 * c);
        for (int h = 0; h < 2; h++) {
            rb->s[h] = block_scale(wg, kind, nb, b, 0, h);
            rb->s[2 + h] = block_min(wg, kind, nb, b, h);
        }
    } else {
        #pragma GCC unroll 8
        for (int c = 0; c < 8; c++)
            for (int h = 0; h < 2; h++) rb->w[2 * c + h] = small_chunk(wg, kind, c, h);
        for (int part = 0; part < 2; part++)
            for (int h = 0; h < 2; h++) rb->s[2 * part + h] = block_scale(wg, kind, nb, b, part, h);
    }
}

/* Block b from its ready_t (rp) against R <= 2 activation rows, added to acc: byte_block's
 * products and float steps, the weights loaded instead of unpacked. */
static inline __attribute__((always_inline)) void
ready_block(const uint8_t *rp, const int kind, int64_t nb, int64_t b, const gguf_acts_t *a, const int R, const int P,
            __m256 acc[R_MAX][2]) {
    const ready_t *rb = (const ready_t *)rp;
    __m256i s[R_MAX][2][2];
    if (gguf_nibble_kind(kind)) {
        #pragma GCC unroll 4
        for (int c = 0; c < 4; c++) q4_products(rb->w + 4 * c, kind, c, a, nb, b, R, P, s);
        q4_finish(s, rb->s, rb->s + 2, kind, a, nb, b, R, P, acc);
        return;
    }
    #pragma GCC unroll 2
    for (int part = 0; part < 2; part++) {
        #pragma GCC unroll 2
        for (int c = 4 * part; c < 4 * part + 4; c += 2)
            small_products((const __m256i(*)[2])(rb->w + 2 * c), c, part, a, nb, b, R, P, s);
        small_finish(s, rb->s + 2 * part, part, kind, a, nb, b, R, P, acc);
    }
}

/* The kinds whose unpacking ready_group saves (the 8-bit kinds' q8_rows only widens). */
static inline int ready_takes(const int kind) { return gguf_nibble_kind(kind) || kind == GGUF_K6 || kind == GGUF_K3; }

#include "f32_tile_avx2.h"
