/* y = x W^T for GGUF block weights packed 16 rows at a time (the kinds of gguf_gemv.h), for
 * any number of activation rows. The per-ISA kernel (gguf_group_dot) multiplies one group of 16
 * rows by up to GGUF_TILE_M activation rows; this driver quantizes the activations, splits the
 * work and writes y.
 *
 * Each output element is computed by one thread, block after block, from its own activation
 * row's quantized values: y does not depend on the thread count, on the other rows of x, nor on
 * the ISA the kernel was built for.
 * Threads: OpenMP over row groups. A thread runs every activation tile against a group while
 * the group's weights (K / 32 blocks, a few KB) are in L1, so weights stream from memory once per
 * call, for any number of rows.
 */
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "gguf_gemv.h"
#include "gguf_gemv_generic.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define GGUF_CHUNK_M 64     /* activation rows whose quantized values stay in L2 */

/* Rows of 8 floats / int32 as GCC/clang vector values: element-wise IEEE operations, so the same
 * bits in every build as in scalar code (no contraction: -ffp-contract=off). */
typedef float q8f __attribute__((vector_size(32)));
typedef int32_t q8i __attribute__((vector_size(32)));
typedef float q8f_unaligned __attribute__((vector_size(32), aligned(4), may_alias));

/* The 8 lanes of ia and ib (all within +-128) as int8 at pa and pb, and v16 (256 ia + ib, within
 * +-32767) as int16 at p16: packs on x86 (GCC scalarizes the generic narrowing conversions there), lane by lane
 * elsewhere. Plain data movement: every build stores the same values. */
static inline __attribute__((always_inline)) void store_narrow(q8i ia, q8i ib, q8i v16, int8_t *pa, int8_t *pb, int16_t *p16) {
#if defined(__AVX2__)
    __m256i a, b;
    memcpy(&a, &ia, 32);
    memcpy(&b, &ib, 32);
    const __m256i ab = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);   /* a 0..7 | b 0..7 */
    const __m256i bytes = _mm256_packs_epi16(ab, ab);
    _mm_storel_epi64((__m128i *)pa, _mm256_castsi256_si128(bytes));
    _mm_storel_epi64((__m128i *)pb, _mm256_extracti128_si256(bytes, 1));
    __m256i x;
    memcpy(&x, &v16, 32);
    const __m256i x16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(x, x), 0x08);
    _mm_storeu_si128((__m128i *)p16, _mm256_castsi256_si128(x16));
#else
    for (int l = 0; l < 8; l++) {
        pa[l] = (int8_t)ia[l];
        pb[l] = (int8_t)ib[l];
        p16[l] = (int16_t)v16[l];
    }
#endif
}

/* rint (round half to even) of |v| < 2^22, exactly: adding 1.5 2^23 rounds v to an integer in
 * the default rounding mode, and subtracting it back is exact. The same as __builtin_rintf on
 * the values quantize_block rounds (|v| <= 128), as a vector operation every build has. */
static inline __attribute__((always_inline)) q8f rint8(q8f v) {
    const q8f big = {12582912.f, 12582912.f, 12582912.f, 12582912.f, 12582912.f, 12582912.f, 12582912.f, 12582912.f};
    return (v + big) - big;
}

static inline __attribute__((always_inline)) q8f pick(q8i mask, q8f a, q8f b) {   /* mask ? a : b */
    return (q8f)(((q8i)a & mask) | ((q8i)b & ~mask));
}

/* One block of 32 of a row of x (p) -> xq (64 s8: the 32 xa, then the 32 xb), x16, dx, sx, sq and
 * sq0 (gguf_acts_t), with the parts of gguf_gemv.h: GGUF_ONE_PART: every xb = 0 and sx = dx sq;
 * GGUF_MIXED_PARTS: that, unless sum xb^2 >= 4 sum xa^2 (exact integers). The sum sx runs
 * j = 0..31 in order (no reassociation: -ffp-contract=off, no -ffast-math); the rest is
 * element-wise, in 8-float vectors, and the max and the integer sums do not depend on their order.
 * Blocks are independent of each other, so the threads split a call's rows by block. */
