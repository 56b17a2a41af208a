/* Paged attention on the CPU: each query token attends over its request's context read straight
 * from the paged KV pool (no gather into fresh tensors). A decode is one such row; a prompt
 * chunk is one row per token (its context ends at its own position), so a token's result does
 * not depend on how its prompt was chunked or what else ran in the step.
 *
 * Pool layout (one layer): k_cache, v_cache float32 [num_blocks][block_size][kv_heads][head_dim],
 * IEEE half [num_blocks][block_size][kv_heads][head_dim] (kv_format KV_F16, converted exactly to
 * float32 on read), or int8 rows (KV_INT8): each (slot, kv head) row is head_dim int8 values
 * followed by its float32 scale in 4 bytes (x ~= scale * q; kvserve/ops/kv_int8.py writes them).
 * Row i: query q[qrow[i]] (float32 [num_heads][head_dim]), context of lens[i] tokens whose slots
 * are table[p / block_size] * block_size + p % block_size with table = tables + qseq[i] *
 * table_stride (qseq NULL: row i uses table row i); keys older than `window` positions
 * (window > 0) are skipped. Output goes to out[qrow[i]] ([num_heads][head_dim]).
 *
 * One task per (row, kv head); the group of num_heads / kv_heads query heads that share a KV head
 * is computed together, so every K and V row is read once per task. Two passes: scores (kept in
 * a per-task buffer), then softmax and the weighted sum of V.
 *
 * Every sum has a fixed order (8 partial sums combined by a fixed tree, no fused multiply-add;
 * built with -ffp-contract=off and without -ffast-math): the bits do not depend on the thread
 * count, the ISA the file was compiled for, or the other rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fixed_math.h"
#include "half.h"
#include "kv_format.h"
#if defined(__F16C__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#define UNROLL _Pragma("GCC unroll 16")   /* whole: the chunk arrays stay in registers */

#define MAX_GROUP 16
#define LANES 8

/* Sum of 8 partial sums, in a fixed tree. */
static inline float tree8(const float a[LANES]) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* exp(x) for x <= 0 (scores minus their max): below -87 the result is flushed to 0 (the true
 * value is under 2e-38). */
static inline float exp_nonpos(float x) {
    const float e = exp_in_range(x < -87.f ? -87.f : x);
    return x < -87.f ? 0.f : e;
}

/* Element d of a K or V row, as float32 (exact for every row format). */
static inline __attribute__((always_inline)) float elem(const uint8_t *row, int64_t d, const int fmt) {
    if (fmt == KV_INT8) return (float)((const int8_t *)row)[d];
    if (fmt == KV_F16) return half_to_float(((const uint16_t *)row)[d]);
    return ((const float *)row)[d];
}

/* One K row's dot with a query head (any head_dim): 8 partial sums, fixed tree. */
static inline __attribute__((always_inline)) float
row_dot(const float *x, const uint8_t *row, int64_t head_dim, const int fmt) {
    float acc[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= head_dim; d += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += x[d + l] * elem(row, d + l, fmt);
    float s = tree8(acc);
    for (; d < head_dim; d++) s += x[d] * elem(row, d, fmt);
    return s;
}

static inline __attribute__((always_inline)) void
row_axpy(float *restrict y, float w, const uint8_t *row, int64_t head_dim, const int fmt) {
    for (int64_t d = 0; d < head_dim; d++) y[d] += w * elem(row, d, fmt);
}

static inline __attribute__((always_inline)) float row_scale(const uint8_t *row, int64_t head_dim, const int fmt) {
    float s = 1.f;
    if (fmt == KV_INT8) memcpy(&s, row + head_dim, 4);
    return s;
}

/* A K or V row PF keys ahead of the one in use is fetched early: the rows of a task are
 * 768-byte strided (every KV head's row sits in a slot) and blocks are scattered, so the
 * hardware prefetcher alone leaves each row's load waiting on memory. */
#define PF 4
static inline __attribute__((always_inline)) void prefetch_row(const uint8_t *row, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(row + o, 0, 3);
}

/* Rows of 8 floats as GCC/clang vector values: element-wise IEEE operations, so the same bits as
 * the scalar loops above in every build (no contraction: -ffp-contract=off). */
typedef float v8f __attribute__((vector_size(32)));
typedef int8_t v8i8 __attribute__((vector_size(8)));

static inline __attribute__((always_inline)) v8f load8(const uint8_t *row, int64_t c, const int fmt) {
    v8f v;
    if (fmt == KV_INT8) {
        v8i8 q;
        memcpy(&q, row + 8 * c, 8);
        return __builtin_convertvector(q, v8f);
    }
    if (fmt == KV_F16) {                 /* exact conversions: the same floats on every build */
#if defined(__F16C__)
        const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 16 * c)));
        memcpy(&v, &f, 32);