static void quantize_block(const float *p, int8_t *qa, int16_t *x16, float *dx, float *sx, int32_t *sq,
                           int32_t *sq0, int parts) {
    q8f x[4], m = {0};
    for (int c = 0; c < 4; c++) {
        x[c] = *(const q8f_unaligned *)(p + 8 * c);   /* one 32-byte load (a memcpy went through the stack) */
        const q8f a = pick(x[c] < 0, -x[c], x[c]);
        m = pick(a > m, a, m);
    }
    float amax = 0.f, sum = 0.f;
    for (int l = 0; l < 8; l++) amax = m[l] > amax ? m[l] : amax;
    for (int j = 0; j < 32; j++) sum += p[j];
    if (!(amax >= 1e-30f)) amax = 0.f;   /* tiny blocks count as zero: 127 / amax stays finite */
    const float inv = amax > 0 ? 127.f / amax : 0.f;
    const q8f lim = {127.f, 127.f, 127.f, 127.f, 127.f, 127.f, 127.f, 127.f};
    q8i ia[4], ib[4], ea = {0}, eb = {0};
    for (int c = 0; c < 4; c++) {
        const q8f v = x[c] * inv;                         /* in [-127, 127] */
        const q8f a = rint8(v);
        q8f rb = parts == GGUF_ONE_PART ? (q8f){0} : rint8((v - a) * 256.f);   /* in [-128, 128] */
        rb = pick(rb > lim, lim, pick(rb < -lim, -lim, rb));
        ia[c] = __builtin_convertvector(a, q8i);
        ib[c] = __builtin_convertvector(rb, q8i);
        if (parts == GGUF_MIXED_PARTS) {                  /* <= 32 128^2: exact in int32 */
            ea += ia[c] * ia[c];
            eb += ib[c] * ib[c];
        }
    }
    int one = parts == GGUF_ONE_PART;
    if (parts == GGUF_MIXED_PARTS) {
        int32_t sa = 0, sb = 0;
        for (int l = 0; l < 8; l++) {
            sa += ea[l];
            sb += eb[l];
        }
        one = sb < 4 * sa;
    }
    q8i s16 = {0}, s16h = {0};
    for (int c = 0; c < 4; c++) {
        if (one) ib[c] = (q8i){0};
        const q8i v16 = 256 * ia[c] + ib[c];              /* x16, exact in int32 */
        store_narrow(ia[c], ib[c], v16, qa + 8 * c, qa + 32 + 8 * c, x16 + 8 * c);
        s16 += v16;
        if (c < 2) s16h += v16;
    }
    int32_t t = 0, th = 0;                                /* integer sums: any order */
    for (int l = 0; l < 8; l++) {
        t += s16[l];
        th += s16h[l];
    }
    *sq0 = th;
    *dx = amax / (127.f * 256.f);
    /* One part: the m term takes the sum of the quantized values, as the d q term does (llama.cpp's
     * Q8_1 s), so their rounding errors cancel; the exact sum beside sum q x~ (q in 0..15, not
     * centered) leaves the d q term's error whole (docs/benchmarks.md, gguf-a8). Two parts:
     * the exact sum (their rounding is ~2^-15 of the block's max). */
    *sx = one ? *dx * (float)t : sum;
    *sq = t;
}

/* n outputs o of one row into yr: yr = o, or yr + o with accumulate, then + bias when given. */
static inline void write_row(float *yr, const float *o, int64_t n, const float *bias, int64_t accumulate) {
    for (int64_t i = 0; i < n; i++) {
        const float v = accumulate ? yr[i] + o[i] : o[i];
        yr[i] = bias ? v + bias[i] : v;
    }
}

const char *gguf_gemv_isa(void) { return gguf_kernel_isa(); }

int64_t gguf_workspace_bytes(int64_t M, int64_t K) {
    const int64_t nb = K / 32;
    return M * K * 2 + M * K * 2 + M * nb * (int64_t)(2 * sizeof(float) + 2 * sizeof(int32_t)) + 64;
}

/* Where the quantized activations of M rows of K sit in a workspace of gguf_workspace_bytes(M, K). */
typedef struct {
    int8_t *xq;
    int16_t *x16;
    float *dx, *sx;
    int32_t *sq, *sq0;
} quantized_rows_t;