#elif defined(__aarch64__)
        const uint16x8_t h = vld1q_u16((const uint16_t *)(row + 16 * c));
        const float32x4_t lo = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h)));
        const float32x4_t hi = vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h)));
        memcpy(&v, &lo, 16);
        memcpy((char *)&v + 16, &hi, 16);
#else
        for (int l = 0; l < 8; l++) v[l] = half_to_float(((const uint16_t *)row)[8 * c + l]);
#endif
        return v;
    }
    memcpy(&v, row + 32 * c, 32);
    return v;
}

/* row_dot for head_dim = 8 C (C 8-float chunks, a compile-time constant), the K row already
 * converted to chunks: the same 8 partial sums and tree, with the query's chunks in registers. */
static inline __attribute__((always_inline)) float row_dot8(const v8f *x, const v8f *k, const int C) {
    v8f acc = {0};
    UNROLL for (int c = 0; c < C; c++) acc += x[c] * k[c];
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

/* head_dim = 8 C: the weighted sum of V for G query heads of a group in one pass over the
 * context's V rows (each row read and converted once, G C accumulators in registers); scores and
 * oh are the first head's. The builds with 32 vector registers (AVX-512) take the 2 or 3 heads of
 * a group together; with 16 (AVX2), G = 1: one head per pass, whose V rows come from cache after
 * the first head's (prefetch: only that first pass fetches ahead). Either way every output element
 * gets the same additions in the same order. */
#if defined(__AVX512F__)
#define JOINT_ACCUMULATORS 24
#else
#define JOINT_ACCUMULATORS 8
#endif

static inline __attribute__((always_inline)) void
weighted_v(const uint8_t *vc, const int64_t *table, int64_t block_size, int64_t tok_stride, int64_t row_bytes,
           int64_t start, int64_t len, const float *scores, int64_t n, float *oh, int64_t head_dim,
           const int fmt, const int G, const int C, const int prefetch) {
    v8f acc[G * C > 0 ? G * C : 1];
    UNROLL for (int i = 0; i < G * C; i++) acc[i] = (v8f){0};
    for (int64_t p = start, t = 0; p < len;) {
        const int64_t off = p % block_size, run = (block_size - off < len - p) ? block_size - off : len - p;
        const uint8_t *vr = vc + (table[p / block_size] * block_size + off) * tok_stride;
        for (int64_t j = 0; j < run; j++, t++, vr += tok_stride) {
            if (prefetch && j + PF < run) prefetch_row(vr + PF * tok_stride, row_bytes);
            const float vs = row_scale(vr, head_dim, fmt);
            float w[G];
            UNROLL for (int g = 0; g < G; g++) w[g] = scores[g * n + t] * vs;
            UNROLL for (int c = 0; c < C; c++) {     /* chunk by chunk: G C + 1 registers */
                const v8f vv = load8(vr, c, fmt);
                UNROLL for (int g = 0; g < G; g++) acc[g * C + c] += w[g] * vv;
            }
        }
        p += run;
    }
    UNROLL for (int g = 0; g < G; g++)
        UNROLL for (int c = 0; c < C; c++) memcpy(oh + g * head_dim + 8 * c, &acc[g * C + c], 32);
}

/* exp(s - mx) in place over n scores, returning their sum (8 partial sums, fixed tree). */
static inline float softmax_numerators(float *restrict sc, int64_t n, float mx) {
    float acc[LANES] = {0};
    int64_t t = 0;
    for (; t + LANES <= n; t += LANES)
        for (int l = 0; l < LANES; l++) {
            const float e = exp_nonpos(sc[t + l] - mx);
            sc[t + l] = e;
            acc[l] += e;
        }
    float s = tree8(acc);
    for (; t < n; t++) {
        sc[t] = exp_nonpos(sc[t] - mx);
        s += sc[t];
    }
    return s;
}

static inline __attribute__((always_inline)) void
attend(const float *q, const void *k_cache, const void *v_cache, float *out, const int64_t *qrow,
       const int64_t *qseq, const int64_t *tables, int64_t table_stride, const int64_t *lens,
       int64_t num_rows, int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
       float scale, int64_t window, const int fmt, const int C) {
    const int64_t group = num_heads / kv_heads;
    const int64_t row_bytes = fmt == KV_INT8 ? head_dim + 4 : fmt == KV_F16 ? head_dim * 2 : head_dim * 4;
    const int64_t tok_stride = kv_heads * row_bytes;       /* bytes between slots */
    const uint8_t *kc = (const uint8_t *)k_cache, *vc = (const uint8_t *)v_cache;
    #pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t i = 0; i < num_rows; i++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t len = lens[i];
            const int64_t start = (window > 0 && len > window) ? len - window : 0;
            const int64_t n = len - start;
            const int64_t *table = tables + (qseq ? qseq[i] : i) * table_stride;
            const float *qh = q + qrow[i] * num_heads * head_dim + h * group * head_dim;
            float *oh = out + qrow[i] * num_heads * head_dim + h * group * head_dim;
            float *scores = (float *)malloc(sizeof(float) * group * (n > 0 ? n : 1));
            float mx[MAX_GROUP], sum[MAX_GROUP];
            if (!scores) {                       /* out of memory: a visible NaN, never a crash */
                for (int64_t d = 0; d < group * head_dim; d++) oh[d] = NAN;
                continue;
            }
            for (int64_t g = 0; g < group; g++) mx[g] = -INFINITY;
            v8f qv[C > 0 ? MAX_GROUP * C : 1];          /* the group's queries, as 8-float chunks */
            for (int64_t g = 0; C && g < group; g++)
                for (int c = 0; c < C; c++) memcpy(&qv[g * C + c], qh + g * head_dim + 8 * c, 32);
            /* Walk the context block by block (no division per key): positions p in
             * [start, len), slot = table[p / block_size] * block_size + p % block_size. */
            for (int64_t p = start, t = 0; p < len;) {
                const int64_t off = p % block_size, run = (block_size - off < len - p) ? block_size - off : len - p;
                const uint8_t *kr = kc + (table[p / block_size] * block_size + off) * tok_stride + h * row_bytes;
                for (int64_t j = 0; j < run; j++, t++, kr += tok_stride) {
                    if (j + PF < run) prefetch_row(kr + PF * tok_stride, row_bytes);
                    const float ks = scale * row_scale(kr, head_dim, fmt);
                    v8f kk[C > 0 ? C : 1];               /* the K row, converted once for the group */
                    UNROLL for (int c = 0; c < C; c++) kk[c] = load8(kr, c, fmt);
                    for (int64_t g = 0; g < group; g++) {
                        const float s = (C ? row_dot8(qv + g * C, kk, C)
                                           : row_dot(qh + g * head_dim, kr, head_dim, fmt)) * ks;
                        scores[g * n + t] = s;
                        if (s > mx[g]) mx[g] = s;
                    }
                }
                p += run;
            }
            for (int64_t g = 0; g < group; g++) {
                sum[g] = softmax_numerators(scores + g * n, n, mx[g]);
                if (!C) memset(oh + g * head_dim, 0, sizeof(float) * head_dim);   /* row_axpy adds */
            }
            /* head_dim = 8 C: weighted_v, the whole group in one pass where its accumulators fit
             * the registers; any other head_dim: the row_axpy loop below. */
            const uint8_t *vh = vc + h * row_bytes;
            if (C == 8 && group == 3 && 3 * 8 <= JOINT_ACCUMULATORS)
                weighted_v(vh, table, block_size, tok_stride, row_bytes, start, len, scores, n, oh, head_dim, fmt,
                           3, 8, 1);
            else if (C == 8 && group == 2 && 2 * 8 <= JOINT_ACCUMULATORS)
                weighted_v(vh, table, block_size, tok_stride, row_bytes, start, len, scores, n, oh, head_dim, fmt,
                           2, 8, 1);
            else
                for (int64_t g = 0; C && g < group; g++)
                    weighted_v(vh, table, block_size, tok_stride, row_bytes, start, len, scores + g * n, n,
                               oh + g * head_dim, head_dim, fmt, 1, C, g == 0);
            for (int64_t p = start, t = 0; p < len && !C;) {
                const int64_t off = p % block_size, run = (block_size - off < len - p) ? block_size - off : len - p;
                const uint8_t *vr = vc + (table[p / block_size] * block_size + off) * tok_stride + h * row_bytes;
                for (int64_t j = 0; j < run; j++, t++, vr += tok_stride) {
                    const float vs = row_scale(vr, head_dim, fmt);
                    for (int64_t g = 0; g < group; g++)
                        row_axpy(oh + g * head_dim, scores[g * n + t] * vs, vr, head_dim, fmt);
                }
                p += run;
            }
            for (int64_t g = 0; g < group; g++) {
                const float inv = 1.f / sum[g];
                float *og = oh + g * head_dim;
                for (int64_t d = 0; d < head_dim; d++) og[d] *= inv;
            }
            free(scores);
        }
    }
}