static quantized_rows_t quantized_rows(void *ws, int64_t M, int64_t K) {
    const int64_t nb = K / 32;
    quantized_rows_t q;
    q.xq = (int8_t *)ws;
    q.x16 = (int16_t *)(q.xq + M * K * 2);
    q.dx = (float *)(q.x16 + M * K);
    q.sx = q.dx + M * nb;
    q.sq = (int32_t *)(q.sx + M * nb);
    q.sq0 = q.sq + M * nb;
    return q;
}

/* Block b (32 floats at src) of activation row r of the M rows of K in ws: the quantization
 * gguf_gemv_team does, for callers that produce a row and quantize it in the same pass
 * (layer_stack.c, after a norm or SiLU), saving a phase and its barrier. parts: gguf_gemv.h's. */
void gguf_quantize_block(void *ws, int64_t M, int64_t K, int64_t r, int64_t b, const float *src, int64_t parts) {
    const quantized_rows_t q = quantized_rows(ws, M, K);
    const int64_t rb = r * (K / 32) + b;
    quantize_block(src, q.xq + rb * 64, q.x16 + rb * 32, q.dx + rb, q.sx + rb, q.sq + rb, q.sq0 + rb, (int)parts);
}

/* The GEMV of M rows already quantized into ws (gguf_quantize_block, or the loop in
 * gguf_gemv_team), shared by the threads of an enclosing OpenMP region; y rows as in
 * gguf_gemv_team; parts as they were quantized. Ends with a barrier. */
void gguf_gemv_quantized_team(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const int64_t *rows, int64_t M,
                              float *y, int64_t ldy, const float *bias, int64_t accumulate, void *ws,
                              int64_t parts) {
    const int64_t nb = K / 32, groups = (N + GGUF_ROWS - 1) / GGUF_ROWS;
    const quantized_rows_t q = quantized_rows(ws, M, K);
    /* Rows go in chunks of GGUF_CHUNK_M, whose quantized activations (<= 64 x 2 K bytes) stay in
     * L2 while every row group's weights pass by; inside a chunk a thread runs every activation
     * tile against a group while the group's weights (K / 32 blocks, a few KB) are in L1. Up to
     * GGUF_CHUNK_M rows (every decode step) the weights stream from memory once per call.
     * Groups are handed out guided (shrinking contiguous runs) rather than static: when the OS
     * gives a thread's core to another (a server's HTTP thread, its clients), the others take
     * the groups it has not started instead of waiting at the barrier for all of its share. */
    for (int64_t c0 = 0; c0 < M; c0 += GGUF_CHUNK_M) {
        const int64_t c1 = M - c0 < GGUF_CHUNK_M ? M : c0 + GGUF_CHUNK_M;
        #pragma omp for schedule(guided) nowait
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *wg = gguf_group_blocks(w, kind, nb, g);
            const int64_t n = N - g * GGUF_ROWS < GGUF_ROWS ? N - g * GGUF_ROWS : GGUF_ROWS;
            float out[GGUF_TILE_M * GGUF_ROWS];
            for (int64_t r0 = c0; r0 < c1; r0 += GGUF_TILE_M) {
                const int R = (int)(c1 - r0 < GGUF_TILE_M ? c1 - r0 : GGUF_TILE_M);
                const gguf_acts_t a = {q.xq + r0 * K * 2, q.x16 + r0 * K, q.dx + r0 * nb, q.sx + r0 * nb,
                                       q.sq + r0 * nb, q.sq0 + r0 * nb, (int)parts};
                if (gguf_generic_kind(kind)) gguf_group_dot_generic(wg, kind, nb, &a, R, out);
                else gguf_group_dot(wg, kind, nb, &a, R, out);
                for (int r = 0; r < R; r++)
                    write_row(y + (rows ? rows[r0 + r] : r0 + r) * ldy + g * GGUF_ROWS, out + r * GGUF_ROWS, n,
                              bias ? bias + g * GGUF_ROWS : NULL, accumulate);
            }
        }
    }
    #pragma omp barrier
}

/* The work of one call, shared by the threads of an enclosing OpenMP parallel region (each
 * `omp for` below splits its loop over them; without OpenMP one thread does it all). kind and K
 * must have been checked (gguf_gemv_check); ws holds gguf_workspace_bytes(M, K) bytes, 64-byte
 * aligned. rows: the M rows of x and y to compute (NULL: rows 0 .. M-1). parts: the activations'
 * parts per block (gguf_gemv.h: GGUF_TWO_PARTS, GGUF_ONE_PART, GGUF_MIXED_PARTS). */
void gguf_gemv_team(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const float *x, int64_t ldx,
                    const int64_t *rows, int64_t M, float *y, int64_t ldy, const float *bias,
                    int64_t accumulate, void *ws, int64_t parts) {
    const int64_t nb = K / 32;
    #pragma omp for schedule(static)
    for (int64_t rb = 0; rb < M * nb; rb++) {           /* (row, block) pairs: a decode's one row splits too */
        const int64_t r = rb / nb, b = rb % nb;
        gguf_quantize_block(ws, M, K, r, b, x + (rows ? rows[r] : r) * ldx + b * 32, parts);
    }
    gguf_gemv_quantized_team(w, kind, N, K, rows, M, y, ldy, bias, accumulate, ws, parts);
}

int gguf_gemv_check(int64_t kind, int64_t K) {
    const int64_t block = gguf_has_super(kind) ? 256 : 32;   /* K-quants: whole super-blocks */
    return !gguf_packed_block_bytes(kind) || K % block || K <= 0 ? -1 : 0;
}

/* y[r][n] (+)= sum_k x[r][k] W[n][k] (+ bias[n]) for r < M, n < N, with W packed (a kind of
 * gguf_gemv.h).
 * x: M rows, leading dimension ldx; y: leading dimension ldy; parts: the activations' parts per
 * block (gguf_gemv.h). Returns 0, or -1 for a bad kind / K, -3 when out of memory. */
int gguf_gemv(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const float *x, int64_t ldx,
              int64_t M, float *y, int64_t ldy, const float *bias, int64_t accumulate,
              int64_t num_threads, int64_t parts) {
    if (gguf_gemv_check(kind, K)) return -1;
    if (parts < GGUF_TWO_PARTS || parts > GGUF_MIXED_PARTS) return -1;
    if (M <= 0 || N <= 0) return 0;
    const size_t bytes = (size_t)gguf_workspace_bytes(M, K);
    void *ws = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!ws) return -3;
    (void)num_threads;
    #pragma omp parallel num_threads(num_threads)
    gguf_gemv_team(w, kind, N, K, x, ldx, NULL, M, y, ldy, bias, accumulate, ws, parts);
    free(ws);
    return 0;
}

/* ---- The float32 GEMM for prompt tokens (gguf_gemv.h) ---- */

/* Blocks b0 .. b1 - 1 of a group of nb packed blocks (wg: its block 0, gguf_group_blocks) ->
 * wt[k][16] float32 (the block's first weight at row 0, row k at wt + k ld), w = d q + m (8-bit
 * kinds: q = u - 128; kind 8: no m, kinds 18, 19: d per half; kind 26: d per half, q = u - 32, no m;
 * kind 13: d per half, q = u - 4, no m; kind 24: q the index's value, no m); the product is
 * exact, so each weight is rounded once (kinds 4, 14, 18, 19) or not at all (kinds 8, 26, 13,
 * 24), as gguf's dequantization rounds it. */