/* The work of one call shared by the threads of an enclosing OpenMP parallel region (layer_stack.c):
 * kv_format: KV_F32, KV_INT8 (rows with a scale) or KV_F16. Each branch is an instantiation with
 * its row format fixed at compile time. */
void paged_attention_team(const float *q, const void *k_cache, const void *v_cache, float *out,
                          const int64_t *qrow, const int64_t *qseq, const int64_t *tables, int64_t table_stride,
                          const int64_t *lens, int64_t num_rows, int64_t num_heads, int64_t kv_heads,
                          int64_t head_dim, int64_t block_size, float scale, int64_t window, int64_t kv_format) {
    /* Instantiations with the row format and, for the usual head sizes, head_dim / 8 fixed at
     * compile time (C = 0: any head_dim). */
#define ATTEND(FMT, C) attend(q, k_cache, v_cache, out, qrow, qseq, tables, table_stride, lens, num_rows, \
                              num_heads, kv_heads, head_dim, block_size, scale, window, FMT, C)
#define BY_SIZE(FMT) do { if (C == 8) ATTEND(FMT, 8); else if (C == 16) ATTEND(FMT, 16); else ATTEND(FMT, 0); } while (0)
    const int C = head_dim == 64 ? 8 : head_dim == 128 ? 16 : 0;
    if (kv_format == KV_INT8) BY_SIZE(KV_INT8);
    else if (kv_format == KV_F16) BY_SIZE(KV_F16);
    else BY_SIZE(KV_F32);
#undef BY_SIZE
#undef ATTEND
}

/* The exported entry: its own parallel region over num_threads threads. */
void paged_attention(const float *q, const void *k_cache, const void *v_cache, float *out,
                     const int64_t *qrow, const int64_t *qseq, const int64_t *tables, int64_t table_stride,
                     const int64_t *lens, int64_t num_rows, int64_t num_heads, int64_t kv_heads,
                     int64_t head_dim, int64_t block_size, float scale, int64_t window,
                     int64_t num_threads, int64_t kv_format) {
    (void)num_threads;
    #pragma omp parallel num_threads(num_threads)
    paged_attention_team(q, k_cache, v_cache, out, qrow, qseq, tables, table_stride, lens, num_rows, num_heads,
                         kv_heads, head_dim, block_size, scale, window, kv_format);
}