static void dequantize_group(const uint8_t *wg, int64_t kind, int64_t nb, int64_t b0, int64_t b1, float *wt,
                             int64_t ld) {
    if (gguf_generic_kind(kind)) {
        gguf_dequantize_group_generic(wg, kind, nb, b0, b1, wt, ld);
        return;
    }
    const int64_t pb = gguf_packed_block_bytes(kind), qo = gguf_ints_offset(kind);
    const int nibbles = gguf_nibble_kind(kind);
    wg += b0 * pb;
    for (int64_t b = b0; b < b1; b++, wg += pb) {
        float d0[GGUF_ROWS], d1[GGUF_ROWS], m[GGUF_ROWS];
        for (int i = 0; i < GGUF_ROWS; i++) gguf_row_scales(wg, kind, nb, b, i, d0 + i, d1 + i, m + i);
        float *o = wt + (b - b0) * 32 * ld;
        const int chunks = nibbles ? 4 : 8;
        for (int c = 0; c < chunks; c++) {
            uint32_t u[GGUF_ROWS];                 /* row i's 4 bytes of the chunk (kinds 26, 13, 24: by byte) */
            if (kind != GGUF_K6 && kind != GGUF_K3 && kind != GGUF_X4) memcpy(u, wg + qo + 64 * c, sizeof(u));
            for (int t = 0; t < 4; t++) {
                float *row = o + (4 * c + t) * ld;
                if (nibbles) {
                    float *hi = row + 16 * ld;
                    for (int i = 0; i < GGUF_ROWS; i++) {
                        const int32_t t0 = kind == GGUF_K5 ? gguf_k5_top(wg, c, i, t) : 0;
                        const int32_t t1 = kind == GGUF_K5 ? gguf_k5_top(wg, c + 4, i, t) : 0;
                        row[i] = d0[i] * (float)(int32_t)(((u[i] >> (8 * t)) & 15) | t0) + m[i];
                        hi[i] = d0[i] * (float)(int32_t)(((u[i] >> (8 * t + 4)) & 15) | t1) + m[i];
                    }
                } else if (kind == GGUF_Q8) {
                    for (int i = 0; i < GGUF_ROWS; i++)
                        row[i] = d0[i] * (float)((int32_t)((u[i] >> (8 * t)) & 255) - 128);
                } else if (kind == GGUF_K6) {
                    const float *d = c < 4 ? d0 : d1;
                    for (int i = 0; i < GGUF_ROWS; i++) row[i] = d[i] * (float)(gguf_k6_byte(wg, c, i, t) - 32);
                } else if (kind == GGUF_K3) {
                    const float *d = c < 4 ? d0 : d1;
                    for (int i = 0; i < GGUF_ROWS; i++) row[i] = d[i] * (float)(gguf_k3_byte(wg, c, i, t) - 4);
                } else if (kind == GGUF_X4) {
                    for (int i = 0; i < GGUF_ROWS; i++) row[i] = d0[i] * (float)(gguf_x4_byte(wg, c, i, t) - 128);
                } else {
                    const float *d = c < 4 ? d0 : d1;
                    for (int i = 0; i < GGUF_ROWS; i++)
                        row[i] = d[i] * (float)((int32_t)((u[i] >> (8 * t)) & 255) - 128) + m[i];
                }
            }
        }
    }
}

/* Row r of a packed weight of K columns -> out[K] float32, each weight as dequantize_group gives it
 * (an embedding lookup in a tied head's packed rows: the same floats as the file's dequantization). */
void gguf_dequantize_row(const uint8_t *w, int64_t kind, int64_t K, int64_t r, float *out) {
    if (gguf_generic_kind(kind)) {
        gguf_dequantize_row_generic(w, kind, K, r, out);
        return;
    }
    const int64_t pb = gguf_packed_block_bytes(kind), qo = gguf_ints_offset(kind), nb = K / 32;
    const int nibbles = gguf_nibble_kind(kind), i = (int)(r % GGUF_ROWS);
    const uint8_t *blk = gguf_group_blocks(w, kind, nb, r / GGUF_ROWS);
    for (int64_t b = 0; b < nb; b++, blk += pb, out += 32) {
        float d0, d1, m;
        gguf_row_scales(blk, kind, nb, b, i, &d0, &d1, &m);
        for (int c = 0; c < (nibbles ? 4 : 8); c++) {
            uint32_t u = 0;                        /* the row's 4 bytes of chunk c (kinds 26, 13, 24: by byte) */
            if (kind != GGUF_K6 && kind != GGUF_K3 && kind != GGUF_X4) memcpy(&u, blk + qo + 64 * c + 4 * i, 4);
            for (int t = 0; t < 4; t++) {
                const int32_t q = (int32_t)((u >> (8 * t)) & 255);
                if (nibbles) {
                    const int32_t t0 = kind == GGUF_K5 ? gguf_k5_top(blk, c, i, t) : 0;
                    const int32_t t1 = kind == GGUF_K5 ? gguf_k5_top(blk, c + 4, i, t) : 0;
                    out[4 * c + t] = d0 * (float)((q & 15) | t0) + m;
                    out[4 * c + t + 16] = d0 * (float)((q >> 4) | t1) + m;
                } else if (kind == GGUF_Q8) {
                    out[4 * c + t] = d0 * (float)(q - 128);
                } else if (kind == GGUF_K6) {
                    out[4 * c + t] = (c < 4 ? d0 : d1) * (float)(gguf_k6_byte(blk, c, i, t) - 32);
                } else if (kind == GGUF_K3) {
                    out[4 * c + t] = (c < 4 ? d0 : d1) * (float)(gguf_k3_byte(blk, c, i, t) - 4);
                } else if (kind == GGUF_X4) {
                    out[4 * c + t] = d0 * (float)(gguf_x4_byte(blk, c, i, t) - 128);
                } else {
                    out[4 * c + t] = (c < 4 ? d0 : d1) * (float)(q - 128) + m;
                }
            }
        }
    }
}

/* Rows rows[0..n) -> out [n][K] (gguf_dequantize_row); -1 for a kind or K the layout has not. */
int gguf_dequantize_rows(const uint8_t *w, int64_t kind, int64_t K, const int64_t *rows, int64_t n, float *out) {
    if (gguf_gemv_check(kind, K)) return -1;
    for (int64_t j = 0; j < n; j++) gguf_dequantize_row(w, kind, K, rows[j], out + j * K);
    return 0;
}

int64_t gguf_f32_workspace_bytes(int64_t M, int64_t N, int64_t K, int64_t threads) {
    const int64_t T = gguf_f32_tile_rows(), rows = (M + T - 1) / T * T;
    const int64_t pairs = (N + 2 * GGUF_ROWS - 1) / (2 * GGUF_ROWS);
    return (rows * K + pairs * rows * GGUF_F32_N + threads * GGUF_F32_KC * GGUF_F32_N) * (int64_t)sizeof(float) + 64;
}

/* y rows (+)= x rows W^T through the float32 tiles (float weights against at most GGUF_F32_FEW
 * rows: the same sums without tiles, gguf_float_group_fma), shared by the threads of an enclosing
 * OpenMP region like gguf_gemv_team (same arguments; ws: gguf_f32_workspace_bytes(M, N, K, the
 * team's size), 64-byte aligned). Blocked as a GEMM: for each slice of GGUF_F32_KC k and chunk
 * of GGUF_F32_MC rows (their packed activations, <= 200 KB, stay in L2), each thread dequantizes
 * the slice of one of its pairs of groups (GGUF_F32_KC x 32 floats, 16 KB: half of a 32 KB L1d,
 * with room for the activation tiles) and runs every tile of the chunk against it. The sums
 * wait in acc between slices; a pair always belongs to the same thread (static schedule over the
 * same count, the final writes included), so no barrier is needed until the end. */
void gguf_gemm_f32_team(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const float *x, int64_t ldx,
                        const int64_t *rows, int64_t M, float *y, int64_t ldy, const float *bias,
                        int64_t accumulate, void *ws) {
    const int64_t nb = K / 32, groups = (N + GGUF_ROWS - 1) / GGUF_ROWS, pairs = (groups + 1) / 2;
    if (M <= GGUF_F32_FEW && (kind == GGUF_W32 || kind == GGUF_W16 || kind == GGUF_B16)) {
        const float *xr[GGUF_F32_FEW];                  /* a few rows: the same sums, no tiles */
        for (int64_t i = 0; i < M; i++) xr[i] = x + (rows ? rows[i] : i) * ldx;
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            float o[GGUF_F32_FEW * GGUF_ROWS];
            gguf_float_group_fma(gguf_group_blocks(w, kind, nb, g), kind, nb, xr, (int)M, o);
            const int64_t n = N - g * GGUF_ROWS < GGUF_ROWS ? N - g * GGUF_ROWS : GGUF_ROWS;
            for (int64_t i = 0; i < M; i++)
                write_row(y + (rows ? rows[i] : i) * ldy + g * GGUF_ROWS, o + i * GGUF_ROWS, n,
                          bias ? bias + g * GGUF_ROWS : NULL, accumulate);
        }
        return;
    }
    const int64_t T = gguf_f32_tile_rows(), tiles = (M + T - 1) / T;
    const int64_t mc = (GGUF_F32_MC + T - 1) / T;                  /* tiles per chunk */
    float *xp = (float *)ws, *acc = xp + tiles * T * K;
#ifdef _OPENMP
    const int64_t me = omp_get_thread_num();
#else
    const int64_t me = 0;
#endif
    float *wt = acc + pairs * tiles * T * GGUF_F32_N + me * GGUF_F32_KC * GGUF_F32_N;
    #pragma omp for schedule(static)
    for (int64_t tile = 0; tile < tiles; tile++) {       /* xp[tile][k][r] = x[row r of the tile][k] */
        float *p = xp + tile * T * K;
        for (int64_t r = 0; r < T; r++) {
            const int64_t i = tile * T + r;
            if (i >= M) {
                for (int64_t k = 0; k < K; k++) p[k * T + r] = 0.f;
                continue;
            }
            const float *xr = x + (rows ? rows[i] : i) * ldx;
            for (int64_t k = 0; k < K; k++) p[k * T + r] = xr[k];
        }
    }
    for (int64_t k0 = 0; k0 < K; k0 += GGUF_F32_KC) {
        const int64_t kc = K - k0 < GGUF_F32_KC ? K - k0 : GGUF_F32_KC;
        for (int64_t t0 = 0; t0 < tiles; t0 += mc) {
            const int64_t t1 = tiles - t0 < mc ? tiles : t0 + mc;
            #pragma omp for schedule(static) nowait
            for (int64_t pr = 0; pr < pairs; pr++) {
                for (int64_t h = 0; h < 2; h++) {
                    const int64_t g = 2 * pr + h;
                    if (g < groups)
                        dequantize_group(gguf_group_blocks(w, kind, nb, g), kind, nb, k0 / 32, (k0 + kc) / 32, wt + h * GGUF_ROWS,
                                         GGUF_F32_N);
                    else                          /* an odd group count: the last pair's second half */
                        for (int64_t k = 0; k < kc; k++)
                            memset(wt + k * GGUF_F32_N + GGUF_ROWS, 0, sizeof(float) * GGUF_ROWS);
                }
                for (int64_t tile = t0; tile < t1; tile++)
                    gguf_tile_f32(wt, xp + tile * T * K + k0 * T, kc, k0 > 0,
                                  acc + (pr * tiles + tile) * T * GGUF_F32_N);
            }
        }
    }
    /* Each thread writes the pairs it computed (the same static schedule): no barrier before. */
    #pragma omp for schedule(static)
    for (int64_t pr = 0; pr < pairs; pr++) {
        const int64_t n = N - pr * GGUF_F32_N < GGUF_F32_N ? N - pr * GGUF_F32_N : GGUF_F32_N;
        for (int64_t i = 0; i < M; i++)
            write_row(y + (rows ? rows[i] : i) * ldy + pr * GGUF_F32_N, acc + (pr * tiles * T + i) * GGUF_F32_N, n,
                      bias ? bias + pr * GGUF_F32_N : NULL, accumulate);
    }
}

/* gguf_gemv through the float32 tiles (tests and single linears; layer_stack.c calls the team). */
int gguf_gemm_f32(const uint8_t *w, int64_t kind, int64_t N, int64_t K, const float *x, int64_t ldx,
                  int64_t M, float *y, int64_t ldy, const float *bias, int64_t accumulate,
                  int64_t num_threads) {
    if (gguf_gemv_check(kind, K)) return -1;
    if (M <= 0 || N <= 0) return 0;
    if (num_threads < 1) num_threads = 1;
    const size_t bytes = (size_t)gguf_f32_workspace_bytes(M, N, K, num_threads);
    void *ws = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!ws) return -3;
    #pragma omp parallel num_threads(num_threads)
    gguf_gemm_f32_team(w, kind, N, K, x, ldx, NULL, M, y, ldy, bias, accumulate, ws);
    free(ws);
    return 0;
}
